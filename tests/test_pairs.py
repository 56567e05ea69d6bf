"""Features that combine, each with the guarantee it keeps, on the EMULATED npu (a test double
for step graphs and fused kernels, ``drivers.npu``) and cpu; and the pairs that are refused,
from one declaration with its reason (``runtime_glue.engine.args.REFUSED``, checked by ``runtime_glue.engine.refusals``).

- speculation x step graphs: draft and verify steps are captured; a replayed step equals the
  same step run eagerly bit for bit in every mode, and in deterministic mode speculative
  tokens and logits equal plain decoding's.
- speculation x fast mode: no bits are promised (fast mode keeps none); greedy tokens agree
  with plain fast-mode decoding as measured in tests/test_refusals.py (every pair, every entry
  point).
- kv sharing x step graphs: a replay is the eager step bit for bit in deterministic mode.
- kv sharing x fast mode: the sharing arithmetic in the fused loop, within fast mode's
  tolerance of the exact plan.
"""

from __future__ import annotations

import pytest

from runtime_glue.checks.parity import within_tolerance
from runtime_glue.engine.args import REFUSED, SET, EngineArgs
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.refusals import check_engine
from runtime_glue.engine.sampling import SamplingParams
from tests.helpers import GREEDY
from tests.test_kv_sharing import PROMPTS
from tests.test_step_graphs import _assert_same, _requests, _run

SPEC = dict(speculative_loops=1, num_speculative_tokens=3)
MODES = {
    "deterministic": dict(deterministic=True),
    "hf-exact": dict(deterministic=False),
    "fast": dict(mode="fast"),
}


def _npu(ckpt, mode: str, graphs: bool, **options) -> LLM:
    options = {"block_size": 16, "num_blocks": 48, "max_num_seqs": 4, **options}
    return LLM(ckpt, device="npu", step_graphs=graphs, **MODES[mode], **options)


def _shapes(llm: LLM) -> set[tuple[int, int, int]]:
    assert llm.engine.graphs is not None, llm.plan.admissions
    return {shape.rows for shape in llm.engine.graphs._graphs}


@pytest.mark.parametrize("mode", list(MODES))
def test_speculative_steps_replayed_from_graphs_equal_the_same_steps_run_eagerly(tiny_ckpt, mode):
    requests = _requests(3, max_tokens=9)
    eager = _run(_npu(tiny_ckpt, mode, False, **SPEC), requests)
    llm = _npu(tiny_ckpt, mode, True, **SPEC)
    replayed = _run(llm, requests)
    _assert_same(eager, replayed)
    shapes = _shapes(llm)
    assert any(draft for _, draft, _, _ in shapes), f"no draft step was captured: {shapes}"
    assert any(verify for _, _, verify, _ in shapes), f"no verify step was captured: {shapes}"
    assert llm.engine.graphs.stats["graph_steps"] > 0


def test_in_deterministic_mode_speculation_with_graphs_keeps_plain_decodings_bits(tiny_ckpt):
    requests = _requests(3, max_tokens=9, seed=4)
    plain = _run(_npu(tiny_ckpt, "deterministic", False), requests)
    _assert_same(plain, _run(_npu(tiny_ckpt, "deterministic", True, **SPEC), requests))


def test_kv_sharing_replayed_from_graphs_equals_the_same_steps_run_eagerly(tiny_ckpt):
    """In deterministic mode the graphs' padded attention is length-invariant by construction
    (``hal.eager.padded_attention``), so a replay is the eager step bit for bit. (In HF-exact
    mode the eager step is the sharing reference bit for bit, tests/test_kv_sharing.py; its
    replay pads each context to a bucket, and whether torch's bf16 softmax and matmuls keep
    their bits over the padding depends on the CPU: on an AVX2-only EPYC one step in twelve
    of this test's longest prompt parted in the last bits, on an AVX-512 Xeon none did.)"""
    requests = [
        (f"s{i}", prompt, SamplingParams(max_tokens=24, ignore_eos=True), True)
        for i, prompt in enumerate(PROMPTS)
    ]
    options = dict(kv_sharing="last", num_blocks=16)
    eager = _run(_npu(tiny_ckpt, "deterministic", False, **options), requests)
    llm = _npu(tiny_ckpt, "deterministic", True, **options)
    _assert_same(eager, _run(llm, requests))
    assert llm.engine.graphs.stats["graph_steps"] > 0


def test_kv_sharing_in_fast_mode_stays_near_the_exact_plan(tiny_ckpt):
    """The fused loop and its fused KV writes address shared blocks like any other; fast mode
    is within the tolerance it keeps without sharing (logits within 1.0 of the exact plan's
    while both are fed the same tokens, which part only at a near-tie: tests/test_npu_fused.py
    holds fast mode so)."""
    exact = _npu(tiny_ckpt, "hf-exact", False, kv_sharing="last", num_blocks=16)
    fast = _npu(tiny_ckpt, "fast", True, kv_sharing="last", num_blocks=16)
    assert fast.engine.graphs is not None
    params = SamplingParams(max_tokens=24, **GREEDY)
    for prompt in PROMPTS:
        [want] = exact.generate([prompt], params, return_logits=True)
        [got] = fast.generate([prompt], params, return_logits=True)
        check = within_tolerance(want.token_ids, want.logits, got.token_ids, got.logits, 1.0)
        assert check.passed and check.max_logit_diff > 0, check


@pytest.mark.parametrize("refused", REFUSED, ids=lambda r: f"{r[0]}-{r[2]}")
def test_each_refused_pair_is_refused_with_its_reason(refused):
    a, va, b, vb, why = refused
    values = {a: 1 if va is SET else va, b: 1 if vb is SET else vb}
    with pytest.raises(ValueError, match="cannot be combined with") as err:
        check_engine(EngineArgs(preset="tiny", **values))
    assert why in str(err.value)


@pytest.mark.parametrize(
    "options",
    [
        dict(speculative_loops=1, step_graphs=True),
        dict(speculative_loops=1, mode="fast"),
        dict(kv_sharing="last", mode="fast"),
        dict(kv_sharing="last", step_graphs=True),
        dict(adaptive_depth=True, kv_sharing="last"),
        dict(depth_batching=True, mode="fast"),
        dict(depth_batching=True, adaptive_depth=True),
        dict(depth_batching=True, kv_sharing="last"),
        dict(depth_batching=True, step_graphs=True),
        dict(depth_batching=True, step_graphs=True, adaptive_depth=True),
    ],
)
def test_the_pairs_that_combine_are_not_refused(options):
    check_engine(EngineArgs(preset="tiny", **options))


def test_only_the_declared_pairs_are_refused():
    assert {(a, b) for a, _, b, _, _ in REFUSED} == {
        ("speculative_loops", "kv_sharing"),
        ("speculative_loops", "adaptive_depth"),
        ("step_graphs", "adaptive_depth"),
        ("speculative_loops", "depth_batching"),
        ("num_blocks", "kv_cache_memory"),
        ("mode", "quantize_activations"),  # hf-exact with per-token activations
        ("deterministic", "quantize_activations"),  # --no-deterministic, its alias
    }
