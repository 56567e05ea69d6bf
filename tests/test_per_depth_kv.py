"""Per-depth KV state: isolation between planes and requests, causality."""

from __future__ import annotations

import torch

from hal.types import AttentionMetadata, SequenceSlice
from runtime_glue.llm import LLM
from runtime_glue.model import StepInputs
from runtime_glue.sampling import SamplingParams
from tests.helpers import GREEDY, prompt_of


def _prefill_one(llm: LLM, prompt: list[int]):
    eng = llm.engine
    eng.add_request("r", prompt, SamplingParams(max_tokens=4, **GREEDY), return_logits=True)
    eng.step()  # full prefill + first token
    return eng.requests["r"]


def test_poisoning_every_slot_a_request_does_not_own_leaves_its_decode_unchanged(
    tiny_ckpt, driver_name
):
    prompt = prompt_of(21, seed=11)
    clean = LLM(tiny_ckpt, device=driver_name, block_size=16, num_blocks=8)
    want = clean.generate([prompt], SamplingParams(max_tokens=4, **GREEDY), return_logits=True)

    llm = LLM(tiny_ckpt, device=driver_name, block_size=16, num_blocks=8)
    req = _prefill_one(llm, prompt)
    kv, written = llm.kv_store, req.slots[: req.num_computed]
    keep = torch.zeros(kv.layout.num_slots, dtype=torch.bool)
    keep[written] = True
    for cache in (kv.key_cache, kv.value_cache):
        cache[:, ~keep] = float("nan")  # every plane, every slot but this request's own
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert req.output_ids == list(want[0].token_ids)
    assert torch.equal(torch.stack(req.logits), want[0].logits)


def test_attention_on_one_plane_reads_that_plane_and_no_other(tiny_ckpt, driver_name):
    llm = LLM(tiny_ckpt, device=driver_name, block_size=16, num_blocks=4)
    cfg, kv = llm.config, llm.kv_store
    planes, n = cfg.num_planes, 19
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(n)
    for p in range(planes):
        k = torch.randn(n, cfg.num_key_value_heads, cfg.head_dim, generator=gen)
        kv.write(p, k.bfloat16(), (k * 0.5).bfloat16(), slots)
    q = torch.randn(1, cfg.num_attention_heads, 3, cfg.head_dim, generator=gen).bfloat16()
    meta = AttentionMetadata((SequenceSlice(0, 3, n - 3, slots),), slots[-3:], 3)
    backend = llm.model.backend
    outs = [backend.forward(q, p, kv, meta, cfg.head_dim**-0.5) for p in range(planes)]
    assert all(not torch.equal(outs[0], o) for o in outs[1:]), "two planes alias each other"
    for p in range(planes):
        saved = kv.key_cache.clone(), kv.value_cache.clone()
        others = [i for i in range(planes) if i != p]
        kv.key_cache[others], kv.value_cache[others] = float("nan"), float("nan")
        assert torch.equal(backend.forward(q, p, kv, meta, cfg.head_dim**-0.5), outs[p])
        kv.key_cache.copy_(saved[0])
        kv.value_cache.copy_(saved[1])


def test_changing_a_later_token_never_changes_earlier_logits(tiny_ckpt, driver_name):
    llm = LLM(tiny_ckpt, device=driver_name, block_size=16, num_blocks=8)
    model, n, j = llm.model, 24, 15

    def all_logits(ids: list[int]) -> torch.Tensor:
        slots = torch.arange(n)
        meta = AttentionMetadata((SequenceSlice(0, n, 0, slots),), slots, n)
        rows = torch.arange(n)
        return model.forward(StepInputs(torch.tensor(ids), rows, meta, rows, n, n, n - 1))

    a = prompt_of(n, seed=5)
    b = list(a)
    b[j] = (a[j] + 1) % llm.config.vocab_size
    la, lb = all_logits(a), all_logits(b)
    assert torch.equal(la[:j], lb[:j])
    assert not torch.equal(la[j:], lb[j:])


def test_each_loop_writes_its_own_plane(tiny_ckpt):
    llm = LLM(tiny_ckpt, device="cpu", block_size=16, num_blocks=4)
    req = _prefill_one(llm, prompt_of(10, seed=1))
    rows = llm.kv_store.key_cache[:, req.slots[:10]]  # [planes, 10, kv_heads, d]
    L = llm.config.num_hidden_layers
    for t in range(1, llm.config.total_ut_steps):
        for li in range(L):
            assert not torch.equal(rows[li], rows[t * L + li]), (
                f"loop {t} layer {li} aliases loop 0"
            )
