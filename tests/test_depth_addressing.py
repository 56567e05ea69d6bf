"""Depth-wise batching's first brick (issue 47, docs/depth-batching.md): rows at different
loops share one pass over the layers. ``PerDepth.entry(..., loop=t)`` shifts a row's blocks by
``t`` loops' planes, so a pass that calls every layer at loop 0 reads and writes plane
``t * L + l`` for that row. Checked on the model itself against the loop run plainly: the same
states and the same K/V bits, alone and with rows at other loops beside it, on the cpu and the
emulated npu (a CPU test double)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hal.types import AttentionMetadata, KVAddressing
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams

PROMPTS = {"a": list(range(40, 60)), "b": [7, 300, 12, 9, 88, 41, 5]}


@pytest.fixture(scope="module", params=["cpu", "npu"], ids=["cpu", "npu-emulated"])
def prefilled(request, tiny_ckpt):
    """An engine whose two requests have computed their prompts (every plane) and sampled a
    first token, whose loops the tests then run by hand."""
    llm = LLM(tiny_ckpt, device=request.param, block_size=16, num_blocks=32, deterministic=True)
    engine = llm.engine
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=8, ignore_eos=True))
    while any(not engine.requests[r].output_ids for r in PROMPTS):
        engine.step()
    return llm


def _pass(llm, rows, planted: bool = False):
    """One pass over the layers, every layer called at loop 0, of ``rows``: (request, loop,
    state) each, at the request's next position; the pass's output states. ``planted``: an
    addressing bug, each row's blocks shifted a layer's plane too far."""
    engine, model = llm.engine, llm.engine.model
    kv = engine.kv
    entries = [kv.entry(req, 1, len(req.prompt_ids), loop) for req, loop, _ in rows]
    address = kv.addressing(entries)
    if planted:
        nb, slots = kv.allocator.num_blocks, kv.allocator.num_blocks * kv.block_size
        wrong = [(n, c, [b + (t * kv.layers + 1) * nb for b in bl]) for n, c, bl, t in entries]
        meta = AttentionMetadata.build(kv.block_size, wrong, kv.loops * kv.layers * slots)
        address = KVAddressing.uniform(meta, kv.layers, slots)
    device = model.embed.device
    address, _ = address.to(device)
    positions = [ctx for _, ctx, *_ in entries]
    cos, sin = model.rope(torch.tensor(positions, device=device), max(positions))
    h = torch.stack([state for *_, state in rows])
    return model.loop(0, h, cos, sin, address, model.kernels.bind(0))


def _plain(llm, req):
    """The request's next token through every loop as a plain step runs it: its state after
    each loop, and the K/V rows it wrote at each (loop, layer) plane."""
    model, kv = llm.engine.model, llm.engine.kv
    entry = kv.entry(req, 1, len(req.prompt_ids))
    device = model.embed.device
    address, _ = kv.addressing([entry]).to(device)
    pos = torch.tensor([len(req.prompt_ids)], device=device)
    cos, sin = model.rope(pos, int(pos[0]))
    x = F.embedding(torch.tensor([req.output_ids[0]], device=device), model.embed)
    states = []
    for t in range(model.cfg.total_ut_steps):
        x = model.loop(t, x, cos, sin, address, model.kernels.bind(0))
        states.append(x)
    return states, _written(llm, req)


def _written(llm, req) -> torch.Tensor:
    """The K and V rows of the request's next position at every plane."""
    store = llm.engine.model.kv
    bs = llm.engine.kv.block_size
    p = len(req.prompt_ids)
    slot = req.blocks[p // bs] * bs + p % bs
    planes = llm.engine.kv.loops * llm.engine.kv.layers
    caches = (store.key_cache, store.value_cache)
    return torch.stack(
        [torch.stack([store.rows(c, q)[slot] for c in caches]) for q in range(planes)]
    )


def _clear(llm, req) -> None:
    store = llm.engine.model.kv
    bs = llm.engine.kv.block_size
    p = len(req.prompt_ids)
    slot = req.blocks[p // bs] * bs + p % bs
    for q in range(llm.engine.kv.loops * llm.engine.kv.layers):
        for cache in (store.key_cache, store.value_cache):
            store.rows(cache, q)[slot].zero_()


def test_a_row_at_loop_t_in_a_loop_0_pass_is_loop_t_bit_for_bit(prefilled):
    llm = prefilled
    reqs = [llm.engine.requests[r] for r in PROMPTS]
    model = llm.engine.model
    T = model.cfg.total_ut_steps
    plain = {}
    for req in reqs:
        _clear(llm, req)
        plain[req.request_id] = _plain(llm, req)
    for req in reqs:
        _clear(llm, req)
    device = model.embed.device
    first = {
        r.request_id: F.embedding(torch.tensor([r.output_ids[0]], device=device), model.embed)[0]
        for r in reqs
    }
    a, b = reqs
    # Loop by loop, the two requests a loop apart in every pass (b starts one pass later),
    # each row reading and writing its own loop's planes.
    state = {a.request_id: first[a.request_id], b.request_id: None}
    loop = {a.request_id: 0, b.request_id: -1}
    for _ in range(T + 1):
        rows = []
        for req in reqs:
            rid = req.request_id
            if loop[rid] == -1:
                loop[rid], state[rid] = 0, first[rid]
                continue
            if loop[rid] < T:
                rows.append((req, loop[rid], state[rid]))
        if rows:
            out = _pass(llm, rows)
            for i, (req, t, _) in enumerate(rows):
                want_states, _ = plain[req.request_id]
                assert torch.equal(out[i], want_states[t][0]), (req.request_id, t)
                state[req.request_id], loop[req.request_id] = out[i], t + 1
    for req in reqs:
        assert torch.equal(_written(llm, req), plain[req.request_id][1]), req.request_id


def test_a_planted_plane_shift_is_caught(prefilled):
    llm = prefilled
    req = llm.engine.requests["a"]
    model = llm.engine.model
    _clear(llm, req)
    states, _ = _plain(llm, req)
    _clear(llm, req)
    x = F.embedding(torch.tensor([req.output_ids[0]]), model.embed)[0].to(states[0].device)
    good = _pass(llm, [(req, 1, states[0][0])])
    assert torch.equal(good[0], states[1][0])
    bad = _pass(llm, [(req, 1, states[0][0])], planted=True)
    assert not torch.equal(bad[0], states[1][0])
    assert x.shape == states[0][0].shape


def test_entries_are_checked_against_their_own_plane(prefilled):
    kv = prefilled.engine.kv
    req = prefilled.engine.requests["a"]
    with pytest.raises(ValueError, match=r"loop must be in \[0, 4\)"):
        kv.entry(req, 1, len(req.prompt_ids), 4)
    n, ctx, blocks, _ = kv.entry(req, 1, len(req.prompt_ids), 1)
    wild = list(blocks)
    wild[ctx // kv.block_size] += kv.allocator.num_blocks  # the new row past its own plane
    with pytest.raises(IndexError, match="slot mapping has a slot outside"):
        kv.addressing([(n, ctx, wild, 1)])
