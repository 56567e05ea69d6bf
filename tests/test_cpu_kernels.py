"""The cpu driver's kernels (the avx2 and avx512bf16 projections, deterministic attention,
RMSNorm and SiLU-times-up): accuracy, row invariance, their place in the runtime and their
errors. (Their speed is measured in docs/benchmarks.md, not here.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drivers.cpu import kernels
from drivers.cpu.driver import RowContexts
from hal.eager import TensorKVStore
from hal.kernels import (
    KernelUnavailable,
    adversarial_rows,
    adversarial_weight,
    check_rows,
    hf_rms_norm,
    hf_silu_mul,
)
from hal.reference import ATTENTION_BOUND, attention_f64
from hal.types import AttentionMetadata, KVAddressing, KVLayout
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.engine.step import sequence_inputs
from runtime_glue.ouro.exits import ExitMode
from runtime_glue.ouro.model import OuroModel
from tests.conftest import PARITY_CONFIGS
from tests.helpers import prompt_of

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs AVX2"
)


def _avx512bf16_or_skip():
    try:
        kernels.avx512bf16_available()
    except KernelUnavailable as exc:
        pytest.skip(str(exc))


LINEARS = {
    "avx2": (kernels.linear_avx2, lambda: None),
    "avx512bf16": (kernels.linear_avx512bf16, _avx512bf16_or_skip),
}


def _operands(m: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    return x, w


# Shapes cover every blocking edge: one row, odd row counts, more rows than a cache block,
# N not a multiple of the weight block, K with a tail (8 for avx2, 32 for avx512bf16).
SHAPES = [(1, 64, 64), (2, 7, 9), (3, 5632, 2048), (5, 2048, 5632), (33, 100, 200), (70, 13, 24)]


@pytest.mark.parametrize("name", sorted(LINEARS))
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_the_kernel_is_as_accurate_as_torchs_bf16_linear(name, m, n, k):
    linear, skip = LINEARS[name]
    skip()
    x, w = _operands(m, n, k)
    exact = x.double() @ w.double().T
    got = linear(x, w).double()
    # Both round an fp32 sum to bf16 once: at most half a bf16 ulp of the result (2^-9
    # relative) plus fp32 accumulation error, which k * 2^-24 * sum|x*w| bounds.
    accumulation = k * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    bound = exact.abs() * 2.0**-8 + accumulation + 1e-30
    assert ((got - exact).abs() <= bound).all()
    torch_err = (F.linear(x, w).double() - exact).abs().max()
    assert (got - exact).abs().max() <= 2 * torch_err + accumulation.max()


@pytest.mark.parametrize("name", sorted(LINEARS))
def test_leading_dimensions_and_views_are_handled(name):
    linear, skip = LINEARS[name]
    skip()
    x, w = _operands(6, 40, 32)
    assert torch.equal(linear(x.view(2, 3, 32), w), linear(x, w).view(2, 3, 40))
    strided = torch.cat([x, x], dim=1)[:, :32]  # not contiguous
    assert torch.equal(linear(strided, w), linear(x, w))
    assert linear(x[:0], w).shape == (0, 40)


@pytest.mark.parametrize("name", sorted(LINEARS))
def test_the_kernel_keeps_a_rows_bits_in_any_call_for_the_ouro_shapes(name):
    linear, skip = LINEARS[name]
    skip()
    gen = torch.Generator().manual_seed(1)
    for n, k in [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]:
        w, x = adversarial_weight(n, k, gen), adversarial_rows(32, k, gen)
        why = check_rows(lambda rows, w=w: linear(rows, w), x, (1, 2, 3, 5, 8, 13, 16))
        assert why is None, f"{name} [{n}, {k}]: {why}"


def test_the_two_projection_kernels_sum_in_different_orders_and_the_check_sees_it():
    # Why the check needs adversarial inputs: on random ones two fp32 orders almost never
    # differ after rounding to bf16; on these, almost every output does.
    _avx512bf16_or_skip()
    gen = torch.Generator().manual_seed(2)
    w, x = adversarial_weight(256, 2048, gen), adversarial_rows(16, 2048, gen)
    differs = kernels.linear_avx2(x, w) != kernels.linear_avx512bf16(x, w)
    assert differs.float().mean() > 0.5
    xr, wr = _operands(16, 256, 2048)
    assert (kernels.linear_avx2(xr, wr) != kernels.linear_avx512bf16(xr, wr)).float().mean() < 0.01


PAGES = [3, 1]  # a 17-position request: page 3, then page 1


def _attention_case(heads, kv_heads, d, seed=0):
    """A one-plane cache of four 16-slot pages with random K/V, and 17 query rows."""
    gen = torch.Generator().manual_seed(seed)
    kv = TensorKVStore(KVLayout(1, 4, 16, kv_heads, d), torch.device("cpu"))
    k, v = (
        torch.randn(2, 64, kv_heads, d, generator=gen)
        * torch.tensor([2.0, 1.0])[:, None, None, None]
    ).bfloat16()
    kv.write(0, k, v, torch.arange(64))
    q = (torch.randn(1, heads, 17, d, generator=gen) * 2).bfloat16()
    return kv, q


def _run_attention(kv, q, requests):
    """requests: (query_len, context_len, pages), their rows in q's order."""
    rows = RowContexts.of(AttentionMetadata.build(16, requests))
    k, v = kv.key_cache[0], kv.value_cache[0]
    return kernels.paged_attention(q, k, v, rows.slots, rows.off, rows.len, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("heads, kv_heads, d", [(4, 4, 32), (6, 2, 36), (4, 1, 128)])
def test_deterministic_attention_is_close_to_float64_and_row_invariant(heads, kv_heads, d):
    kv, q = _attention_case(heads, kv_heads, d)
    context = 5  # 12 query rows at positions 5..16
    full = _run_attention(kv, q[:, :, :12], [(12, context, PAGES)])
    k, v = kv.gather(0, AttentionMetadata.build(16, [(12, context, PAGES)]).request_slots(0))
    ref = attention_f64(q[:, :, :12], k, v, d**-0.5, context)
    assert ((full.double() - ref).abs().max()) <= ATTENTION_BOUND * float(v.abs().max())
    for i in range(12):  # each row alone, as a decode step computes it
        alone = _run_attention(kv, q[:, :, i : i + 1], [(1, context + i, PAGES)])
        assert torch.equal(alone, full[i : i + 1]), i
    # Two requests in one call give the bits of each alone (q rows 0..2 and 3..11).
    both = _run_attention(kv, q[:, :, :12], [(3, context, PAGES), (9, 11, [0, 2])])
    assert torch.equal(both[:3], full[:3])
    assert torch.equal(both[3:], _run_attention(kv, q[:, :, 3:12], [(9, 11, [0, 2])]))


@pytest.mark.parametrize("n, eps, scale", [(64, 1e-6, 3.0), (203, 1e-6, 1.0), (2048, 1e-2, 1e-3)])
def test_the_norm_kernel_keeps_hfs_roundings_and_is_row_invariant(n, eps, scale):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(37, n, generator=gen) * scale).bfloat16()
    w = torch.randn(n, generator=gen).bfloat16()
    got, hf = kernels.rms_norm(x, w, eps), hf_rms_norm(x, w, eps)
    # Only the order of the sum of squares differs from HF's: at most one bf16 rounding step.
    assert ((got.float() - hf.float()).abs() <= hf.float().abs() * 2.0**-7).all()
    assert (got == hf).float().mean() > 0.99
    assert check_rows(lambda rows: kernels.rms_norm(rows, w, eps), x, (1, 2, 3, 16)) is None
    assert kernels.rms_norm(x.view(37, 1, n), w, eps).shape == (37, 1, n)


@pytest.mark.parametrize("cols", [8, 13, 688, 5632])
def test_the_silu_mul_kernel_keeps_hfs_roundings_and_every_elements_bits(cols):
    gen = torch.Generator().manual_seed(cols)
    both = (torch.randn(19, 2 * cols, generator=gen) * 4).bfloat16()  # gate|up, stacked
    gate, up = both[:, :cols], both[:, cols:]
    got, hf = kernels.silu_mul(gate, up), hf_silu_mul(gate, up)
    # Its exp is not torch's: the rounded silu may differ by one bf16 step, so 2^-7.
    assert ((got.float() - hf.float()).abs() <= hf.float().abs() * 2.0**-7 + 1e-30).all()
    assert (got == hf).float().mean() > 0.98
    # An element's bits never depend on where it falls: a row alone, or shifted by one column.
    for r in (0, 7, 18):
        assert torch.equal(kernels.silu_mul(gate[r : r + 1], up[r : r + 1]), got[r : r + 1])
    if cols > 1:
        shifted = kernels.silu_mul(gate[:, 1:].contiguous(), up[:, 1:].contiguous())
        assert torch.equal(shifted, got[:, 1:])


def test_the_kernels_are_torch_custom_ops_the_profiler_sees():
    x, w = _operands(3, 16, 32)
    with torch.profiler.profile() as prof:
        kernels.linear_avx2(x, w)
        kernels.rms_norm(x, w[0], 1e-6)
    names = {e.key for e in prof.key_averages()}
    assert {"rlt_cpu::linear_avx2", "rlt_cpu::rms_norm"} <= names
    assert torch.ops.rlt_cpu.linear_avx2.default is not None
    fake = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake:  # a fake implementation: shape inference without running the kernel
        y = kernels.linear_avx2(torch.empty(5, 32, dtype=torch.bfloat16), torch.empty(16, 32))
    assert y.shape == (5, 16)


def test_an_eager_call_skips_the_ops_dispatch_and_gives_its_bits(monkeypatch):
    # Called on plain tensors outside the profiler and torch.compile, a kernel runs its
    # function directly (the op's Python dispatch costs several times a decode row's kernel);
    # the op gives the same bits, and is what runs under the profiler.
    x, w = _operands(3, 16, 32)
    through = []
    real = kernels.rms_norm.op

    class Counting:
        def __call__(self, *args):
            through.append(args)
            return real(*args)

    monkeypatch.setattr(kernels.rms_norm, "op", Counting(), raising=False)
    eager = kernels.rms_norm(x, w[0], 1e-6)
    assert not through
    assert torch.equal(eager, torch.ops.rlt_cpu.rms_norm(x, w[0], 1e-6))
    with torch.profiler.profile():
        assert torch.equal(kernels.rms_norm(x, w[0], 1e-6), eager)
    assert len(through) == 1


def test_the_cffi_declarations_take_addresses_for_every_pointer():
    # The header's pointers reach cffi as addresses (Tensor.data_ptr() as it is): a pointer
    # left in the declarations would need a cffi pointer object per call.
    decl = kernels._cdef(kernels.HEADER.read_text())
    assert "*" not in decl and "rlt_paged_attention(uintptr_t q, long q_row" in decl
    assert "uintptr_t slots, int rows, uintptr_t k_cache" in decl  # (int64_t *, ..., uint16_t *)


KV_LAYOUT = KVLayout(2, 2, 16, 2, 8, torch.bfloat16)  # 2 planes of 32 slots, 2 heads of 8


def _kv_store():
    from drivers.cpu.driver import CpuKVStore

    return CpuKVStore(KV_LAYOUT, torch.device("cpu"))


def test_kv_rows_written_by_one_c_call_land_where_index_put_puts_them():
    store, ref = _kv_store(), TensorKVStore(KV_LAYOUT, torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 3 * 16, generator=gen).bfloat16()  # v a strided view, as the model's
    key, value = qkv[:, 16:32].view(5, 2, 8).contiguous(), qkv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([3, 17, 40, 9, 17])  # 40: the next plane's slot 8; 17 twice: the later
    for s in (store, ref):
        s.write(0, key, value, slots)
        s.write(1, key[:2], value[:2], torch.tensor([0, 31]))
    assert torch.equal(store.key_cache, ref.key_cache)
    assert torch.equal(store.value_cache, ref.value_cache)
    assert torch.equal(store.key_cache[0, 17], key[4]) and torch.equal(
        store.key_cache[1, 8], key[2]
    )


def test_a_kv_slot_outside_the_cache_is_an_error_and_writes_nothing():
    store = _kv_store()
    key = torch.ones(2, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(IndexError, match=r"lies outside \[0, 32\)"):
        store.write(1, key, key, torch.tensor([0, 32]))
    with pytest.raises(IndexError, match="lies outside"):
        store.write(0, key, key, torch.tensor([-1, 3]))
    assert not store.key_cache.any() and not store.value_cache.any()


def test_kv_rows_the_c_call_cannot_take_are_written_by_index_put():
    store = _kv_store()
    key = torch.ones(2, 8, 2, dtype=torch.bfloat16).transpose(1, 2)  # heads not contiguous
    store.write(0, key, key, torch.tensor([1, 2]))
    assert torch.equal(store.key_cache[0, 1:3], key) and not store.key_cache[0, 0].any()


def test_the_deterministic_plan_runs_the_rotary_kernel_with_the_compositions_bits(
    wide, monkeypatch
):
    # The C rotary has HF's bits (the kit checks the claim): choosing it changes no bit of a
    # whole generation, prompt and decode rows alike.
    from runtime_glue.ouro import resolve

    prompts = [prompt_of(40, seed=5), prompt_of(7, seed=6)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    def run():
        llm = LLM(wide, block_size=16, num_blocks=32)
        assert llm.mode == "deterministic"
        return llm, llm.generate(prompts, params, return_logits=True)

    llm, got = run()
    assert dict(llm.plan.fused) == {"rotary": "avx2"} and "rotary avx2" in llm.plan.describe()
    monkeypatch.setattr(resolve, "exact_rotary", lambda driver: None)
    llm, want = run()
    assert llm.plan.fused == ()
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and torch.equal(g.logits, w.logits)


def test_it_rejects_what_it_cannot_compute():
    x, w = _operands(2, 4, 8)
    with pytest.raises(TypeError, match="bf16 CPU tensors"):
        kernels.linear_avx2(x.float(), w)
    with pytest.raises(ValueError, match=r"x \[\.\.\., 8\] and w \[4, 4\] do not match"):
        kernels.linear_avx2(x, w[:, :4].contiguous())
    with pytest.raises(TypeError, match="same strides"):
        kernels.silu_mul(x, x[:, :4])
    with pytest.raises(ValueError, match=r"rms_norm: x \[\.\.\., 8\] and weight \[16\]"):
        kernels.rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-6)


@pytest.fixture
def wide(checkpoints):
    name = "gqa-h256-d32-L3-T4"  # at hidden 64 a kernel can happen to give torch's very bits
    return checkpoints(name, seed=1, **PARITY_CONFIGS[name])


def test_a_named_kernel_runs_every_projection_and_says_the_mode_is_fast(wide):
    llm = LLM(wide, device="cpu", num_blocks=8, linear="avx2", deterministic=False)
    assert llm.mode == "fast" and llm.plan.stacked
    assert {
        c.kernel
        for kind in ("prompt", "generated")
        for op, c in getattr(llm.plan, kind)
        if op.endswith(("proj", "head"))
    } == {"avx2"}
    exact = LLM(wide, device="cpu", num_blocks=8, deterministic=False)
    params = SamplingParams(max_tokens=1)
    got = llm.generate([prompt_of(20, seed=1)], params, return_logits=True)[0].logits
    want = exact.generate([prompt_of(20, seed=1)], params, return_logits=True)[0].logits
    assert got is not None and want is not None
    assert not torch.equal(got, want), "the kernel changed nothing: is it really in use?"
    assert (got.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max()


@pytest.mark.parametrize("name", sorted(LINEARS))
def test_deterministic_mode_holds_with_each_kernel(wide, name):
    LINEARS[name][1]()
    prompts = [prompt_of(70, seed=1), prompt_of(9, seed=2)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def run(chunk):
        llm = LLM(wide, block_size=16, num_blocks=64, linear=name, prefill_chunk_size=chunk)
        assert llm.mode == "deterministic" and llm.plan.choice("prompt", "qkv_proj").kernel == name
        return llm.generate(prompts, params, return_logits=True)

    want = run(None)
    for chunk in (1, 16):
        for g, w in zip(run(chunk), want, strict=True):
            assert g.token_ids == w.token_ids and torch.equal(g.logits, w.logits), chunk


def test_stacked_projections_give_the_bits_of_separate_calls(wide):
    # One call on q|k|v and gate|up with a column-invariant kernel must change no bit, and
    # the model must split the stacked output where q, k and v (gate and up) meet.
    import attrs

    llm = LLM(wide, block_size=16, num_blocks=16, linear="avx2", deterministic=False)
    assert llm.plan.stacked
    apart = OuroModel(
        llm.config, _weights(llm), attrs.evolve(llm.plan, stacked=False), llm.driver, llm.kv_store
    )
    n, cfg = 40, llm.config
    meta = AttentionMetadata.build(16, [(n, 0, [0, 1, 2])])
    kv = KVAddressing.uniform(meta, cfg.num_hidden_layers, llm.kv_layout.num_slots)
    modes = [ExitMode()] * n
    loops = cfg.total_ut_steps
    step = sequence_inputs(torch.device("cpu"), kv, prompt_of(n, seed=3), 0, True, modes, loops)
    assert torch.equal(llm.model.forward(step).logits, apart.forward(step).logits)


def _weights(llm):
    from runtime_glue.ouro.checkpoint import load_weights

    return load_weights(llm.model_dir, llm.config, llm.driver.device)


def test_the_plan_chooses_the_fastest_of_the_kernels_it_measured(tiny_ckpt):
    from runtime_glue.ouro.plan import hal_op

    llm = LLM(tiny_ckpt, device="cpu", num_blocks=4)
    for kind in ("prompt", "generated"):
        for op, c in getattr(llm.plan, kind):
            usable = {k.name for k in llm.driver.kernels_for(hal_op(op)) if not k.available()}
            times = {}
            for m in llm.plan.measurements:
                if (m.op, m.kind) == (op, kind):
                    times.setdefault(m.kernel, {})[m.rows] = m.seconds
            assert c.kernel in usable and set(times) <= usable and c.kernel in times
            fastest = {r: min(t[r] for t in times.values()) for r in times[c.kernel]}
            worst = {k: max(t[r] / fastest[r] for r in t) for k, t in times.items()}
            assert worst[c.kernel] == min(worst.values()), (op, kind, times)


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("RLT_HAL_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "no-such-cc")
    kernels.library.cache_clear()
    yield
    kernels.library.cache_clear()


def test_a_missing_compiler_is_named_with_what_to_do(no_compiler):
    with pytest.raises(KernelUnavailable, match="apt install gcc"):
        kernels.library()


def test_without_a_compiler_the_plan_uses_torchs_kernels(no_compiler, tiny_ckpt, caplog):
    llm = LLM(tiny_ckpt, device="cpu", num_blocks=4)
    assert llm.mode == "deterministic"
    assert {c.kernel for _, c in llm.plan.prompt + llm.plan.generated} == {"torch"}
    assert any("apt install gcc" in note for note in llm.plan.notes)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids
    assert "deterministic attention runs on torch's kernels" in caplog.text
    with pytest.raises(KernelUnavailable):  # asked for by name: an error
        LLM(tiny_ckpt, device="cpu", num_blocks=4, linear="avx2")


def test_a_build_failure_shows_the_compiler_output(monkeypatch, tmp_path):
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setenv("RLT_HAL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_sources", lambda: [bad])
    kernels.library.cache_clear()
    try:
        with pytest.raises(KernelUnavailable, match="compiling .*bad.c"):
            kernels.library()
    finally:
        kernels.library.cache_clear()
    assert not list((tmp_path / "kernels").glob("*.so")), "a failed build left a library"


def test_unknown_kernels_and_drivers_without_it_are_refused(tiny_ckpt, monkeypatch):
    with pytest.raises(
        ValueError,
        match="linear kernel 'amx' is not offered by driver 'cpu'; choose one of: torch, avx2",
    ):
        LLM(tiny_ckpt, device="cpu", num_blocks=4, linear="amx")
    monkeypatch.setenv("RLT_HAL_NPU_EMULATE", "1")
    npu_kernels = (
        "torch, int8-dequant, int8-token-ref, int8-static-ref, int8-npu, int8-token-npu, "
        "int8-static-npu, int8g-dequant, int8g-npu, int4-dequant, int4-npu, int8z-dequant, "
        "int8z-npu"
    )
    with pytest.raises(ValueError, match=f"choose one of: {npu_kernels}$"):
        LLM(tiny_ckpt, device="npu", num_blocks=4, linear="avx2")
