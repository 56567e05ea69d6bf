"""The cpu driver's kernels (the ``avx2`` projection, deterministic attention and RMSNorm):
accuracy, row invariance, their place in the runtime and their errors. (Their speed is measured in
docs/benchmarks.md, not here.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drivers.cpu import kernels
from hal.eager import TensorKVStore
from hal.testing.reference import ATTENTION_BOUND, attention_f64
from hal.types import AttentionMetadata, KVLayout, SequenceSlice
from runtime_glue.determinism import check_row_invariance, check_rows
from runtime_glue.llm import LLM
from runtime_glue.model import rms_norm
from runtime_glue.sampling import SamplingParams
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs AVX2"
)


def _operands(m: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    return x, w


# Shapes cover every blocking edge: one row, odd row counts, more rows than a cache block
# (32), N not a multiple of the 4-row weight block, K with a scalar tail.
SHAPES = [(1, 64, 64), (2, 7, 9), (3, 5632, 2048), (5, 2048, 5632), (33, 100, 200), (70, 13, 24)]


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_the_kernel_is_as_accurate_as_torchs_bf16_linear(m, n, k):
    x, w = _operands(m, n, k)
    exact = x.double() @ w.double().T
    got = kernels.bf16_linear(x, w).double()
    # Both round an fp32 sum to bf16 once: at most half a bf16 ulp of the result (2^-9
    # relative) plus fp32 accumulation error, which k * 2^-24 * sum|x*w| bounds.
    accumulation = k * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    bound = exact.abs() * 2.0**-8 + accumulation + 1e-30
    assert ((got - exact).abs() <= bound).all()
    torch_err = (F.linear(x, w).double() - exact).abs().max()
    assert (got - exact).abs().max() <= 2 * torch_err + accumulation.max()


def test_leading_dimensions_and_views_are_handled():
    x, w = _operands(6, 40, 32)
    x3 = x.view(2, 3, 32)
    assert torch.equal(kernels.bf16_linear(x3, w), kernels.bf16_linear(x, w).view(2, 3, 40))
    strided = torch.cat([x, x], dim=1)[:, :32]  # not contiguous
    assert torch.equal(kernels.bf16_linear(strided, w), kernels.bf16_linear(x, w))
    assert kernels.bf16_linear(x[:0], w).shape == (0, 40)


def test_the_kernel_is_row_invariant_for_the_ouro_shapes():
    shapes = [(2048, 2048), (5632, 2048), (2048, 5632), (512, 2048)]
    weights = [_operands(1, n, k, seed=n + k)[1] for n, k in shapes]
    check_row_invariance(weights, kernels.bf16_linear)  # raises if a row's bits move


def _attention_case(heads, kv_heads, d, seed=0):
    """A one-plane cache with random K/V, and scattered slots for a 17-position request."""
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout(1, 4, 16, kv_heads, d)
    kv = TensorKVStore(layout, torch.device("cpu"))
    k, v = (
        torch.randn(2, 64, kv_heads, d, generator=gen)
        * torch.tensor([2.0, 1.0])[:, None, None, None]
    ).bfloat16()
    kv.write(0, k, v, torch.arange(64))
    slots = torch.randperm(64, generator=gen)[:17]
    q = (torch.randn(1, heads, 17, d, generator=gen) * 2).bfloat16()
    return kv, slots, q


def _run_attention(kv, q, seqs):
    """seqs: (query_start, query_len, context_len, slots); deterministic metadata."""
    slices = tuple(SequenceSlice(*s) for s in seqs)
    new = torch.cat([sl.kv_slots[sl.context_len :] for sl in slices])
    meta = AttentionMetadata(slices, new, q.shape[2], deterministic=True)
    rows = kernels.RowContexts.of(meta)
    return kernels.paged_attention(q, kv.key_cache[0], kv.value_cache[0], rows, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("heads, kv_heads, d", [(4, 4, 32), (6, 2, 36), (4, 1, 128)])
def test_deterministic_attention_is_close_to_float64_and_row_invariant(heads, kv_heads, d):
    kv, slots, q = _attention_case(heads, kv_heads, d)
    context = 5  # 12 query rows at positions 5..16
    full = _run_attention(kv, q[:, :, :12], [(0, 12, context, slots)])
    k, v = kv.gather(0, slots)
    ref = attention_f64(q[:, :, :12], k, v, d**-0.5, context)
    assert ((full.double() - ref).abs().max()) <= ATTENTION_BOUND * float(v.abs().max())
    for i in range(12):  # each row alone, as a decode step computes it
        alone = _run_attention(
            kv, q[:, :, i : i + 1], [(0, 1, context + i, slots[: context + i + 1])]
        )
        assert torch.equal(alone, full[i : i + 1]), i
    # Two requests in one call give the bits of each alone (q rows 0..2 and 3..11).
    other = torch.randperm(64, generator=torch.Generator().manual_seed(9))[:20]
    both = _run_attention(kv, q[:, :, :12], [(0, 3, context, slots[:8]), (3, 9, 11, other)])
    assert torch.equal(both[:3], full[:3])
    assert torch.equal(both[3:], _run_attention(kv, q[:, :, 3:12], [(0, 9, 11, other)]))


@pytest.mark.parametrize("n, eps, scale", [(64, 1e-6, 3.0), (203, 1e-6, 1.0), (2048, 1e-2, 1e-3)])
def test_the_norm_kernel_keeps_hfs_roundings_and_is_row_invariant(n, eps, scale):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(37, n, generator=gen) * scale).bfloat16()
    w = torch.randn(n, generator=gen).bfloat16()
    got, hf = kernels.rms_norm(x, w, eps), rms_norm(x, w, eps)
    # Only the order of the sum of squares differs from HF's: at most one bf16 rounding step.
    assert ((got.float() - hf.float()).abs() <= hf.float().abs() * 2.0**-7).all()
    assert (got == hf).float().mean() > 0.99
    check_rows(lambda rows: kernels.rms_norm(rows, w, eps), x, "rms_norm")
    assert kernels.rms_norm(x.view(37, 1, n), w, eps).shape == (37, 1, n)


def test_deterministic_mode_runs_the_drivers_norm_and_hf_exact_mode_hfs(tiny_ckpt):
    assert LLM(tiny_ckpt, device="cpu", num_blocks=4).model.rms_norm is kernels.rms_norm
    hf = LLM(tiny_ckpt, device="cpu", num_blocks=4, deterministic=False)
    assert hf.model.rms_norm is rms_norm


def test_it_rejects_what_it_cannot_compute():
    x, w = _operands(2, 4, 8)
    with pytest.raises(TypeError, match="bf16 CPU tensors"):
        kernels.bf16_linear(x.float(), w)


def test_the_runtime_uses_it_on_request_and_reports_the_mode(checkpoints):
    name = "gqa-h256-d32-L3-T4"  # at hidden 64 the kernel happens to give torch's very bits
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    llm = LLM(ckpt, device="cpu", num_blocks=8, linear="avx2", deterministic=False)
    assert llm.model.linear is kernels.bf16_linear and llm.mode == "fast"
    exact = LLM(ckpt, device="cpu", num_blocks=8, deterministic=False)
    params = SamplingParams(max_tokens=1)
    got = llm.generate([prompt_of(20, seed=1)], params, return_logits=True)[0].logits
    want = exact.generate([prompt_of(20, seed=1)], params, return_logits=True)[0].logits
    assert got is not None and want is not None
    assert not torch.equal(got, want), "the kernel changed nothing: is it really in use?"
    assert (got.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max()


def test_deterministic_mode_holds_with_the_kernel(checkpoints):
    name = "gqa-h256-d32-L3-T4"
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    prompts = [prompt_of(70, seed=1), prompt_of(9, seed=2)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def run(chunk):
        llm = LLM(ckpt, block_size=16, num_blocks=64, linear="avx2", prefill_chunk_size=chunk)
        assert llm.mode == "deterministic" and llm.model.linear is kernels.bf16_linear
        return llm.generate(prompts, params, return_logits=True)

    want = run(None)
    for chunk in (1, 16):
        for g, w in zip(run(chunk), want, strict=True):
            assert g.token_ids == w.token_ids and torch.equal(g.logits, w.logits), chunk


def test_stacked_projections_give_the_bits_of_separate_calls(checkpoints):
    # One call on q|k|v and gate|up (the kernel is column-invariant) must change no bit.
    name = "gqa-h256-d32-L3-T4"
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    prompts = [prompt_of(40, seed=3), prompt_of(7, seed=4)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    llm = LLM(ckpt, block_size=16, num_blocks=16)
    assert llm.model.stacked and llm.linear == "avx2"
    want = llm.generate(prompts, params, return_logits=True)
    llm.model.stacked = False
    got = llm.generate(prompts, params, return_logits=True)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and torch.equal(g.logits, w.logits)


def test_it_is_the_default_kernel_unless_the_run_is_hf_exact(tiny_ckpt):
    assert LLM(tiny_ckpt, device="cpu", num_blocks=4).linear == "avx2"
    assert LLM(tiny_ckpt, device="cpu", num_blocks=4, deterministic=True).linear == "avx2"
    hf = LLM(tiny_ckpt, device="cpu", num_blocks=4, deterministic=False)
    assert hf.linear == "torch" and hf.mode == "hf-exact"
    named = LLM(tiny_ckpt, device="cpu", num_blocks=4, linear="torch")
    assert named.linear == "torch" and named.mode == "deterministic"


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("RLT_HAL_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "no-such-cc")
    kernels.load.cache_clear()
    yield
    kernels.load.cache_clear()


def test_a_missing_compiler_is_named_with_what_to_do(no_compiler):
    with pytest.raises(kernels.KernelsUnavailable, match="apt install gcc"):
        kernels.load()


def test_without_a_compiler_the_default_falls_back_to_torch(no_compiler, tiny_ckpt, caplog):
    llm = LLM(tiny_ckpt, device="cpu", num_blocks=4)
    assert llm.linear == "torch" and llm.mode == "deterministic"
    assert "using torch's linear kernel" in caplog.text and "apt install gcc" in caplog.text
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids
    assert "deterministic attention runs on torch's kernels" in caplog.text
    assert "deterministic mode uses HF's RMSNorm" in caplog.text and llm.model.rms_norm is rms_norm
    with pytest.raises(kernels.KernelsUnavailable):  # asked for by name: an error
        LLM(tiny_ckpt, device="cpu", num_blocks=4, linear="avx2")


def test_a_build_failure_shows_the_compiler_output(monkeypatch, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setenv("RLT_HAL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "SOURCES", (bad,))
    kernels.load.cache_clear()
    try:
        with pytest.raises(kernels.KernelsUnavailable, match="compiling .*bad.c"):
            kernels.load()
    finally:
        kernels.load.cache_clear()
    assert not list((tmp_path / "kernels").glob("*.so")), "a failed build left a library"


def test_unknown_kernels_and_drivers_without_it_are_refused(tiny_ckpt, monkeypatch):
    with pytest.raises(ValueError, match="linear kernel 'amx' is not offered by driver 'cpu'; "):
        LLM(tiny_ckpt, device="cpu", num_blocks=4, linear="amx")
    monkeypatch.setenv("RLT_HAL_NPU_EMULATE", "1")
    with pytest.raises(ValueError, match="choose one of: torch$"):
        LLM(tiny_ckpt, device="npu", num_blocks=4, linear="avx2")
