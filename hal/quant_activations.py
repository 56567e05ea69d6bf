"""The activations' side of the quantized arithmetic: W8A8 / W4A8 kernels quantize their input
per block of 32 (llama.cpp's Q8_0), per token (vllm-ascend's W8A8 dynamic) or with a calibrated
scale and offset (W8A8 static): the references every driver's kernels of each kind are checked
against, and the reference kernels themselves. The weights' side (schemes, layout,
:class:`~hal.quant.QuantizedWeight`) is ``hal.quant``, which names everything here too."""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

# A projection's weight here is a hal.quant.QuantizedWeight (hal.quant imports this module).
QuantizedWeight = Any


@attrs.frozen(eq=False)
class StaticInput:
    """How a W8A8 static projection quantizes its input (msModelSlim's "W8A8", vllm-ascend's
    ``w8a8_static``): one calibrated scale and offset for every element, and the integer sums'
    bias and dequantization scale per output channel, as the checkpoint stores them.

    - ``scale``, ``offset``: bf16 ``(1,)``, ``input_scale`` and ``input_offset`` as a bf16
      model's parameters hold them; the input is quantized as ``npu_quantize(x, 1 / scale,
      offset, qint8, div_mode=False)`` with ``1 / scale`` computed in bf16 (vllm-ascend's
      reciprocal of the parameter): :func:`quantize_static`.
    - ``bias``: int32 ``[N]`` (``quant_bias``: ``-offset * sum_k q[n, k]``, plus the float
      bias over ``deq_scale`` where a layer has one);
    - ``deq_scale``: fp32 ``[N]`` (``input_scale * weight_scale``).
    """

    scale: torch.Tensor
    offset: torch.Tensor
    bias: torch.Tensor
    deq_scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.scale, self.offset, self.bias, self.deq_scale))

    def rows(self, start: int, stop: int) -> StaticInput:
        return attrs.evolve(self, bias=self.bias[start:stop], deq_scale=self.deq_scale[start:stop])

    def to(self, device: torch.device | str) -> StaticInput:
        return StaticInput(*(t.to(device) for t in attrs.astuple(self, recurse=False)))


ACTIVATION_BLOCK = 32
TOKEN_REFERENCE = "int8-token-ref"  # every driver's per-token reference kernel
STATIC_REFERENCE = "int8-static-ref"  # every driver's W8A8 static reference kernel
TOKEN_CHUNK = 1024  # inputs per exact fp32 partial sum of token_linear


ACTIVATION_KINDS = {"block": ("bf16", "int8"), "token": ("int8-token",), "static": ("int8-static",)}


def kernel_activations(mode: str | None) -> tuple[str, ...]:
    """The ``Kernel.activations`` a quantized projection's kernel may have under ``mode``
    (``--quantize-activations``): None or "none", activations as given; "block", also per
    block of 32 as llama.cpp's Q8_0 ("int8", beside the weight-only kernels); "token", each
    row with one scale as vllm-ascend's W8A8 dynamic ("int8-token", always); "static", the
    weights' calibrated scale and offset, W8A8 static ("int8-static", always)."""
    return ACTIVATION_KINDS.get(mode or "none", ("bf16",))


def quantize_activations(
    x: torch.Tensor, kind: str = "int8", static: StaticInput | None = None
) -> torch.Tensor:
    """``x [..., K]`` as a W8A8 / W4A8 kernel sees it (float64, exact). ``kind`` "int8": each
    row quantized per block of 32 inputs as llama.cpp's Q8_0: ``d = amax / 127`` and ``q =
    round_half_even(x * (1 / d))`` in fp32, ``x~ = q * d`` (a partial last block is its own
    block). "int8-token": each row with one scale (:func:`quantize_per_token`).
    "int8-static": ``(q - offset) * scale`` with ``static``'s (:func:`quantize_static`)."""
    if kind == "int8-token":
        q, d = quantize_per_token(x)
        return q.double() * d.double()[..., None]
    if kind == "int8-static":
        assert static is not None, "int8-static activations need the weight's StaticInput"
        q = quantize_static(x, static).double()
        return (q - static.offset.double().cpu()) * static.scale.double().cpu()
    k = x.shape[-1]
    pad = -k % ACTIVATION_BLOCK
    xf = F.pad(x.float(), (0, pad)).view(*x.shape[:-1], -1, ACTIVATION_BLOCK)
    d = xf.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.round(xf * inv)
    return (q.double() * d.double()).flatten(-2)[..., :k]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` quantized per row as ``torch_npu.npu_dynamic_quant`` does it: documented
    as "scale = rowMax(abs(x)) / DTYPE_MAX, y = round(x / scale)", computed by CANN's
    DynamicQuant kernel (A2/A3) in fp32 as ``inv = 127 / amax``, ``q = round_half_even(x *
    inv)``, ``d = 1 / inv`` (a row of zeros: ``q = 0``, ``d = 0``). Returns ``q`` (int8
    ``[..., K]``) and ``d`` (fp32 ``[...]``)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    zero = amax == 0
    # Tensor divisions: ``127 / t`` would be torch's ``t.reciprocal() * 127``, another rounding.
    inv = torch.full_like(amax, 127.0) / torch.where(zero, torch.ones_like(amax), amax)
    q = torch.round(xf * inv[..., None]).clamp_(-127, 127)
    d = torch.where(zero, torch.zeros_like(amax), torch.ones_like(inv) / inv)
    return q.to(torch.int8), d


def token_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """W8A8 dynamic (vllm-ascend's ``npu_dynamic_quant`` then ``npu_quant_matmul``): each row
    of ``x`` quantized alone (:func:`quantize_per_token`), the integer dot products exact
    (``acc``), then in fp32 ``y = (fp32(acc) * scale[n]) * d[m]`` rounded to bf16. ``w``: int8,
    one scale per output channel. Every driver's "int8-token" kernel computes these bits."""
    if w.scheme != "int8":
        raise ValueError(f"per-token activations take int8 weights per channel, got {w.scheme}")
    lead, k = x.shape[:-1], x.shape[-1]
    q, d = quantize_per_token(x.reshape(-1, k))
    acc = _exact_int_dot(q, w.qweight)
    y = (acc.float() * w.scale.float()) * d[:, None]
    return y.to(x.dtype).view(*lead, w.shape[0])


def quantize_static(x: torch.Tensor, static: StaticInput) -> torch.Tensor:
    """``x`` quantized with a static projection's input scale and offset, as vllm-ascend's
    ``w8a8_static`` calls ``npu_quantize(x, 1 / input_scale, input_offset, qint8, -1,
    div_mode=False)`` (documented: ``x * scales + zero_points``): ``1 / scale`` rounded to
    bf16 (the reciprocal of a bf16 parameter), then in fp32 ``x * inv + offset`` (two
    roundings), rounded half to even and saturated to int8. (The rounding mode and the fp32
    steps are this project's model of the op: the docs give the formula only.)"""
    scale = static.scale.to(x.device)
    inv = (torch.ones_like(scale) / scale).bfloat16().float()
    y = x.float() * inv + static.offset.to(x.device).float()
    return torch.round(y).clamp_(-128, 127).to(torch.int8)


def with_static_input(w: QuantizedWeight, scale: float, offset: int) -> QuantizedWeight:
    """``w`` (int8 per channel) as a W8A8 static projection whose input was calibrated to
    ``scale`` and ``offset``, with the bias and dequantization scale msModelSlim derives:
    ``quant_bias = -offset * sum_k q[n, k]``, ``deq_scale = fp32(input_scale *
    weight_scale)``."""
    if w.scheme != "int8":
        raise ValueError(f"W8A8 static takes int8 weights per channel, got {w.scheme}")
    s = torch.tensor([scale], device=w.device).bfloat16()
    o = torch.tensor([float(offset)], device=w.device).bfloat16()
    bias = (-int(offset) * w.qweight.to(torch.int32).sum(dim=1)).to(torch.int32)
    return attrs.evolve(w, static=StaticInput(s, o, bias, s.float() * w.scale.float()), forms={})


def static_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """W8A8 static (vllm-ascend's ``npu_quantize`` then ``npu_quant_matmul(x_q, w, deq_scale,
    bias=quant_bias)``): ``x`` quantized with the weight's calibrated scale and offset
    (:func:`quantize_static`), the integer dot products exact, ``y = fp32(acc + bias) *
    deq_scale[n]`` in fp32, rounded to bf16. Every driver's "int8-static" kernel computes
    these bits."""
    if w.scheme != "int8" or w.static is None:
        raise ValueError(
            f"static activations take int8 weights per channel with their calibrated input "
            f"scale (an msModelSlim W8A8 checkpoint), got {w.scheme}"
            + ("" if w.static is not None else " without one")
        )
    lead, k = x.shape[:-1], x.shape[-1]
    q = quantize_static(x.reshape(-1, k), w.static)
    acc = _exact_int_dot(q, w.qweight) + w.static.bias.to(torch.int32)
    y = acc.float() * w.static.deq_scale.float()
    return y.to(x.dtype).view(*lead, w.shape[0])


def _exact_int_dot(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``q [M, K] @ weight [N, K].T`` for int8 operands, exact in int32 on any device: fp32
    products of TOKEN_CHUNK inputs (each at most 128 * 128 = 2^14, so every partial sum, in any
    order, is an integer below 2^24: exact), added in int32."""
    acc = torch.zeros(q.shape[0], weight.shape[0], dtype=torch.int32, device=q.device)
    for k0 in range(0, q.shape[1], TOKEN_CHUNK):
        part = q[:, k0 : k0 + TOKEN_CHUNK].float() @ weight[:, k0 : k0 + TOKEN_CHUNK].float().t()
        acc += part.to(torch.int32)
    return acc
