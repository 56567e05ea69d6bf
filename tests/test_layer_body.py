"""The one layer body's data: the exact plan's kernel compositions, the span layout of a step,
and adaptive depth's refusal of speculative steps."""

from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from hal.kernels import hf_rms_norm
from runtime_glue.engine.spans import step_layout
from runtime_glue.ouro.adaptive import Adaptive
from runtime_glue.ouro.loop_kernels import LoopKernels, add_then_norm, hf_rotary
from runtime_glue.ouro.records import StepInputs


def _kernels(prompt_norm, generated_norm) -> LoopKernels:
    return LoopKernels(
        rows={"prompt": {"rms_norm": prompt_norm}, "generated": {"rms_norm": generated_norm}},
        split=True, stacked=True, silu_mul=None, add_rms_norm=add_then_norm, rotary=hf_rotary,
        static_decode=False,
    )  # fmt: skip


def test_the_exact_add_rms_norm_is_hfs_residual_add_then_each_row_kinds_own_norm():
    gen = torch.Generator().manual_seed(0)
    h, a = (torch.randn(7, 64, generator=gen).bfloat16() for _ in range(2))
    weight = torch.randn(64, generator=gen).bfloat16()
    hf_norm = LlamaRMSNorm(64, eps=1e-6).bfloat16()
    hf_norm.weight.data.copy_(weight)
    twice = lambda x, w, eps: hf_rms_norm(x, w, eps) * 2  # noqa: E731 (a second row kind)
    normed, total = _kernels(hf_rms_norm, twice).bind(3).add_rms_norm(a, h, weight, 1e-6)
    want = h + a  # HF's decoder layer: hidden = residual + hidden
    assert torch.equal(total, want)
    assert torch.equal(normed[:3], hf_norm(want)[:3])  # prompt rows: the prompt kernel
    assert torch.equal(normed[3:], hf_norm(want)[3:] * 2)  # generated rows: theirs


def test_a_fast_plan_without_a_fused_add_rms_norm_adds_then_runs_its_own_norm(tiny_ckpt):
    """On cpu (no fused add_rms_norm) the fast plan records torch's; the loop then runs HF's
    add and the plan's own (fastest) norm, not HF's norm composition of a dozen ops."""
    from runtime_glue.engine.llm import LLM

    fast = LLM(tiny_ckpt, device="cpu", mode="fast", block_size=16, num_blocks=8)
    assert dict(fast.plan.fused)["add_rms_norm"] == "torch"
    assert fast.model.kernels.add_rms_norm is add_then_norm


def test_the_exact_rotary_is_hfs_in_bits_and_in_the_layout_attention_gets():
    gen = torch.Generator().manual_seed(1)
    n, heads, kv_heads, d = 5, 4, 2, 16
    q = torch.randn(n, heads * d, generator=gen).bfloat16()
    k = torch.randn(n, kv_heads * d, generator=gen).bfloat16()
    cos, sin = (torch.randn(1, n, d, generator=gen).bfloat16() for _ in range(2))
    want_q, want_k = apply_rotary_pos_emb(
        q.view(1, n, heads, d).transpose(1, 2), k.view(1, n, kv_heads, d).transpose(1, 2), cos, sin
    )  # HF's attention module: [1, heads, N, d]
    got_q, got_k = hf_rotary(q.view(n, heads, d), k.view(n, kv_heads, d), cos[0], sin[0])
    for got, want in ((got_q, want_q), (got_k, want_k)):
        as_attention_gets_it = got.transpose(0, 1)[None]  # as OuroModel.attention hands it on
        assert torch.equal(as_attention_gets_it, want)
        assert as_attention_gets_it.stride()[1:] == want.stride()[1:]


GROUPS = {"prompt": 2, "generated": 3, "draft": 2, "verify": 4}


def test_a_plain_step_is_one_span_of_every_row_through_every_loop():
    groups = {**GROUPS, "draft": 0, "verify": 0}
    for early in (None, 2):  # speculation on, but nobody drafts or verifies this step
        (span,) = step_layout(groups, groups, [1, 4], 4, early).spans
        assert span.loops == range(4) and span.rows == tuple(range(5))
        assert span.entries == tuple(range(5))
        assert span.samples == (0, 1) and span.sample_at == (1, 4)


def test_a_speculative_step_runs_drafts_to_loop_e_and_verifies_from_it():
    entries = {**GROUPS, "prompt": 1}  # a prompt chunk of two rows is one attention entry
    sample_rows = [4, 5, 6, 7, 8, 9, 10]
    layout = step_layout(GROUPS, entries, sample_rows, 4, 1)
    first, second = layout.spans
    assert first.loops == range(1) and second.loops == range(1, 4)
    assert first.rows == (0, 1, 2, 3, 4, 5, 6) and first.entries == tuple(range(6))
    assert second.rows == (0, 1, 2, 3, 4, 7, 8, 9, 10)
    assert second.entries == (0, 1, 2, 3, 6, 7, 8, 9)
    assert first.samples == (0, 1, 2) and first.sample_at == (4, 5, 6)
    assert second.samples == (0, 3, 4, 5, 6) and second.sample_at == (4, 5, 6, 7, 8)
    assert layout.kept == (7, 8, 9, 10) and layout.kept_samples == (3, 4, 5, 6)


def test_adaptive_depth_refuses_a_step_of_several_spans_instead_of_running_full_depth():
    step = SimpleNamespace(spans=("draft span", "verify span"))
    with pytest.raises(RuntimeError, match="--speculative-loops cannot be combined with --adap"):
        Adaptive.start(None, step)


def test_step_inputs_always_hold_a_span():
    fields = dict.fromkeys(
        ("input_ids", "positions", "kv", "sample_rows", "prompt_rows", "prompt_samples",
         "max_position", "exits", "host_sample_rows"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="spans"):
        StepInputs(**fields, spans=())
