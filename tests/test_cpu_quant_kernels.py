"""The cpu driver's weight-only int8 and int4 projections (its avx2 kernels and torch's own):
accuracy against float64 on the dequantized weight, the avx2 kernels' row and column
invariance, their place in the driver, their errors, and checks that would catch a wrong
layout or scale. (Their speed: benchmarks/quant_kernels.py.)"""

from __future__ import annotations

import pytest
import torch

from drivers.cpu import quant_kernels
from drivers.cpu.driver import create
from hal.kernels import KernelUnavailable, check_rows
from hal.quant import (
    GROUP_SIZES,
    QuantizedWeight,
    adversarial_qrows,
    adversarial_qweight,
    dequantized_linear,
    from_integers,
    quantize,
    quantize_activations,
)
from hal.reference import linear_f64

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs AVX2"
)

QUANT_KERNELS = (
    "int8-avx2",
    "int8-torch",
    "int8-a8-avx2",
    "int4-avx2",
    "int4-torch",
    "int4-a8-avx2",
    "int8g-avx2",
    "int8g-a8-avx2",
    "int8-token-avx2",
)
INVARIANT = (
    "int8-avx2",
    "int4-avx2",
    "int8-a8-avx2",
    "int4-a8-avx2",
    "int8g-avx2",
    "int8g-a8-avx2",
    "int8-token-avx2",
)
# Kernels that quantize their activations: per block of 32, or per token.
A8 = {
    "int8-a8-avx2": "int8",
    "int4-a8-avx2": "int8",
    "int8g-a8-avx2": "int8",
    "int8-token-avx2": "int8-token",
}
SCHEMES = [("int8", None)] + [(s, g) for s in ("int8g", "int4") for g in GROUP_SIZES]


def _scheme(kernel: str) -> str:
    return kernel.split("-")[0]


# (kernel, group size) for each kernel and the group sizes of its scheme
CASES = [(n, g) for n in QUANT_KERNELS for s, g in SCHEMES if _scheme(n) == s]


def _kernel(name: str):
    kernel = create().kernel("linear", name)
    why = kernel.available()
    if why is not None:
        pytest.skip(why)
    return kernel


def _weight(n: int, k: int, scheme: str, group: int | None, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=gen).bfloat16(), scheme, group)


def _excess(got: torch.Tensor, x: torch.Tensor, w: QuantizedWeight, name: str = "") -> float:
    """How far ``got`` exceeds the float64 bound on the dequantized weight (<= 0: within).

    The bound is ``hal.reference.linear_f64``'s for bf16 kernels: a kernel that dequantizes
    exactly (or scales a sum once), sums in fp32 and rounds to bf16 once is off by at most
    half a bf16 ulp of the result plus ``k * 2^-24 * sum|x * w|`` of accumulation. A W8A8 /
    W4A8 kernel (``A8``) is held to it on the activations it sums: ``quantize_activations``."""
    seen = quantize_activations(x, A8[name]) if name in A8 else x
    exact, bound = linear_f64(seen, w.dequantize(torch.float64))
    return ((got.double() - exact).abs() - bound).max().item()


# K: 8-multiples and tails for int8; every int4 K is a multiple of 128 (so of each group).
K_OF = {"int8": (64, 203, 2048), "int8g": (128, 384, 2048), "int4": (128, 384, 2048)}


@pytest.mark.parametrize("name, group", CASES)
def test_each_kernel_is_within_bf16_rounding_of_float64_on_the_dequantized_weight(name, group):
    kernel, scheme = _kernel(name), _scheme(name)
    gen = torch.Generator().manual_seed(3)
    for k in K_OF[scheme]:
        for n in (37, 96):  # N with and without the register block's tail
            w = _weight(n, k, scheme, group, seed=k + n)
            for m in (1, 3, 8, 33):
                x = torch.randn(m, k, generator=gen).bfloat16()
                got = kernel.fn(x, w)
                assert got.shape == (m, n) and got.dtype == torch.bfloat16
                worst = _excess(got, x, w, name)
                assert worst <= 0, f"{name} {scheme} g{group}: {m}x{k} @ {k}x{n} by {worst:.3g}"


@pytest.mark.parametrize("name", QUANT_KERNELS)
def test_leading_dimensions_and_views_are_handled(name):
    kernel = _kernel(name)
    w = _weight(32, 256, _scheme(name), 64)
    x = torch.randn(6, 256).bfloat16()
    flat = kernel.fn(x, w)
    assert torch.equal(kernel.fn(x.view(2, 3, 256), w), flat.view(2, 3, 32))
    strided = torch.cat([x, x], dim=1)[:, :256]  # not contiguous
    assert torch.equal(kernel.fn(strided, w), flat)
    assert kernel.fn(x[:0], w).shape == (0, 32)


def test_torchs_int4_kernel_gets_its_packing_once_per_weight_and_any_n():
    kernel = _kernel("int4-torch")
    w = _weight(37, 128, "int4", 32)  # torch packs N in multiples of 16: padded
    x = torch.randn(3, 128).bfloat16()
    assert _excess(kernel.fn(x, w), x, w) <= 0
    packed = w.forms["torch-int4pack"]
    kernel.fn(x, w)
    assert w.forms["torch-int4pack"] is packed


@pytest.mark.parametrize("name, group", [c for c in CASES if c[0] in INVARIANT])
def test_the_avx2_kernels_keep_a_rows_bits_in_any_call(name, group):
    kernel, scheme = _kernel(name), _scheme(name)
    gen = torch.Generator().manual_seed(group or 8)
    shapes = [(37, 203 if scheme == "int8" else 256), (2048, 2048)]
    if group in (None, 32):  # the other Ouro shapes once per scheme
        shapes += [(6144, 2048), (11264, 2048), (2048, 5632)]
    for n, k in shapes:
        w = adversarial_qweight(n, k, scheme, group, gen)
        x = adversarial_qrows(32, k, scheme, gen)
        why = check_rows(lambda rows, w=w: kernel.fn(rows, w), x, (1, 2, 3, 4, 5, 8, 13, 16))
        assert why is None, f"{name} [{n}, {k}] group {group}: {why}"


@pytest.mark.parametrize("scheme, group", [("int8", None), ("int4", 32)])
def test_the_adversarial_inputs_show_a_change_of_summation_order(scheme, group):
    # Why check_rows needs these inputs: torch's dequantize-then-F.linear sums in another
    # order than the avx2 kernel, which the adversarial inputs show on almost every output.
    kernel = _kernel(f"{scheme}-avx2")
    gen = torch.Generator().manual_seed(5)
    w = adversarial_qweight(256, 2048, scheme, group, gen)
    x = adversarial_qrows(16, 2048, scheme, gen)
    differs = kernel.fn(x, w) != dequantized_linear(x, w)
    assert differs.float().mean() > 0.5


@pytest.mark.parametrize("name, group", [c for c in CASES if c[0] in INVARIANT])
def test_stacked_weights_give_the_bits_of_their_parts(name, group):
    kernel = _kernel(name)
    w = _weight(96 + 37 + 40, 256, _scheme(name), group, seed=7)  # q|k|v, with register-block tails
    x = torch.randn(5, 256).bfloat16()
    stacked = kernel.fn(x, w)
    at = 0
    for n in (96, 37, 40):
        assert torch.equal(kernel.fn(x, w.rows(at, at + n)), stacked[:, at : at + n]), (at, n)
        at += n


def _nibbles_swapped(w: QuantizedWeight) -> QuantizedWeight:
    q = w.qweight
    return QuantizedWeight("int4", (q >> 4) | (q << 4), w.scale, w.group_size, w.in_features)


def _next_groups_scale(w: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(
        w.scheme, w.qweight, w.scale.roll(-1, dims=-1).contiguous(), w.group_size, w.in_features
    )


def _next_channels_scale(w: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight("int8", w.qweight, w.scale.roll(1), w.group_size, w.in_features)


@pytest.mark.parametrize(
    "name, group, plant",
    [
        ("int8-avx2", None, _next_channels_scale),
        ("int4-avx2", 32, _nibbles_swapped),
        ("int4-avx2", 64, _next_groups_scale),
        ("int4-avx2", 128, _next_groups_scale),
        ("int8-a8-avx2", None, _next_channels_scale),
        ("int4-a8-avx2", 32, _nibbles_swapped),
        ("int4-a8-avx2", 64, _next_groups_scale),
        ("int8g-avx2", 32, _next_groups_scale),
        ("int8g-a8-avx2", 128, _next_groups_scale),
        ("int8-token-avx2", None, _next_channels_scale),
    ],
)
def test_the_float64_comparison_catches_a_wrong_layout_or_scale(name, group, plant):
    # A kernel reading the wrong nibble or another group's (channel's) scale is what the
    # accuracy test must catch: handed such a weight, the right kernel fails the bound.
    kernel = _kernel(name)
    w = _weight(64, 256, _scheme(name), group, seed=9)
    x = torch.randn(3, 256).bfloat16()
    assert _excess(kernel.fn(x, w), x, w, name) <= 0
    assert _excess(kernel.fn(x, plant(w)), x, w, name) > 0


@pytest.mark.parametrize("lanes", [(0, 2, 4, 6, 1, 3, 5, 7), (1, 0, 2, 3, 4, 5, 6, 7)])
def test_the_float64_comparison_catches_an_octet_repacked_wrong(monkeypatch, lanes):
    # The W4A8 kernel reads its weight repacked eight rows at a time, each octet's scales in
    # the order its sums come out in: scales laid out in another order must fail the bound.
    kernel = _kernel("int4-a8-avx2")
    x = torch.randn(3, 256).bfloat16()
    right = _weight(64 + 5, 256, "int4", 32, seed=9)
    assert _excess(kernel.fn(x, right), x, right, "int4-a8-avx2") <= 0
    monkeypatch.setattr(quant_kernels, "OCTET_LANES", lanes)
    w = _weight(64 + 5, 256, "int4", 32, seed=9)  # a fresh weight: its repacked form is new
    assert _excess(kernel.fn(x, w), x, w, "int4-a8-avx2") > 0


def test_an_exactly_representable_case_gives_the_exact_result():
    # Small integers times powers of two: every product and sum is exact in fp32 and bf16,
    # so each kernel must give exactly x @ dequant(w).T (a wrong group or nibble cannot).
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(-8, 8, (24, 128), generator=gen)
    for scheme, group in SCHEMES:
        groups = 128 // group if group else 1
        scale = 2.0 ** torch.randint(-3, 3, (24, groups), generator=gen).float()
        w = from_integers(q, scale if group else scale[:, 0], scheme, group)
        x = torch.randint(-4, 5, (3, 128), generator=gen).bfloat16()
        exact = (x.double() @ w.dequantize(torch.float64).T).bfloat16()
        for name in QUANT_KERNELS:  # (A8 kernels round x itself: not exact here)
            if _scheme(name) == scheme and name not in A8:
                assert torch.equal(_kernel(name).fn(x, w), exact), (name, group)


def test_the_cpu_driver_offers_them_with_their_claims():
    driver = create()
    int8 = {k.name: k for k in driver.kernels_for("linear", "int8")}
    int8g = {k.name: k for k in driver.kernels_for("linear", "int8g")}
    int4 = {k.name: k for k in driver.kernels_for("linear", "int4")}
    assert {"int8-dequant", "int8-avx2", "int8-torch"} <= set(int8)
    assert {"int8g-dequant", "int8g-avx2", "int8g-a8-avx2"} <= set(int8g)
    assert {"int4-dequant", "int4-avx2", "int4-torch"} <= set(int4)
    for k in (int8["int8-avx2"], int8g["int8g-avx2"], int8g["int8g-a8-avx2"], int4["int4-avx2"]):
        assert k.row_invariant and k.column_invariant and not k.hf_exact and k.version
    for k in (int8["int8-torch"], int4["int4-torch"]):
        assert not (k.row_invariant or k.column_invariant or k.hf_exact)
    assert "int8-avx2" not in {k.name for k in driver.kernels_for("linear")}  # bf16 only
    int8z = {k.name: k for k in driver.kernels_for("linear", "int8z")}
    assert {"int8z-dequant", "int8z-avx2"} <= set(int8z)
    assert int8z["int8z-avx2"].row_invariant and int8z["int8z-avx2"].column_invariant
    assert set(driver.quantization_schemes) == {"int8", "int8g", "int4", "int8z"}


def test_the_kernels_are_torch_custom_ops_with_fake_implementations():
    w8, w4 = _weight(16, 64, "int8", None), _weight(16, 64, "int4", 32)
    x = torch.randn(3, 64).bfloat16()
    with torch.profiler.profile() as prof:
        quant_kernels.int8_avx2(x, w8)
        quant_kernels.int4_avx2(x, w4)
    names = {e.key for e in prof.key_averages()}
    assert {"rlt_cpu::linear_int8_avx2", "rlt_cpu::linear_int4_avx2"} <= names
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x = torch.empty(5, 64, dtype=torch.bfloat16)
        q8, s8 = torch.empty(16, 64, dtype=torch.int8), torch.empty(16, dtype=torch.bfloat16)
        q4, s4 = torch.empty(16, 32, dtype=torch.uint8), torch.empty(16, 2, dtype=torch.bfloat16)
        assert quant_kernels.linear_int8_avx2(x, q8, s8).shape == (5, 16)
        assert quant_kernels.linear_int4_avx2(x, q4, s4, 32).shape == (5, 16)


def test_they_reject_what_they_cannot_compute():
    w8, w4 = _weight(16, 64, "int8", None), _weight(16, 64, "int4", 32)
    x = torch.randn(3, 64).bfloat16()
    with pytest.raises(TypeError, match="bf16 CPU tensors"):
        quant_kernels.linear_int8_avx2(x.float(), w8.qweight, w8.scale)
    with pytest.raises(TypeError, match="bf16 CPU tensors"):
        quant_kernels.linear_int4_avx2(x, w4.qweight, w4.scale.float(), 32)
    with pytest.raises(TypeError, match="torch.int8 CPU qweight"):
        quant_kernels.linear_int8_avx2(x, w8.qweight.to(torch.int16), w8.scale)
    with pytest.raises(TypeError, match="torch.uint8 CPU qweight"):
        quant_kernels.linear_int4_avx2(x, w4.qweight.to(torch.int8), w4.scale, 32)
    with pytest.raises(TypeError, match="contiguous qweight and scale"):
        quant_kernels.linear_int8_avx2(x, w8.qweight.t().contiguous().t(), w8.scale)
    with pytest.raises(ValueError, match="do not match"):
        quant_kernels.linear_int8_avx2(x[:, :32], w8.qweight, w8.scale)
    with pytest.raises(ValueError, match="do not match group 64"):
        quant_kernels.linear_int4_avx2(x, w4.qweight, w4.scale, 64)
    with pytest.raises(ValueError, match="must be one of"):
        quant_kernels.linear_int4_avx2(x, w4.qweight, w4.scale, 16)


def test_the_w4a8_kernel_rejects_a_weight_not_in_its_octet_layout():
    w4 = _weight(16, 64, "int4", 32)
    x = torch.randn(3, 64).bfloat16()
    w8, s8 = quant_kernels.int4_octets(w4)
    assert quant_kernels.linear_int4_a8_avx2(x, w8, s8, 16, 32).shape == (3, 16)
    for args in ((w4.qweight, w4.scale, 16, 32), (w8, s8, 24, 32), (w8, s8, 16, 64)):
        with pytest.raises(ValueError, match="do not match int4_octets' layout"):
            quant_kernels.linear_int4_a8_avx2(x, *args)


@pytest.mark.parametrize(
    "scheme,group", [("int8", None), ("int8g", 64), ("int4", 32), ("int4", 128)]
)
def test_the_vnni_kernels_give_the_avx2_kernels_bits(scheme, group):
    """vpdpbusd sums the same four products into each int32 lane as vpmaddubsw + vpmaddwd:
    every output bit equal, at decode and prefill row counts, with -128 in an int8 weight.
    Row counts up to a register block read several weight streams at once (six rows, four
    octets): 100 and 50 rows leave rows and octets over for the one-stream loop."""
    try:
        quant_kernels.vnni_available()
    except KernelUnavailable as exc:
        pytest.skip(str(exc))
    kernels = {k.name: k for k in quant_kernels.KERNELS}
    gen = torch.Generator().manual_seed(9)
    names = {"int8": ("int8-a8", "int8-token"), "int8g": ("int8g-a8",), "int4": ("int4-a8",)}
    lo = -8 if scheme == "int4" else -128
    for name in names[scheme]:
        for m, n, k in ((1, 96, 256), (1, 100, 256), (4, 50, 384), (5, 40, 384), (33, 24, 256)):
            q = torch.randint(lo, -lo, (n, k), generator=gen)
            scale = torch.rand(n, k // group if group else 1, generator=gen) / 64
            w = from_integers(q, scale if group else scale[:, 0], scheme, group)
            x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
            a = kernels[f"{name}-avx2"].fn(x, w)
            b = kernels[f"{name}-vnni"].fn(x, w)
            assert torch.equal(a, b), f"{name} {m}x{k} @ {k}x{n}"
