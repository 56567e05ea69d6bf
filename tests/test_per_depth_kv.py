"""Per-depth KV state: isolation between planes and requests, causality."""

from __future__ import annotations

import torch

from hal.types import AttentionMetadata, KVAddressing
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.engine.step import sequence_inputs
from runtime_glue.ouro.exits import ExitMode
from tests.helpers import GREEDY, prompt_of, request_slots


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
    kv, written = llm.kv_store, request_slots(llm, req)
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
    meta = AttentionMetadata.build(16, [(3, n - 3, [0, 1])])  # positions 0..18 = slots 0..18
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
        meta = AttentionMetadata.build(16, [(n, 0, [0, 1])])
        cfg = llm.config
        kv = KVAddressing.uniform(meta, cfg.num_hidden_layers, llm.kv_layout.num_slots)
        modes = [ExitMode()] * n
        device = llm.driver.device.torch_device
        step = sequence_inputs(device, kv, ids, 0, True, modes, cfg.total_ut_steps)
        return model.forward(step).logits

    a = prompt_of(n, seed=5)
    b = list(a)
    b[j] = (a[j] + 1) % llm.config.vocab_size
    la, lb = all_logits(a), all_logits(b)
    assert torch.equal(la[:j], lb[:j])
    assert not torch.equal(la[j:], lb[j:])


def test_plane_t_times_l_plus_l_holds_loop_t_layer_ls_keys_and_values(tiny_ckpt):
    # The cache must hold, in plane t * L + l, the K (after RoPE) and V that loop t, layer l
    # computed for each position, and nothing from any other (loop, layer).
    from runtime_glue.ouro.loop_kernels import rotate_half

    llm = LLM(tiny_ckpt, device="cpu", block_size=16, num_blocks=4, deterministic=False)
    cfg, model, n = llm.config, llm.model, 10
    seen: dict[tuple[int, int, str], torch.Tensor] = {}
    model.recorder = lambda t, li, op, value: seen.setdefault((t, li, op), value.clone())
    req = _prefill_one(llm, prompt_of(n, seed=1))
    model.recorder = None
    slots = request_slots(llm, req)
    cos, sin = (c[0][:, None, :] for c in model.rope(torch.arange(n), n - 1))  # [n, 1, d]
    L, T = cfg.num_hidden_layers, cfg.total_ut_steps
    shape = (n, cfg.num_key_value_heads, cfg.head_dim)
    want = {}
    for t in range(T):
        for li in range(L):
            k = seen[(t, li, "k_proj")].view(shape)
            want[t * L + li] = (k * cos + rotate_half(k) * sin, seen[(t, li, "v_proj")].view(shape))
    for plane, (k, v) in want.items():
        got_k, got_v = llm.kv_store.key_cache[plane, slots], llm.kv_store.value_cache[plane, slots]
        assert torch.equal(got_k, k) and torch.equal(got_v, v), f"plane {plane}"
        others = [p for p in want if p != plane]
        assert not any(torch.equal(got_k, want[p][0]) for p in others), f"plane {plane} aliases"
