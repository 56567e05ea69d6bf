"""W8A16 and W4A16 on the npu driver, through the EMULATED torch_npu (a CPU test double for
Ascend hardware: ``drivers.npu.quant_ops``); nothing here is a hardware result.

The emulated ``npu_weight_quant_batchmatmul`` and ``npu_convert_weight_to_int4pack`` against
float64 (``x @ dequantize(w).T``, and the additive offset convention ``(w + offset) * scale``),
their meta shapes and documented argument rules; the driver's ``int8-npu`` and ``int4-npu``
kernels against the same bound and the reference kernels; the same kernels inside a captured
step graph. Each check is shown to catch a planted bug (a wrong group's scale, a dropped or
subtracted offset, a weight layout or packing of the driver's own).
"""

from __future__ import annotations

import contextlib
import sys
import types

import attrs
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from drivers.npu import quant_ops, quantized
from drivers.npu.driver import create, import_torch_npu
from drivers.npu.graphs import GraphReplayError
from hal.devops import DeviceOpCounter
from hal.quant import QuantizedWeight, quantize

BF16 = torch.bfloat16
SCHEMES = [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)]
IDS = ["int8", "int4-g32", "int4-g64", "int4-g128"]
wqbmm = quant_ops.npu_weight_quant_batchmatmul
pack = quant_ops.npu_convert_weight_to_int4pack


def _r(*shape, seed=0, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def _weight(n: int, k: int, scheme: str, group: int | None, seed: int = 1) -> QuantizedWeight:
    """A fresh quantized weight (forms are cached on a weight: never reuse one across ops)."""
    return quantize(_r(n, k, seed=seed), scheme, group)


def _problem(got: torch.Tensor, x: torch.Tensor, w64: torch.Tensor) -> str | None:
    """None if ``got`` is within bf16 rounding of ``x @ w64.T`` in float64: the output rounded
    once (2^-8 of it, as ``hal.reference.linear_f64``), the weight rounded to bf16 once before
    the product (2^-9 of each term) and fp32 sums (``k * 2^-24`` of each term)."""
    x64 = x.double().reshape(-1, x.shape[-1])
    exact = x64 @ w64.T
    terms = x64.abs() @ w64.abs().T
    bound = exact.abs() * 2.0**-8 + (2.0**-9 + 2.0**-23 + x.shape[-1] * 2.0**-24) * terms
    if got.shape[-1] != exact.shape[-1] or got.dtype != BF16:
        return f"got {list(got.shape)} {got.dtype}, not [..., {exact.shape[-1]}] bf16"
    worst = (got.double().reshape(exact.shape) - exact).abs() - bound
    if worst.max() > 0:
        return f"exceeds the float64 bound by {worst.max().item():.3g}"
    return None


def _npu_layout(w: QuantizedWeight, pack_fn=pack):
    """vllm-ascend's layout, built here by hand: weight [K, N] (int4: packed [K, N/8]), scale
    [N] per channel or [K/g, N] per group, antiquant_group_size."""
    if w.scheme == "int8":
        return w.qweight.t().contiguous(), w.scale, 0
    values = w.integers().t().to(torch.int32).contiguous()
    return pack_fn(values), w.scale.t().contiguous(), w.group_size


# -- the emulated op against float64 ---------------------------------------------------------


def op_problem(scheme: str, group: int | None, op=wqbmm, pack_fn=pack) -> str | None:
    k = 256
    w = _weight(96, k, scheme, group)
    x = _r(7, k, seed=2)
    weight, scale, g = _npu_layout(w, pack_fn)
    return _problem(op(x, weight, scale, antiquant_group_size=g), x, w.dequantize(torch.float64))


def offset_problem(scheme: str, group: int | None, op=wqbmm) -> str | None:
    """The op with non-zero offsets (msModelSlim's asymmetric checkpoints) against the
    additive convention written here: ``x @ ((q + offset) * scale)``."""
    k, n = 256, 64
    w = _weight(n, k, scheme, group, seed=3)
    x = _r(5, k, seed=4)
    weight, scale, g = _npu_layout(w)
    offset = _r(*scale.shape, seed=5, scale=4.0)

    def per(t):  # a scale or offset per element [K, N] (a row per channel)
        return t.double()[None, :] if g == 0 else t.double().repeat_interleave(g, 0)

    w64 = ((w.integers().t().double() + per(offset)) * per(scale)).T  # [N, K]
    return _problem(op(x, weight, scale, offset, antiquant_group_size=g), x, w64)


def _tiled_groups(t, mode, k, n, group):
    """A planted emulation bug: group j's scale applied to the wrong inputs (tiled, not
    repeated per group)."""
    if mode != "group":
        return _real_per_element(t, mode, k, n, group)
    return t.float().repeat(group, 1)[:k]


def _dropped_offset(weight, scale, offset, group, mode):
    return _real_antiquant(weight, scale, None, group, mode)


def _subtracted_offset(weight, scale, offset, group, mode):
    return _real_antiquant(weight, scale, None if offset is None else -offset, group, mode)


_real_per_element, _real_antiquant = quant_ops._per_element, quant_ops.antiquant


def _natural_pack(values: torch.Tensor) -> torch.Tensor:
    """A planted caller bug: int4 packed by hand (eight in order, low nibble first) instead of
    by npu_convert_weight_to_int4pack."""
    r, c = values.shape
    v = (values.to(torch.int64) & 0xF).view(r, c // 8, 8)
    word = sum(v[..., i] << (4 * i) for i in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


@pytest.mark.parametrize(("scheme", "group"), SCHEMES, ids=IDS)
def test_the_emulated_op_is_within_bf16_rounding_of_float64(scheme, group):
    assert op_problem(scheme, group) is None


@pytest.mark.parametrize(("scheme", "group"), SCHEMES, ids=IDS)
def test_the_emulated_op_adds_the_offset_before_scaling(scheme, group):
    assert offset_problem(scheme, group) is None


@pytest.mark.parametrize("group", [32, 64, 128])
def test_a_planted_emulation_applying_the_wrong_groups_scale_is_caught(group, monkeypatch):
    monkeypatch.setattr(quant_ops, "_per_element", _tiled_groups)
    assert op_problem("int4", group) is not None
    assert offset_problem("int4", group) is not None


@pytest.mark.parametrize("planted", [_dropped_offset, _subtracted_offset], ids=["drop", "sub"])
@pytest.mark.parametrize(("scheme", "group"), SCHEMES, ids=IDS)
def test_a_planted_emulation_breaking_the_offset_convention_is_caught(
    scheme, group, planted, monkeypatch
):
    monkeypatch.setattr(quant_ops, "antiquant", planted)
    assert offset_problem(scheme, group) is not None
    assert op_problem(scheme, group) is None  # the symmetric form has no offset to break


def test_int4_packed_by_hand_instead_of_by_the_op_is_caught():
    assert op_problem("int4", 32, pack_fn=_natural_pack) is not None


def test_packing_round_trips_and_the_transposed_int4_form_computes_the_same():
    gen = torch.Generator().manual_seed(6)
    values = torch.randint(-8, 8, (48, 64), generator=gen, dtype=torch.int32)
    packed = pack(values)
    assert packed.shape == (48, 8) and packed.dtype == torch.int32
    assert torch.equal(quant_ops.unpack_int4(packed), values.to(torch.int8))
    # The docs' other form: (n, k) packed to (n, k/8) and passed transposed, scale (1, n).
    x, scale = _r(3, 64, seed=7), _r(1, 48, seed=8).abs()
    ref = wqbmm(x, pack(values.t().contiguous()), scale)  # [K, N/8]
    assert torch.equal(wqbmm(x, packed.t(), scale), ref)
    w64 = values.double() * scale.double().T  # [N, K]
    assert _problem(ref, x, w64) is None


def test_a_bias_is_added_in_fp32_before_the_one_rounding():
    w = _weight(40, 128, "int8", None)
    x, bias = _r(4, 128, seed=9), torch.randn(40, generator=torch.Generator().manual_seed(10))
    weight, scale, _ = _npu_layout(w)
    got = wqbmm(x, weight, scale, bias=bias)
    want = x.float() @ w.dequantize().float().T + bias
    assert torch.allclose(got.float(), want, rtol=2**-7, atol=1e-2)


# -- shapes and the documented rules ---------------------------------------------------------


def test_the_emulated_ops_meta_shapes_are_torch_npus():
    with FakeTensorMode():
        x = torch.empty(5, 256, dtype=BF16)
        s = torch.empty(96, dtype=BF16)
        assert wqbmm(x, torch.empty(256, 96, dtype=torch.int8), s).shape == (5, 96)
        packed = torch.empty(256, 12, dtype=torch.int32)  # contiguous int32: N = 12 * 8
        out = wqbmm(x, packed, torch.empty(8, 96, dtype=BF16), antiquant_group_size=32)
        assert (out.shape, out.dtype) == ((5, 96), BF16)
        transposed = torch.empty(96, 32, dtype=torch.int32).t()  # (K/8, N): N = size(1)
        assert wqbmm(x, transposed, s).shape == (5, 96)
        assert pack(torch.empty(256, 96, dtype=torch.int32)).shape == (256, 12)


def _args(k=256, n=64, group=32, **change):
    w = _weight(n, k, "int4", group)
    weight, scale, g = _npu_layout(w)
    args = dict(x=_r(3, k, seed=11), weight=weight, antiquant_scale=scale,
                antiquant_group_size=g)  # fmt: skip
    return {**args, **change}


REFUSED = {
    "scale of another shape": (dict(antiquant_scale=_r(65)), "antiquant_scale must be"),
    "group not a multiple of 32": (dict(antiquant_group_size=48), "multiple of 32"),
    "group below 32": (dict(antiquant_group_size=16, antiquant_scale=_r(16, 64)), "in \\[32, K"),
    "scale for another group": (dict(antiquant_group_size=64), "ceil\\(K / antiquant_group_size"),
    "per-group scale without a group": (dict(antiquant_group_size=0), "antiquant_scale must be"),
    "scale in another dtype": (dict(antiquant_scale=_r(8, 64).float()), "x's dtype"),
    "offset of another shape": (dict(antiquant_offset=_r(64)), "antiquant_offset"),
    "3-D x": (dict(x=_r(1, 3, 256)), "x must be 2-D"),
    "K disagrees": (dict(x=_r(3, 128)), "disagree on K"),
    "float weight": (dict(weight=_r(256, 64)), "weight must be int8"),
    "bf16 bias with bf16 x": (dict(bias=_r(64)), "bias must be torch.float32"),
    "empty x": (dict(x=_r(0, 256)), "empty tensors"),
    "quant_offset alone": (dict(quant_offset=torch.ones(64)), "without quant_scale"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_emulated_op_refuses_what_torch_npus_documentation_rules_out(case):
    change, message = REFUSED[case]
    with pytest.raises(RuntimeError, match=message):
        wqbmm(**_args(**change))


def test_the_forms_that_are_not_emulated_say_so():
    with pytest.raises(NotImplementedError, match="only the weight-only forms"):
        wqbmm(**_args(), quant_scale=torch.ones(64))
    with pytest.raises(NotImplementedError, match="int64 antiquant_scale"):
        wqbmm(**_args(antiquant_scale=torch.ones(64, dtype=torch.int64), antiquant_group_size=0))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (torch.full((4, 16), 8, dtype=torch.int32), "\\[-8, 7\\]"),
        (torch.zeros(4, 12, dtype=torch.int32), "multiple of 8"),
        (torch.zeros(16, 4, dtype=torch.int32).t(), "contiguous"),
        (torch.zeros(4, 16, dtype=torch.int8), "must be int32"),
    ],
    ids=["out of range", "not 8-aligned", "not contiguous", "int8"],
)
def test_the_emulated_packing_refuses_what_the_documentation_rules_out(values, message):
    with pytest.raises(RuntimeError, match=message):
        pack(values)


# -- the driver's kernels --------------------------------------------------------------------


@pytest.fixture(scope="module")
def emulated_npu():
    driver = create(emulate=True)
    driver.device.initialize()
    return driver


def driver_problem(driver, scheme: str, group: int | None) -> str | None:
    """The driver's kernel on fresh weights at decode and prefill row counts, an N that is not
    a multiple of 8, 3-D inputs: within the float64 bound, and close to the reference
    kernel (``F.linear`` on the dequantized weight)."""
    kernel = driver.kernel("linear", f"{scheme}-npu")
    reference = driver.kernel("linear", f"{scheme}-dequant")
    for m, n, k in ((1, 100, 256), (9, 64, 384), (40, 32, 128)):
        w = _weight(n, k, scheme, group, seed=m + n)
        x = _r(m, k, seed=m).view(1, m, k) if m > 1 else _r(m, k, seed=m)
        got = kernel.fn(x, w)
        if got.shape != (*x.shape[:-1], n):
            return f"{m}x{k} @ {k}x{n}: shape {list(got.shape)}"
        why = _problem(got, x, w.dequantize(torch.float64))
        if why is not None:
            return f"{m}x{k} @ {k}x{n}: {why}"
        if _problem(reference.fn(x, w), x, w.dequantize(torch.float64)) is not None:
            return "the reference kernel itself is off"  # (the bound is sound for it too)
    return None


@pytest.mark.parametrize(("scheme", "group"), SCHEMES, ids=IDS)
def test_the_drivers_kernels_agree_with_float64_and_the_reference(emulated_npu, scheme, group):
    assert driver_problem(emulated_npu, scheme, group) is None


def _reshaped_scale(w, pack_fn):
    """A planted driver bug: the scale [N, K/g] reshaped to [K/g, N] instead of transposed."""
    form = _real_w4a16_form(w, pack_fn)
    if form.group_size == 0:
        return form
    wrong = w.scale.reshape(form.scale.shape[0], -1)
    wrong = torch.nn.functional.pad(wrong, (0, form.scale.shape[1] - wrong.shape[1]), value=1.0)
    return attrs.evolve(form, scale=wrong.contiguous())


def _packed_by_hand(w, pack_fn):
    return _real_w4a16_form(w, _natural_pack)


_real_w4a16_form = quantized.w4a16_form


@pytest.mark.parametrize("planted", [_reshaped_scale, _packed_by_hand], ids=["reshaped", "by hand"])
def test_a_planted_driver_layout_bug_is_caught(emulated_npu, planted, monkeypatch):
    monkeypatch.setattr(quantized, "w4a16_form", planted)
    assert driver_problem(emulated_npu, "int4", 32) is not None


def test_a_planted_emulation_bug_is_caught_through_the_driver(emulated_npu, monkeypatch):
    monkeypatch.setattr(quant_ops, "_per_element", _tiled_groups)
    assert driver_problem(emulated_npu, "int4", 64) is not None


def test_a_weight_of_one_group_passes_its_scale_per_channel(emulated_npu):
    w = _weight(24, 64, "int4", 64)  # K == group: the op takes groups only below K
    got = emulated_npu.kernel("linear", "int4-npu").fn(_r(2, 64, seed=12), w)
    assert w.forms["npu-w4a16"].group_size == 0 and w.forms["npu-w4a16"].scale.shape == (24,)
    assert _problem(got, _r(2, 64, seed=12), w.dequantize(torch.float64)) is None


def test_each_call_is_one_device_op_and_the_layout_is_derived_once(emulated_npu):
    kernel = emulated_npu.kernel("linear", "int4-npu")
    w, x = _weight(64, 128, "int4", 32), _r(3, 128, seed=13)
    with DeviceOpCounter() as first:
        kernel.fn(x, w)
    with DeviceOpCounter() as second:
        kernel.fn(x, w)
    assert first.by_name["rlt_npu_emulated.npu_convert_weight_to_int4pack"] == 1
    assert dict(second.by_name) == {"rlt_npu_emulated.npu_weight_quant_batchmatmul": 1}
    empty = emulated_npu.kernel("linear", "int8-npu").fn(_r(0, 128), _weight(8, 128, "int8", None))
    assert empty.shape == (0, 8)  # no call: the op refuses empty tensors


def test_the_kernels_claim_nothing_and_only_the_plans_own_checks_admit_them(emulated_npu):
    for scheme in ("int8", "int8g", "int4", "int8z"):
        kernel = emulated_npu.kernel("linear", f"{scheme}-npu")
        assert kernel.scheme == scheme and not kernel.fast_only and kernel.available() is None
        assert not (kernel.hf_exact or kernel.row_invariant or kernel.column_invariant)
    assert emulated_npu.quantization_schemes == ("int8", "int8g", "int4", "int8z")
    assert all(k.scheme == "bf16" for k in emulated_npu.kernels_for("linear"))


def test_the_op_table_of_an_installed_torch_npu_has_the_quantized_ops(monkeypatch):
    """With a stand-in torch_npu module (a test double: no real torch_npu can load here)."""
    stand_in = types.ModuleType("torch_npu")
    for name in quantized.QUANT_OPS:
        setattr(stand_in, name, object())
    stand_in.npu_scatter_nd_update_ = object()
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(
        device_count=None, set_device=None, current_stream=None, Event=None, synchronize=None,
    ), raising=False)  # fmt: skip
    table = import_torch_npu()
    for name in quantized.QUANT_OPS:
        assert getattr(table, name) is getattr(stand_in, name)


# -- step graphs -----------------------------------------------------------------------------


def _quantized_step(driver):
    """Two quantized linears on fresh weights (their layouts not yet derived)."""
    int8, int4 = (driver.kernel("linear", f"{s}-npu") for s in ("int8", "int4"))
    w8, w4 = _weight(64, 128, "int8", None), _weight(128, 64, "int4", 32)
    x = _r(4, 128, seed=14)
    return x, lambda: int4.fn(int8.fn(x, w8), w4)


def test_a_captured_step_takes_the_quantized_linears_like_any_kernel(emulated_npu):
    """Captured on first use: the layouts derived in the capture's run are warm-up work (on
    the device, NpuStepGraphs' warm-up derives them), the graph holds one op per linear,
    and replays follow new inputs."""
    x, step = _quantized_step(emulated_npu)
    graph, out = emulated_npu.step_graphs().capture(step)
    captured = [op[0] for op in graph.graph._tape.ops]
    assert captured == ["torch_npu.npu_weight_quant_batchmatmul"] * 2
    for seed in (15, 16):
        x.copy_(_r(4, 128, seed=seed))
        graph.replay()
        assert torch.equal(out, step())


def test_a_layout_derived_inside_the_capture_as_part_of_the_step_breaks_the_replay(
    emulated_npu, monkeypatch
):
    """Planted: the derivation not marked as warm-up work. The emulated graph records the
    packing in the capture, the replay (weights already packed) issues other ops."""
    monkeypatch.setattr(quantized, "warm_up_work", contextlib.nullcontext)
    x, step = _quantized_step(emulated_npu)
    graph, _ = emulated_npu.step_graphs().capture(step)
    with pytest.raises(GraphReplayError, match="another op"):
        graph.replay()


def test_the_emulated_npu_quantize_follows_its_documented_form_and_refuses_the_rest():
    """EMULATED torch_npu.npu_quantize (a test double): ``x * scales + zero_points`` to int8
    with div_mode=False; a caller passing scales that do not fit the last axis, zero points of
    another dtype, or another mode is refused as the docs say, not computed."""
    x = torch.tensor([[0.3, -1.2, 5.0, 400.0]], dtype=torch.bfloat16)
    inv = torch.full((4,), 2.0, dtype=torch.bfloat16)
    off = torch.full((4,), 1.0, dtype=torch.bfloat16)
    q = quant_ops.npu_quantize(x, inv, off, torch.qint8, -1, False)
    assert q.dtype == torch.int8 and q.tolist() == [[2, -1, 11, 127]]  # rint, saturated
    with pytest.raises(RuntimeError, match="scales must be 1-D of size 4"):
        quant_ops.npu_quantize(x, inv[:3], off[:3], torch.qint8, -1, False)
    with pytest.raises(RuntimeError, match="zero_points must have scales' shape and dtype"):
        quant_ops.npu_quantize(x, inv, off.float(), torch.qint8, -1, False)
    with pytest.raises(NotImplementedError, match="div_mode=False"):
        quant_ops.npu_quantize(x, inv, off, torch.qint8, -1, True)
