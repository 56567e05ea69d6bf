"""W8A8 dynamic (``--quantize-activations token``; msModelSlim's W8A8_DYNAMIC, llm-compressor's
W8A8): each row of x quantized with one scale as ``torch_npu.npu_dynamic_quant`` computes it,
exact integer sums, then ``(fp32(acc) * scale[n]) * d[m]`` rounded to bf16
(``hal.quant.token_linear``).

Against a float64 model of that arithmetic: the activations' quantization exactly, the output
within its roundings. Every per-token kernel (the reference, cpu's AVX2 one, the npu driver's
on the EMULATED torch_npu, a CPU test double, never hardware) gives the reference's bits;
each comparison is shown to catch a planted bug.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from drivers.npu import quant_ops, quantized
from drivers.npu.driver import create as create_npu
from hal.quant import (
    QuantizedWeight,
    from_integers,
    quantize,
    quantize_per_token,
    token_linear,
)

BF16 = torch.bfloat16
SHAPES = ((1, 96, 256), (3, 37, 203), (9, 64, 384), (33, 40, 2048), (4, 16, 5632))


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes, one of zeros, values that land on .5 ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 10.0 ** torch.randint(-4, 4, (m, 1), generator=gen)
    if m > 2:
        x[1] = 0
        x[2, :4] = torch.tensor([127.0, 63.5, -0.5, 1.5])  # amax 127: x * inv ties at .5
    return x.to(BF16)


def _weight(n: int, k: int, seed: int, with_min: bool = True) -> QuantizedWeight:
    w = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(BF16), "int8")
    if not with_min:
        return w
    q = w.qweight.clone()
    q[0, :3] = -128  # int8's whole range, as checkpoints quantized elsewhere may hold
    return from_integers(q, w.scale, "int8")


def _quantized_f64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CANN's DynamicQuant in float64: fp32 results of +, *, / computed in float64 and rounded
    to fp32 are the correctly rounded fp32 ones."""
    xf = x.double()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax == 0, 0.0, 127.0 / amax).float().double()
    q = (xf * inv).float().double().round()
    d = torch.where(inv == 0, 0.0, 1.0 / inv).float().double()
    return q, d[..., 0]


def _excess(y: torch.Tensor, x: torch.Tensor, w: QuantizedWeight) -> float:
    """How far ``y`` is from ``(sum q * w) * scale * d`` in float64, beyond its roundings: the
    int32 sum to fp32, two fp32 products (2^-24 each), then bf16 (2^-8: half an ulp, relative
    to a value at the bottom of its binade). <= 0: within."""
    q, d = _quantized_f64(x.reshape(-1, x.shape[-1]))
    exact = (q @ w.qweight.double().t()) * w.scale.double() * d[:, None]
    bound = exact.abs() * (2.0**-8 + 3 * 2.0**-24) * (1 + 2.0**-7)
    return ((y.double().reshape(exact.shape) - exact).abs() - bound).max().item()


def test_the_activations_are_quantized_as_cann_computes_it():
    for m, _, k in SHAPES:
        x = _rows(m, k, seed=k)
        q, d = quantize_per_token(x)
        q64, d64 = _quantized_f64(x)
        assert q.dtype == torch.int8 and d.dtype == torch.float32
        assert torch.equal(q.double(), q64) and torch.equal(d.double(), d64)
        assert int(q.abs().max()) == 127  # each nonzero row's largest value maps to +-127


def test_the_reference_is_within_the_roundings_of_float64():
    for m, n, k in SHAPES:
        x, w = _rows(m, k, seed=m), _weight(n, k, seed=n)
        y = token_linear(x, w)
        assert y.shape == (m, n) and y.dtype == BF16
        assert _excess(y, x, w) <= 0, (m, n, k)
        assert m <= 2 or not y[1].any()  # a row of zeros


def test_the_float64_comparison_catches_a_wrong_activation_rounding_or_scale():
    x, w = _rows(9, 384, seed=3), _weight(64, 384, seed=4)
    # per block of 32 (llama.cpp's Q8_0) instead of per token
    from hal.quant import quantize_activations

    blocks = torch.nn.functional.linear(
        quantize_activations(x).float(), w.dequantize(torch.float32)
    )
    assert _excess(blocks.to(BF16), x, w) > 0
    rolled = QuantizedWeight("int8", w.qweight, w.scale.roll(1), w.group_size, w.in_features)
    assert _excess(token_linear(x, rolled), x, w) > 0  # another channel's scale
    q, d = quantize_per_token(x)  # rounded toward zero instead of to nearest:
    truncated = (x.float() * (127 / x.float().abs().amax(-1, True).clamp(min=1e-30))).trunc()
    assert not torch.equal(truncated, q.float())
    acc = truncated.double() @ w.qweight.double().t()
    assert _excess(((acc.float() * w.scale.float()) * d[:, None]).to(BF16), x, w) > 0


def _kernels():
    """Every per-token kernel that can run here: (name, fn)."""
    from drivers.cpu.driver import create as create_cpu

    found = []
    for driver in (create_cpu(), create_npu(emulate=True)):
        for kernel in driver.kernels_for("linear", "int8"):
            if kernel.activations == "int8-token" and kernel.available() is None:
                found.append((f"{driver.name}:{kernel.name}", kernel.fn))
    return found


def test_every_per_token_kernel_gives_the_references_bits():
    names = [name for name, _ in _kernels()]
    assert {"cpu:int8-token-ref", "npu:int8-token-ref", "npu:int8-token-npu"} <= set(names)
    for name, fn in _kernels():
        for m, n, k in SHAPES:
            x, w = _rows(m, k, seed=m + 1), _weight(n, k, seed=n + 1)
            got = fn(x.view(1, m, k), w)
            assert got.shape == (1, m, n), name
            assert torch.equal(got[0], token_linear(x, w)), (name, m, n, k)
            assert fn(x[:0], w).shape == (0, n)


def test_a_planted_emulation_bug_is_caught_through_the_driver(monkeypatch):
    """The emulated npu_quant_matmul applying the per-token scales down the columns (a
    broadcast the wrong way round) fails the comparison."""
    driver = create_npu(emulate=True)
    kernel = driver.kernel("linear", "int8-token-npu")
    x, w = _rows(8, 256, seed=5), _weight(8, 256, seed=6)
    assert torch.equal(kernel.fn(x, w), token_linear(x, w))
    real = quant_ops._quant_matmul

    def transposed(x1, x2, scale, pertoken_scale, bias, output_dtype):
        y = (x1.double() @ x2.double()).float() * scale.float().reshape(1, -1)
        return (y * pertoken_scale.reshape(1, -1)).to(output_dtype)

    monkeypatch.setattr(quant_ops, "_quant_matmul", transposed)
    assert not torch.equal(kernel.fn(x, w), token_linear(x, w))
    monkeypatch.setattr(quant_ops, "_quant_matmul", real)


def test_a_planted_driver_layout_bug_is_caught(monkeypatch):
    """The weight handed over as stored, [N, K], where the op takes [K, N]: refused by the
    op's shape rule, and where N == K, caught by the comparison."""
    driver = create_npu(emulate=True)
    kernel = driver.kernel("linear", "int8-token-npu")
    real_t = torch.Tensor.t
    monkeypatch.setattr(
        quantized, "warm_up_work", lambda: _Untransposed(monkeypatch, real_t), raising=True
    )
    with pytest.raises(RuntimeError, match="disagree on k"):
        kernel.fn(_rows(3, 256, seed=7), _weight(64, 256, seed=8))
    x, w = _rows(3, 128, seed=9), _weight(128, 128, seed=10)
    assert not torch.equal(kernel.fn(x, w), token_linear(x, w))


class _Untransposed:
    """While deriving the layout, ``Tensor.t`` returns the tensor as it is."""

    def __init__(self, monkeypatch, real_t):
        self.monkeypatch, self.real_t = monkeypatch, real_t

    def __enter__(self):
        self.monkeypatch.setattr(torch.Tensor, "t", lambda self: self)

    def __exit__(self, *exc):
        self.monkeypatch.setattr(torch.Tensor, "t", self.real_t)


def test_the_emulated_ops_shapes_are_torch_npus():
    """The meta functions' shapes: y int8 with x's shape and scale fp32 with x's less the last
    dimension; the matmul [m, n] in output_dtype."""
    with FakeTensorMode():
        y, scale = quant_ops.npu_dynamic_quant(torch.empty(2, 5, 64, dtype=BF16))
        assert (y.shape, y.dtype, scale.shape, scale.dtype) == (
            (2, 5, 64), torch.int8, (2, 5), torch.float32
        )  # fmt: skip
        out = quant_ops.npu_quant_matmul(
            torch.empty(5, 64, dtype=torch.int8),
            torch.empty(64, 48, dtype=torch.int8),
            torch.empty(48),
            pertoken_scale=torch.empty(5),
            output_dtype=BF16,
        )
        assert (out.shape, out.dtype) == ((5, 48), BF16)


def _qmm(**change):
    args = dict(
        x1=torch.ones(5, 64, dtype=torch.int8),
        x2=torch.ones(64, 48, dtype=torch.int8),
        scale=torch.ones(48),
        pertoken_scale=torch.ones(5),
        output_dtype=BF16,
    )
    args.update(change)
    return quant_ops.npu_quant_matmul(args.pop("x1"), args.pop("x2"), args.pop("scale"), **args)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(x2=torch.ones(48, 64, dtype=torch.int8)), "disagree on k"),
        (dict(x1=torch.ones(5, 64)), "must both be int8"),
        (dict(pertoken_scale=torch.ones(4)), "pertoken_scale must be float32 \\(5,\\)"),
        (dict(scale=torch.ones(47)), "scale must be float32 or bfloat16"),
        (dict(bias=torch.ones(48)), "bias must be int32"),
        (dict(x1=torch.ones(0, 64, dtype=torch.int8)), "cannot be empty"),
    ],
    ids=["weight as stored", "float x1", "pertoken shape", "scale shape", "float bias", "empty"],
)
def test_the_emulated_matmul_refuses_what_the_documentation_rules_out(change, message):
    with pytest.raises(RuntimeError, match=message):
        _qmm(**change)


def test_the_emulated_quantizer_refuses_what_the_documentation_rules_out():
    with pytest.raises(RuntimeError, match="more than one dimension"):
        quant_ops.npu_dynamic_quant(torch.ones(64, dtype=BF16))
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        quant_ops.npu_dynamic_quant(torch.ones(2, 64))
    with pytest.raises(NotImplementedError, match="smooth_scales"):
        quant_ops.npu_dynamic_quant(torch.ones(2, 64, dtype=BF16), smooth_scales=torch.ones(64))
    with pytest.raises(NotImplementedError, match="offset"):
        _qmm(offset=torch.ones(48))


def test_a_planted_quantizer_bug_in_the_emulation_is_caught_through_the_driver(monkeypatch):
    """The emulated npu_dynamic_quant rounding toward zero (a cast where CANN rounds half to
    even) fails the comparison with the reference."""
    driver = create_npu(emulate=True)
    kernel = driver.kernel("linear", "int8-token-npu")
    x, w = _rows(8, 256, seed=11), _weight(16, 256, seed=12)
    assert torch.equal(kernel.fn(x, w), token_linear(x, w))

    def truncating(x):
        xf = x.float()
        q = torch.full_like(xf[..., 0], 127.0) / xf.abs().amax(dim=-1).clamp(min=1e-30)
        return (xf * q[..., None]).trunc().to(torch.int8), torch.ones_like(q) / q

    monkeypatch.setattr(quant_ops, "_dynamic_quant", truncating)
    assert not torch.equal(kernel.fn(x, w), token_linear(x, w))
