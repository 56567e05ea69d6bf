"""Deterministic mode: chunk size and batch mix never change a request's tokens or logits.

The mode is the default on cpu (its measured cost is within noise there); with it off, the
HF-exact mode, the same comparisons are allowed to differ in the last bits (within the
engine's stated tolerance); ``rlt-hal parity`` locates where, and docs/determinism.md records
what was measured.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from tests.conftest import PARITY_CONFIGS, skip_wide_on_emulation
from tests.helpers import prompt_of

CONFIGS = sorted(PARITY_CONFIGS)  # every parity config, two of them at Ouro-1.4B width
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def _llm(ckpt, driver_name, **kw):
    return LLM(ckpt, device=driver_name, block_size=16, num_blocks=64, deterministic=True, **kw)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_chunk_size_gives_the_bits_of_full_prefill(checkpoints, driver_name, name):
    skip_wide_on_emulation(name, driver_name)
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    prompts = [prompt_of(260, seed=1), prompt_of(23, seed=2)]  # 260 > the largest chunk
    llm = _llm(ckpt, driver_name)
    want = llm.generate(prompts, PARAMS, return_logits=True)
    for chunk in (1, 7, 16, 64, 128, 256):
        llm.engine.config = attrs.evolve(llm.engine.config, prefill_chunk_size=chunk)
        got = llm.generate(prompts, PARAMS, return_logits=True)
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids, f"chunk {chunk}"
            assert torch.equal(g.logits, w.logits), f"chunk {chunk}"


@pytest.mark.parametrize("name", CONFIGS)
def test_requests_joining_and_leaving_a_batch_get_the_bits_they_get_alone(
    checkpoints, driver_name, name
):
    skip_wide_on_emulation(name, driver_name)
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    jobs = [
        (
            prompt_of(5 + 7 * i, seed=10 + i),
            SamplingParams(max_tokens=4 + 2 * (i % 3), ignore_eos=True),
        )
        for i in range(8)
    ]
    eng = _llm(ckpt, driver_name, prefill_chunk_size=16).engine
    reqs, sizes, step = {}, set(), 0
    while len(reqs) < len(jobs) or eng.has_unfinished():
        if step % 2 == 0 and len(reqs) < len(jobs):  # one joins every other step
            i = len(reqs)
            eng.add_request(f"r{i}", jobs[i][0], jobs[i][1], return_logits=True)
            reqs[i] = eng.requests[f"r{i}"]
        sizes.add(len(eng.running) + len(eng.waiting))
        eng.step()
        step += 1
    assert {2, 3, 4}.issubset(sizes), f"the batch never mixed enough requests: {sizes}"
    alone = _llm(ckpt, driver_name)  # another engine, each request alone in it
    for i, (prompt, params) in enumerate(jobs):
        want = alone.generate([prompt], params, return_logits=True)[0]
        assert tuple(reqs[i].output_ids) == want.token_ids, f"request {i}"
        assert torch.equal(torch.stack(reqs[i].logits), want.logits), f"request {i}"


def test_with_the_mode_off_chunking_stays_within_the_engines_tolerance(checkpoints):
    from runtime_glue.checks.parity import compare
    from tests.test_engine import LOGIT_TOLERANCE

    name = "gqa-h256-d32-L3-T4"
    ckpt = checkpoints(name, seed=1, **PARITY_CONFIGS[name])
    full = LLM(ckpt, block_size=16, num_blocks=64, deterministic=False)
    chunked = LLM(ckpt, block_size=16, num_blocks=64, prefill_chunk_size=1, deterministic=False)
    report = compare(full, chunked, prompt_of(37, seed=1), max_tokens=10)
    print(report.describe())  # where the bits part (measured: attention, see the docs)
    assert report.max_logit_diff <= LOGIT_TOLERANCE


def test_a_backend_without_deterministic_support_is_refused(tiny_ckpt, monkeypatch):
    from drivers.cpu.driver import CpuEagerBackend

    monkeypatch.setattr(CpuEagerBackend, "supports_deterministic", False)
    with pytest.raises(ValueError, match="'cpu_eager' does not support deterministic mode"):
        LLM(tiny_ckpt, deterministic=True)


def test_the_mode_is_the_default_only_where_its_backend_measured_it_cheap(tiny_ckpt, monkeypatch):
    assert LLM(tiny_ckpt, device="cpu", num_blocks=4).mode == "deterministic"
    assert LLM(tiny_ckpt, device="cpu", num_blocks=4, deterministic=False).mode == "hf-exact"
    monkeypatch.setenv("RLT_HAL_NPU_EMULATE", "1")
    assert LLM(tiny_ckpt, device="npu", num_blocks=4).mode == "hf-exact"
    assert LLM(tiny_ckpt, device="npu", num_blocks=4, deterministic=True).mode == "deterministic"


def _with_linear(monkeypatch, tmp_path, fn):
    """LLM keyword arguments for a cpu driver whose one extra projection kernel is ``fn``
    (a test double for a library kernel), named "double", with its own plan cache."""
    from drivers.cpu.driver import CpuDevice, CpuDriver, CpuEagerBackend
    from hal import DriverSpec, Kernel, ProbeResult, Registry, hookimpl

    monkeypatch.setenv("RLT_HAL_CACHE", str(tmp_path))

    class Plugin:
        @hookimpl
        def rlt_hal_register_drivers(self):
            def create(**_):
                backends = {"cpu_eager": CpuEagerBackend()}
                kernels = [Kernel("linear", "double", fn)]
                return CpuDriver("double", CpuDevice(), backends, "cpu_eager", kernels)

            return [DriverSpec("double", lambda: ProbeResult(True), create)]

    registry = Registry(plugins=[Plugin()], load_entrypoints=False)
    return dict(device="double", registry=registry, linear="double", num_blocks=8)


def _rowwise(x, w):
    """F.linear one row at a time: a row's bits in every call shape, whichever path a CPU's GEMM
    library takes for one row or for many (on an AVX-512 CPU without bf16 a one-row call does
    not give the bits of the same row in a larger call)."""
    return torch.stack([F.linear(row, w) for row in x])


def _position_dependent(x, w):
    """Row-invariant, except every row but a call's first is nudged: no call shape keeps a
    row's bits wherever it falls."""
    out = _rowwise(x, w)
    out[1:] += 1
    return out


def _shape_dependent(counts):
    """Row-invariant, except calls of a row count in ``counts`` are nudged (a separate code
    path)."""

    def linear(x, w):
        out = _rowwise(x, w)
        return out + 1 if x.shape[0] in counts else out

    return linear


def test_a_default_mode_that_no_kernel_keeps_falls_back_to_hf_exact(
    tiny_ckpt, monkeypatch, tmp_path, caplog
):
    llm = LLM(tiny_ckpt, **_with_linear(monkeypatch, tmp_path, _position_dependent))
    assert llm.mode == "fast" and "deterministic mode is off by default here" in caplog.text
    assert "no kernel gives qkv_proj [256, 64] a row's bits in every call shape" in caplog.text


def test_an_explicit_mode_that_no_kernel_keeps_refuses_to_start_naming_op_and_shape(
    tiny_ckpt, monkeypatch, tmp_path
):
    kw = _with_linear(monkeypatch, tmp_path, _position_dependent)
    with pytest.raises(RuntimeError, match=r"no kernel gives qkv_proj \[256, 64\] a row's bits"):
        LLM(tiny_ckpt, deterministic=True, **kw)


def test_a_kernel_that_differs_in_some_call_shapes_gets_tiles_without_them(
    tiny_ckpt, monkeypatch, tmp_path
):
    # Like torch's bf16 GEMM on some CPUs, where a one-row call takes a path of its own.
    kw = _with_linear(monkeypatch, tmp_path, _shape_dependent({1, 2}))
    llm = LLM(tiny_ckpt, deterministic=True, **kw)
    assert {llm.plan.choice(k, "qkv_proj").tiles for k in ("prompt", "generated")} == {
        (4, 8, 16, 32, 64, 128, 256),
        (4, 8, 16, 32, 64),
    }
    want = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6), return_logits=True)[0]
    llm.engine.config = attrs.evolve(llm.engine.config, prefill_chunk_size=1)
    got = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6), return_logits=True)[0]
    assert got.token_ids == want.token_ids and torch.equal(got.logits, want.logits)


def test_a_cached_choice_that_fails_the_start_up_check_is_measured_again(
    tiny_ckpt, monkeypatch, tmp_path
):
    shapes: set[int] = set()
    kw = _with_linear(monkeypatch, tmp_path, _shape_dependent(shapes))
    first = LLM(tiny_ckpt, deterministic=True, **kw).plan
    assert first.choice("prompt", "qkv_proj").tiles[0] == 1
    shapes.add(1)  # the library changed under the cache: now a one-row call differs
    again = LLM(tiny_ckpt, deterministic=True, **kw).plan
    assert again.choice("prompt", "qkv_proj").tiles[0] == 2
    assert "measured now (the choice recorded in" in again.notes[-1]


def test_the_check_finds_a_summation_order_that_differs_in_one_call_shape():
    # Two kernels that sum a row in different orders depending on the call's row count: the
    # adversarial inputs make even a one-ulp fp32 difference visible in every case.
    from hal.kernels import adversarial_rows, adversarial_weight, check_rows

    gen = torch.Generator().manual_seed(0)
    w, x = adversarial_weight(96, 64, gen), adversarial_rows(64, 64, gen)

    def order_by_rows(rows, w):  # fp32 sums in K order; in 8-row calls, two halves of K
        products = rows.float()[:, None, :] * w.float()[None, :, :]
        if rows.shape[0] != 8:
            return products.cumsum(-1)[..., -1].bfloat16()  # a scan: one fixed order
        half = products.shape[-1] // 2
        first, second = products[..., :half], products[..., half:]
        return (first.cumsum(-1)[..., -1] + second.cumsum(-1)[..., -1]).bfloat16()

    assert check_rows(lambda r: order_by_rows(r, w), x, (1, 2, 4, 8, 16, 32)) is not None
    assert check_rows(lambda r: order_by_rows(r, w), x, (16, 32)) is None


def test_the_plan_is_resolved_once_and_names_every_op(tiny_ckpt):
    from runtime_glue.ouro.plan import KINDS, OPS, hal_op

    llm = LLM(tiny_ckpt, device="cpu", num_blocks=4)
    plan = llm.plan
    assert plan.mode == "deterministic" and plan.stacked
    for kind in KINDS:
        for op in OPS:
            choice = plan.choice(kind, op)
            assert choice.tiles and list(choice.tiles) == sorted(choice.tiles)
            assert llm.driver.kernel(hal_op(op), choice.kernel).op == hal_op(op)
    line = plan.describe()
    assert line.startswith("deterministic mode, cpu_eager attention; qkv_proj ")
    hf = LLM(tiny_ckpt, device="cpu", num_blocks=4, deterministic=False).plan
    assert hf.mode == "hf-exact" and not hf.stacked and not hf.split
    assert all(not c.tiles and c.kernel == "torch" for _, c in hf.prompt)


def test_fast_mode_takes_the_fastest_projection_kernel_timed_at_start_up(
    tiny_ckpt, monkeypatch, tmp_path
):
    """A driver whose extra kernel is F.linear slowed by a sleep: fast mode times both and
    keeps torch's for every projection, prompt rows and generated alike. (The sleep outlasts
    several scheduler slices: on a busy 2-core machine torch's two-thread GEMM can wait a
    slice or two for its second thread, and a 3 ms sleep once lost to it.)"""
    import time

    def slow(x, w):
        time.sleep(0.02)
        return F.linear(x, w)

    options = _with_linear(monkeypatch, tmp_path, slow)
    del options["linear"]
    llm = LLM(tiny_ckpt, mode="fast", **options)
    assert {c.kernel for _, c in (*llm.plan.prompt, *llm.plan.generated)} == {"torch"}
    assert any(m.kernel == "double" for m in llm.plan.measurements)


def test_fast_mode_on_cpu_attends_with_the_drivers_kernel_and_hf_exact_does_not(
    tiny_ckpt, monkeypatch
):
    """The cpu backend's deterministic kernel is also its fastest attention
    (``deterministic_is_fastest``), so fast mode, which keeps no bits, runs it on every step,
    decode steps included: the cpu has no step graphs, so no static (graph) form either.
    HF-exact mode attends in HF's order through torch."""
    from drivers.cpu import driver as cpu_driver

    calls = []
    kernel = cpu_driver.kernels.paged_attention

    def counted(query, *rest):
        calls.append(query.shape[-2])  # the call's rows
        return kernel(query, *rest)

    monkeypatch.setattr(cpu_driver.kernels, "paged_attention", counted)
    bind = cpu_driver.kernels.bound_attention

    def counted_bound(*args):  # the bound decode loop's C attention
        bound = bind(*args)

        def attend(query, *rest):
            calls.append(query.shape[-2])
            return bound.attend(query, *rest)

        return type(bound)(bound.write, attend, bound.operands)

    monkeypatch.setattr(cpu_driver.kernels, "bound_attention", counted_bound)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = prompt_of(9, seed=3)
    for mode, want in (("fast", True), ("hf-exact", False)):
        calls.clear()
        llm = LLM(tiny_ckpt, device="cpu", block_size=16, num_blocks=16, mode=mode)
        assert llm.engine.model.attend_deterministic is want
        llm.generate([prompt], params)
        assert (1 in calls) is want, f"{mode}: rows of the kernel's calls {sorted(set(calls))}"
