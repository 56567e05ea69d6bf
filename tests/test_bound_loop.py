"""The bound decode loop (``runtime_glue.ouro.bound_loop``): decode-sized layer passes with
every kernel bound once give the per-op path's bits, in every plan and scheme it runs, at
every row count (odd ones pad to row tiles); where it cannot run, the model keeps the per-op
path and says why."""

from __future__ import annotations

import logging

import pytest
import torch

from drivers.cpu import kernels
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.bound_loop import bound_loop
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs AVX2"
)

NAME = "gqa-h256-d32-L3-T4"
PROMPTS = [prompt_of(n, seed=s) for s, n in enumerate((9, 30, 4, 17, 12))]
# Requests leave one by one: decode steps of 5, 4, 3, 2 and 1 rows.
PARAMS = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (3, 5, 7, 9, 6)]
# Each C kernel named (a timed plan may pick torch's at these widths, which has no bound form).
PLANS = {
    "bf16": {"linear": "avx2"},
    "fast": {"mode": "fast", "linear": "avx2"},
    # torch's projections have no bound form: they run their row functions inside the loop
    "torch-linear": {"linear": "torch"},
    "int8-torch": {"quantization": "int8", "linear": "int8-torch"},
    "int8": {"quantization": "int8", "linear": "int8-avx2"},
    "int8-w8a8": {
        "quantization": "int8",
        "linear": "int8-a8-avx2",
        "quantize_activations": "block",
    },
    "int8-token": {
        "quantization": "int8",
        "linear": "int8-token-avx2",
        "quantize_activations": "token",
    },
    "int8g-64": {"quantization": "int8g", "quantization_group_size": 64, "linear": "int8g-avx2"},
    "int4-32": {"quantization": "int4", "quantization_group_size": 32, "linear": "int4-avx2"},
    "int4-128-w4a8": {
        "quantization": "int4",
        "quantization_group_size": 128,
        "linear": "int4-a8-avx2",
        "quantize_activations": "block",
    },
}


@pytest.fixture(scope="module")
def ckpt(checkpoints):
    # Hidden 256 and intermediate 768: every group size divides both.
    return checkpoints(NAME, seed=1, **{**PARITY_CONFIGS[NAME], "intermediate_size": 768})


def _generate(llm: LLM, sampling=PARAMS):
    return llm.generate(PROMPTS, sampling, return_logits=True)


def _counting(model) -> list[int]:
    """The row counts of every call the model's bound loop runs."""
    seen: list[int] = []
    run = model.bound.loop

    def loop(t, h, *args):
        seen.append(h.shape[0])
        return run(t, h, *args)

    model.bound.loop = loop
    return seen


def _same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert a.token_ids == b.token_ids and torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("plan", PLANS)
def test_bound_decode_passes_give_the_per_op_bits(ckpt, plan):
    bound = LLM(ckpt, block_size=16, num_blocks=64, **PLANS[plan])
    assert bound.model.bound is not None
    seen = _counting(bound.model)
    got = _generate(bound)
    assert {1, 2, 3, 4, 5} <= set(seen), seen  # odd counts pad to the plan's row tiles
    per_op = LLM(ckpt, block_size=16, num_blocks=64, **PLANS[plan])
    per_op.model.bound = None
    _same(got, _generate(per_op))


def test_sampled_chunked_and_speculative_steps_give_the_per_op_bits(ckpt):
    # Prompt chunks mixed with decode rows run per op; decode rows bound. Seeded sampling.
    opts = dict(block_size=16, num_blocks=64, prefill_chunk_size=8, **PLANS["int4-32"])
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=i) for i in range(5)]
    bound = LLM(ckpt, **opts)
    seen = _counting(bound.model)
    got = _generate(bound, params)
    assert seen
    per_op = LLM(ckpt, **opts)
    per_op.model.bound = None
    _same(got, _generate(per_op, params))
    spec = dict(opts, speculative_loops=2)
    bound, per_op = LLM(ckpt, **spec), LLM(ckpt, **spec)
    seen = _counting(bound.model)
    per_op.model.bound = None
    greedy = [SamplingParams(max_tokens=8, ignore_eos=True)] * 5
    _same(_generate(bound, greedy), _generate(per_op, greedy))
    assert seen


def test_hf_exact_plans_run_per_op_and_say_why(ckpt, caplog):
    with caplog.at_level(logging.DEBUG, logger="runtime_glue.ouro.bound_loop"):
        llm = LLM(ckpt, block_size=16, num_blocks=64, mode="hf-exact")
    assert llm.model.bound is None
    assert "unstacked (HF-exact)" in caplog.text


def test_a_bound_kernel_without_its_kernels_bits_is_not_used(ckpt, monkeypatch, caplog):
    # Planted: a bound linear whose first output is one ulp off. The start-up check refuses
    # the whole loop; the model runs per op.
    real = kernels.bound_linear

    def nudged(name, operands, *ints):
        call = real(name, operands, *ints)

        def wrong(out, x):
            call(out, x)
            out.view(torch.int16)[0, 0] += 1

        return wrong

    llm = LLM(ckpt, block_size=16, num_blocks=64)
    monkeypatch.setattr(kernels, "bound_linear", nudged)
    with caplog.at_level(logging.DEBUG, logger="runtime_glue.ouro.bound_loop"):
        assert bound_loop(llm.model, llm.driver) is None
    assert "qkv_proj's bound kernel differs from its row function" in caplog.text


def test_the_comparison_sees_a_wrong_bound_loop(ckpt):
    # Planted: two norms of one layer swapped in the bound loop; the equality above fails.
    llm = LLM(ckpt, block_size=16, num_blocks=64)
    layer = llm.model.bound.layers[1]
    layer["post_ln"], layer["post_ln_2"] = layer["post_ln_2"], layer["post_ln"]
    got = _generate(llm)
    per_op = LLM(ckpt, block_size=16, num_blocks=64)
    per_op.model.bound = None
    with pytest.raises(AssertionError):
        _same(got, _generate(per_op))
