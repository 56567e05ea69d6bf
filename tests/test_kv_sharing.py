"""Decode KV sharing (``--kv-sharing last``): exact against its own HF-module reference, cheaper
in the pool, and every allocator guarantee kept for both block kinds."""

from __future__ import annotations

import functools

import pytest
import torch

from hal import shared_kv
from runtime_glue.engine.core import InvalidRequest
from runtime_glue.engine.kv_manager import BlockAllocator
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.engine.shared_blocks import SharedBlocks
from tests.helpers import GREEDY, prompt_of, reference

PROMPTS = [prompt_of(5, seed=1), prompt_of(21, seed=2), prompt_of(33, seed=3)]
MAX_NEW = 24  # crosses generated blocks of 16


@functools.lru_cache(maxsize=32)
def sharing_reference(
    model_dir, prompt: tuple[int, ...], max_new: int, kv_sharing: str, block_size: int = 16
):
    return reference(model_dir).generate(
        list(prompt), max_new, kv_sharing=kv_sharing, block_size=block_size
    )


def run_sharing_case(llm: LLM, model_dir, prompts=PROMPTS, max_new: int = MAX_NEW) -> None:
    """Each prompt alone gives the sharing reference's tokens and logits bit for bit."""
    bs = llm.kv_layout.block_size
    for prompt in prompts:
        [out] = llm.generate(
            [prompt], SamplingParams(max_tokens=max_new, **GREEDY), return_logits=True
        )
        tokens, logits = sharing_reference(model_dir, tuple(prompt), max_new, "last", bs)
        assert list(out.token_ids) == tokens, f"prompt of {len(prompt)} tokens diverged"
        assert torch.equal(out.logits, logits), (
            f"logits differ by {(out.logits - logits).abs().max().item()}"
        )


def hf_exact(model_dir, device: str = "cpu", **options) -> LLM:
    options = {"block_size": 16, "num_blocks": 16, **options}
    return LLM(model_dir, device=device, deterministic=False, kv_sharing="last", **options)


# -- exactness against the reference -------------------------------------------------------


@pytest.mark.parametrize("config", ["tiny", "gqa-h256-d32-L3-T4", "mqa-h128-d64-L2-T2"])
def test_sharing_matches_the_sharing_reference_bit_for_bit(checkpoints, driver_name, config):
    from tests.conftest import PARITY_CONFIGS

    ckpt = checkpoints(config, **PARITY_CONFIGS.get(config, {}))
    run_sharing_case(hf_exact(ckpt, driver_name), ckpt)


def test_sharing_changes_the_arithmetic_but_not_the_prompt(tiny_ckpt):
    prompt = tuple(PROMPTS[1])
    full_tokens, full = sharing_reference(tiny_ckpt, prompt, MAX_NEW, "none")
    _, shared = sharing_reference(tiny_ckpt, prompt, MAX_NEW, "last")
    assert torch.equal(shared[0], full[0]), "the first token comes from the prompt alone"
    assert not torch.equal(shared[1:], full[1:]), "sharing should change later logits"


def test_a_loop_reading_its_own_plane_for_generated_positions_is_caught(tiny_ckpt, monkeypatch):
    """Planted bug: generated blocks addressed like prompt ones (loop t's plane, not shared)."""

    def per_loop(request, t, layers, num_blocks):
        _, _, prompt, _, generated = request
        return [
            b + t * layers * num_blocks for b in [*prompt, *(g % num_blocks for g in generated)]
        ]

    monkeypatch.setattr(shared_kv, "loop_table", per_loop)
    with pytest.raises(AssertionError):
        run_sharing_case(hf_exact(tiny_ckpt, num_blocks=64), tiny_ckpt, PROMPTS[:1])


def test_sharing_from_a_block_too_late_is_refused_on_the_host(tiny_ckpt, monkeypatch):
    """Planted bug: the KV placement keeps one more block of generated positions in every
    plane than the rule says; the step's addressing refuses it before anything runs."""
    from runtime_glue.engine import kv_placement

    real = kv_placement.prompt_blocks
    monkeypatch.setattr(kv_placement, "prompt_blocks", lambda n, bs: real(n, bs) + 1)
    with pytest.raises(RuntimeError, match="2 prompt blocks for a prompt of 5 tokens"):
        run_sharing_case(hf_exact(tiny_ckpt), tiny_ckpt, PROMPTS[:1], max_new=40)


def test_a_reference_that_keeps_the_first_loop_disagrees(tiny_ckpt, monkeypatch):
    """The reference is no copy of the runtime: planting the bug there is caught too."""
    from runtime_glue.checks import reference as ref_module

    real = ref_module.SharedDecodeCache.update

    def first_loop(self, key, value, layer_idx, *args, **kwargs):
        if self.sharing and layer_idx >= self.num_layers:  # later loops: keep loop 0's
            t, layer = divmod(layer_idx, self.num_layers)
            k, v = self.shared[layer]
            pk, pv = self.prompt[layer_idx]
            own_k = torch.cat((k[:, :, :-1], key), dim=-2)
            own_v = torch.cat((v[:, :, :-1], value), dim=-2)
            return torch.cat((pk, own_k), dim=-2), torch.cat((pv, own_v), dim=-2)
        return real(self, key, value, layer_idx, *args, **kwargs)

    monkeypatch.setattr(ref_module.SharedDecodeCache, "update", first_loop)
    sharing_reference.cache_clear()
    try:
        with pytest.raises(AssertionError):
            run_sharing_case(hf_exact(tiny_ckpt), tiny_ckpt, PROMPTS[:1])
    finally:
        sharing_reference.cache_clear()


def test_a_request_reads_only_its_own_prompt_planes_and_shared_planes(tiny_ckpt, driver_name):
    """Poison every store row a request does not own after its prefill: decode is unchanged."""
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=MAX_NEW, **GREEDY)
    [want] = hf_exact(tiny_ckpt, driver_name).generate([prompt], params, return_logits=True)
    llm = hf_exact(tiny_ckpt, driver_name)
    eng = llm.engine
    eng.add_request("r", prompt, params, return_logits=True)
    eng.step()
    req = eng.requests["r"]
    assert req.num_computed == len(prompt)
    total = -(-(len(prompt) + MAX_NEW) // 16)
    req.gen_blocks += eng.shared.allocate(total - len(req.blocks))  # its future blocks, now
    cfg, lay = llm.config, llm.kv_layout
    kv_of = shared_kv.build_shared_addressing(
        16,
        [(0, len(prompt) + MAX_NEW, req.blocks, len(prompt), req.gen_blocks)],
        lay.num_blocks,
        cfg.num_hidden_layers,
        cfg.total_ut_steps,
    )
    keep = torch.zeros(lay.num_planes * lay.num_slots, dtype=torch.bool)
    for t in range(cfg.total_ut_steps):
        for layer in range(cfg.num_hidden_layers):
            base = kv_of.plane(t, layer) * lay.num_slots
            keep[base + kv_of.meta(t).request_slots(0)] = True
    kv = llm.kv_store
    for cache in (kv.key_cache, kv.value_cache):
        kv.rows(cache)[~keep] = float("nan")
    while eng.has_unfinished():
        eng.step()
    assert req.output_ids == list(want.token_ids)
    assert torch.equal(torch.stack(req.logits), want.logits)


# -- deterministic mode --------------------------------------------------------------------


def test_deterministic_bits_do_not_depend_on_chunking_or_batching(tiny_ckpt):
    params = SamplingParams(max_tokens=20, **GREEDY)
    alone = LLM(tiny_ckpt, deterministic=True, kv_sharing="last", block_size=16, num_blocks=32)
    want = [alone.generate([p], params, return_logits=True)[0] for p in PROMPTS]
    mixed = LLM(
        tiny_ckpt,
        deterministic=True,
        kv_sharing="last",
        block_size=16,
        num_blocks=32,
        prefill_chunk_size=7,
    )
    got = mixed.generate(PROMPTS, params, return_logits=True)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert torch.equal(g.logits, w.logits)


# -- the pool ------------------------------------------------------------------------------


def _run_audited(llm: LLM, prompts, params):
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params, return_logits=True)
    reqs = dict(eng.requests)
    peak = 0
    while eng.has_unfinished():
        eng.step()
        eng.audit_pages()
        peak = max(peak, len(eng.running))
    return [reqs[f"r{i}"] for i in range(len(prompts))], peak


def test_a_generated_block_costs_a_quarter_of_a_pool_block(tiny_ckpt):
    """Same pool: four 120-token generations need preemption without sharing, not with it."""
    prompts = [prompt_of(10, seed=s) for s in range(4)]
    params = SamplingParams(max_tokens=120, **GREEDY)
    blocks = 20  # full KV: 4 x ceil(130 / 16) = 36 blocks; shared: 4 + ceil(4 * 8 / 4) = 12
    full = LLM(tiny_ckpt, block_size=16, num_blocks=blocks, max_num_seqs=4)
    _, _ = _run_audited(full, prompts, params)
    assert full.engine.stats["preemptions"] > 0
    llm = LLM(tiny_ckpt, block_size=16, num_blocks=blocks, max_num_seqs=4, kv_sharing="last")
    reqs, peak = _run_audited(llm, prompts, params)
    assert llm.engine.stats["preemptions"] == 0 and peak == 4
    assert all(len(r.output_ids) == 120 for r in reqs)
    assert llm.engine.num_free_blocks == blocks, "every block is back in the pool"


def test_preempted_requests_recompute_the_same_bits(tiny_ckpt):
    prompts = [prompt_of(20, seed=s) for s in range(3)]
    params = SamplingParams(max_tokens=60, **GREEDY)
    roomy = LLM(tiny_ckpt, block_size=16, num_blocks=64, kv_sharing="last")
    want = [roomy.generate([p], params, return_logits=True)[0] for p in prompts]
    tight = LLM(tiny_ckpt, block_size=16, num_blocks=7, kv_sharing="last")
    reqs, _ = _run_audited(tight, prompts, params)
    assert tight.engine.stats["preemptions"] > 0, "the pool should have run dry"
    for w, r in zip(want, reqs, strict=True):
        assert tuple(r.output_ids) == w.token_ids
        assert torch.equal(torch.stack(r.logits), w.logits)
    assert tight.engine.num_free_blocks == 7


def test_prefix_caching_shares_prompt_blocks_only(tiny_ckpt):
    base = prompt_of(40, seed=9)
    prompts = [base + prompt_of(5, seed=s) for s in (1, 2)]
    params = SamplingParams(max_tokens=30, **GREEDY)
    plain = LLM(tiny_ckpt, block_size=16, num_blocks=32, kv_sharing="last")
    want = [plain.generate([p], params, return_logits=True)[0] for p in prompts]
    cached = LLM(
        tiny_ckpt, block_size=16, num_blocks=32, kv_sharing="last", enable_prefix_caching=True
    )
    first, _ = _run_audited(cached, prompts[:1], params)
    second, _ = _run_audited(cached, prompts[1:], params)
    assert cached.engine.stats["prefix_cache_hits"] == 32
    for w, r in zip(want, first + second, strict=True):
        assert tuple(r.output_ids) == w.token_ids
        assert torch.equal(torch.stack(r.logits), w.logits)


def test_aborts_free_both_kinds_of_block(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=16, num_blocks=12, kv_sharing="last")
    eng = llm.engine
    params = SamplingParams(max_tokens=100, **GREEDY)
    for i in range(3):
        eng.add_request(f"r{i}", prompt_of(18, seed=i), params)
    for _ in range(30):
        eng.step()
        eng.audit_pages()
    assert all(r.gen_blocks for r in eng.running)
    for i in range(3):
        assert eng.abort_request(f"r{i}")
        eng.audit_pages()
    assert eng.num_free_blocks == 12 and not eng.shared.homes


def test_generated_blocks_wait_for_their_fence():
    class Pending:
        def __init__(self):
            self.ready = False

        def done(self):
            return self.ready

        def wait(self):
            self.ready = True

    pool = BlockAllocator(4, 16)
    shared = SharedBlocks(pool, loops=4)
    a = shared.allocate(3)
    assert a is not None and len(shared.homes) == 1 and pool.num_free == 3
    b = shared.allocate(2)
    assert b is not None and len(shared.homes) == 2, "the fifth generated block needs a home"
    fence = Pending()
    shared.free_after(a + b, fence)
    shared.audit([])
    pool.audit([shared.homes])
    assert pool.num_free == 2, "nothing is reused before its fence"
    shared.reclaim(wait=True)
    assert pool.num_free == 4 and not shared.homes
    pool.audit([])


def test_generated_blocks_fill_partial_homes_first():
    pool = BlockAllocator(3, 16)
    shared = SharedBlocks(pool, loops=4)
    blocks = shared.allocate(8)  # two homes, full
    assert blocks is not None and len(shared.homes) == 2
    full, emptier = shared.homes
    idle = shared.blocks_of(full)[:1] + shared.blocks_of(emptier)[:2]
    shared.free_after(idle, None)  # one home has 1 idle block, the other 2
    again = shared.allocate(1)
    assert again is not None and shared.home(again[0]) == full
    with pytest.raises(RuntimeError, match="not allocated"):
        shared.free_after(idle[1:2], None)


# -- bad input, the banner and the interplay with adaptive depth ---------------------------


def test_bad_kv_sharing_values_are_refused(tiny_ckpt):
    with pytest.raises(ValueError, match="kv_sharing must be one of none, last"):
        LLM(tiny_ckpt, kv_sharing="first")
    llm = LLM(tiny_ckpt, block_size=16, num_blocks=4, kv_sharing="last")
    with pytest.raises(InvalidRequest, match="under kv sharing, but the whole pool has 4"):
        llm.engine.validate(prompt_of(40), SamplingParams(max_tokens=200))
    llm.engine.validate(prompt_of(40), SamplingParams(max_tokens=60))  # 3 + 1 blocks fit


def test_the_banner_names_both_block_kinds(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=16, num_blocks=10, kv_sharing="last")
    planes = llm.config.num_planes
    assert f"a prompt block keeps {planes} planes, a generated block {planes // 4}" in (
        llm.kv_summary
    )
    assert "10 prompt blocks or 40 generated blocks" in llm.kv_summary


def test_adaptive_depth_leaves_the_exit_loops_kv_in_the_shared_plane(tiny_ckpt):
    """Every decode row exits after loop 0: its shared planes hold loop 0's K/V, which is what
    full KV holds for it once adaptive depth copies loop 0 into the skipped planes; both runs
    therefore agree bit for bit."""
    params = SamplingParams(max_tokens=20, exit_threshold=1e-6, **GREEDY)
    prompts = PROMPTS[:2]
    runs = []
    for sharing in ("none", "last"):
        llm = LLM(tiny_ckpt, block_size=16, num_blocks=32, adaptive_depth=True, kv_sharing=sharing)
        runs.append(llm.generate(prompts, params, return_logits=True))
    for full, shared in zip(*runs, strict=True):
        assert set(shared.exit_steps[1:]) == {0}
        assert shared.token_ids == full.token_ids
        assert torch.equal(shared.logits, full.logits)


def test_with_one_loop_sharing_is_full_kv(checkpoints):
    from tests.conftest import PARITY_CONFIGS

    ckpt = checkpoints("mha-h96-d32-L1-T1", **PARITY_CONFIGS["mha-h96-d32-L1-T1"])
    llm = hf_exact(ckpt)
    for prompt in PROMPTS[:2]:
        [out] = llm.generate(
            [prompt], SamplingParams(max_tokens=MAX_NEW, **GREEDY), return_logits=True
        )
        _, full = sharing_reference(ckpt, tuple(prompt), MAX_NEW, "none")
        assert torch.equal(out.logits, full)


def test_the_quality_eval_sees_no_cost_with_one_loop_and_a_cost_with_four(checkpoints, tiny_ckpt):
    from runtime_glue.checks.kv_sharing_eval import kv_sharing_quality
    from tests.conftest import PARITY_CONFIGS

    held = torch.tensor([prompt_of(33, seed=s) for s in (4, 5)])
    one = checkpoints("mha-h96-d32-L1-T1", **PARITY_CONFIGS["mha-h96-d32-L1-T1"])
    report = kv_sharing_quality(LLM(one, block_size=16, num_blocks=16), held, prefix=8)
    assert report["last_kv"] == report["none_kv"]
    assert report["greedy_token_agreement"] == report["teacher_forced_argmax_agreement"] == 1.0
    report = kv_sharing_quality(LLM(tiny_ckpt, block_size=16, num_blocks=16), held, prefix=8)
    assert report["last_kv"]["perplexity"] != report["none_kv"]["perplexity"]
    assert report["scored_tokens"] == 2 * 25
