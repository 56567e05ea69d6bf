"""The npu driver's quantized linears: ``torch_npu.npu_weight_quant_batchmatmul`` (weight-only),
and ``npu_dynamic_quant`` then ``npu_quant_matmul`` (W8A8 dynamic).

``int8-npu`` (W8A16) and ``int4-npu`` (W4A16) take a ``hal.quant.QuantizedWeight`` and call
the op with the weight in the layout vllm-ascend gives it, derived once per weight
(``QuantizedWeight.form``):

- int8: the int8 ``[N, K]`` transposed to a contiguous ``[K, N]``, the scale ``[N]`` per
  channel (vllm-ascend's W8A16 linear method: ``weight.transpose(0, 1).contiguous()``,
  ``torch.flatten(weight_scale)``).
- int8g (int8 with a scale per group): the same weight, the scale transposed to ``[K / group,
  N]`` and ``antiquant_group_size`` the group.
- int4: the values as int32 ``[K, N]`` packed by ``npu_convert_weight_to_int4pack`` to
  ``[K, N / 8]``, the scale transposed to ``[K / group, N]`` and ``antiquant_group_size`` the
  group (vllm-ascend's wNa16 linear kernel). N is padded to a multiple of 8 (the pack's rule)
  with zero weights, and those columns dropped from the output. A weight of one group
  (``K == group``) passes its scale per channel: the op takes groups only below K.

- int8 with per-token activations (``int8-token-npu``, vllm-ascend's W8A8 dynamic linear
  method): ``npu_dynamic_quant(x)`` gives int8 rows and their fp32 scales, then
  ``npu_quant_matmul(q, weight [K, N], scale [N] fp32, pertoken_scale=..., output_dtype=bf16)``.
- int8 with static activations (``int8-static-npu``, vllm-ascend's W8A8 static linear method):
  ``npu_quantize(x, 1 / input_scale, input_offset, torch.qint8, -1, False)`` then
  ``npu_quant_matmul(q, weight [K, N], deq_scale, bias=quant_bias, output_dtype=bf16)``.

- int8z (asymmetric int8, ``int8z-npu``): int8g's call with ``antiquant_offset = -z`` in the
  scale's shape, as vllm-ascend's msModelSlim W8A16 passes the checkpoint's ``weight_offset``
  (the op adds it to the integer before scaling: ``(w + offset) * scale``). The symmetric
  schemes pass no offset (vllm-ascend's wNa16 kernel passes None).

Like the driver's fused kernels (``drivers.npu.fused``), these claim nothing: not HF-exact
(the device sums in its own order), and neither row nor column invariance, which nothing
here can show for the hardware. They are not ``fast_only``: a deterministic plan uses one only
where its start-up check on the device finds a row's bits the same in every call shape
(``hal.kernels.check_rows``, run at the model's shapes), and a fast plan where its timing is
the best. On the emulated torch_npu they run ``drivers.npu.quant_ops``, a test double, not
hardware.

Inside a step graph each call is one op: the layout is derived on a weight's first call,
which on the device is the step's warm-up before capture (``drivers.npu.graphs``).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from drivers.npu.fused import _Ops
from drivers.npu.graphs import warm_up_work
from hal.kernels import Kernel
from hal.quant import QuantizedWeight

VERSION = "npu-quant-1"
WEIGHT_ONLY_OPS = ("npu_weight_quant_batchmatmul", "npu_convert_weight_to_int4pack")
TOKEN_OPS = ("npu_dynamic_quant", "npu_quant_matmul")  # W8A8 dynamic
STATIC_OPS = ("npu_quantize", "npu_quant_matmul")  # W8A8 static
QUANT_OPS = WEIGHT_ONLY_OPS + TOKEN_OPS + ("npu_quantize",)
PACK = 8  # int4 values per packed int32


@attrs.frozen
class NpuWeight:
    """One weight as the op takes it (``QuantizedWeight.form``'s value)."""

    weight: torch.Tensor  # int8 [K, N], or int32 [K, N' / 8] (N' = N padded to 8)
    scale: torch.Tensor  # bf16 [N'] per channel, or [K / group, N']
    group_size: int  # antiquant_group_size: 0 per channel
    out_features: int  # N: the output's columns (N' - N padding columns dropped)
    offset: torch.Tensor | None = None  # antiquant_offset (int8z: -z), the scale's shape


def w8a16_form(w: QuantizedWeight) -> NpuWeight:
    """int8: the scale per channel; int8g: transposed to [K / group, N] (one group: per
    channel, as int4's); int8z: int8g's with ``antiquant_offset`` ``-z`` (bf16, exact) in the
    scale's shape, as vllm-ascend passes an asymmetric W8A16 checkpoint's ``weight_offset``."""
    n, k = w.shape
    weight = w.qweight[:, :k].t().contiguous()
    offset = None
    if w.scheme == "int8z":
        offset = (-w.zero_points().to(torch.int16)).to(torch.bfloat16).t().contiguous()
    if w.scheme == "int8" or k // w.group_size == 1:
        per_channel = None if offset is None else offset.reshape(n).contiguous()
        return NpuWeight(weight, w.scale.reshape(n).contiguous(), 0, n, per_channel)
    return NpuWeight(weight, w.scale.t().contiguous(), w.group_size, n, offset)


def w4a16_form(w: QuantizedWeight, pack) -> NpuWeight:
    n, k = w.shape
    values = w.integers().t().to(torch.int32)  # [K, N]
    scale = w.scale.t()  # [K / group, N]
    pad = -n % PACK
    if pad:
        values, scale = F.pad(values, (0, pad)), F.pad(scale, (0, pad), value=1.0)
    group = w.group_size
    if k // group == 1:  # one group: per channel (the op's groups must be below K)
        scale, group = scale[0], 0
    return NpuWeight(pack(values.contiguous()), scale.contiguous(), group, n)


def kernels(device) -> tuple[Kernel, ...]:
    ops = _Ops(device)

    def matmul(x: torch.Tensor, form: NpuWeight) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)  # the op takes 2-D x (M, K)
        if rows.shape[0] == 0:  # the op refuses empty tensors
            return x.new_empty(*lead, form.out_features)
        out = ops("npu_weight_quant_batchmatmul")(
            rows, form.weight, form.scale, antiquant_offset=form.offset,
            antiquant_group_size=form.group_size,
        )  # fmt: skip
        if out.shape[-1] != form.out_features:
            out = out[:, : form.out_features]
        return out.reshape(*lead, form.out_features)

    def int8_form(w: QuantizedWeight) -> NpuWeight:
        with warm_up_work():  # derived on the first call, before any capture on the device
            return w8a16_form(w)

    def int4_form(w: QuantizedWeight) -> NpuWeight:
        with warm_up_work():
            return w4a16_form(w, ops("npu_convert_weight_to_int4pack"))

    def int8_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        return matmul(x, w.form("npu-w8a16", int8_form))

    def int4_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        return matmul(x, w.form("npu-w4a16", int4_form))

    def token_form(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        with warm_up_work():  # int8 [K, N] and the channel scales in fp32 (exact)
            return w.qweight.t().contiguous(), w.scale.float().reshape(-1).contiguous()

    def int8_token_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        weight, scale = w.form("npu-w8a8-dynamic", token_form)
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)
        if rows.shape[0] == 0:
            return x.new_empty(*lead, weight.shape[1])
        q, per_token = ops("npu_dynamic_quant")(rows)
        out = ops("npu_quant_matmul")(
            q, weight, scale, pertoken_scale=per_token, output_dtype=x.dtype
        )
        return out.reshape(*lead, weight.shape[1])

    def static_form(w: QuantizedWeight) -> tuple[torch.Tensor, ...]:
        """vllm-ascend's W8A8 static layer after loading: the int8 weight ``[K, N]``, the
        input's reciprocal scale and offset repeated K times (its ``aclnn_input_scale_
        reciprocal``, ``1 / input_scale`` in the parameter's bf16, and ``aclnn_input_offset``),
        ``deq_scale`` fp32 and ``quant_bias`` int32."""
        if w.static is None:
            raise ValueError("int8-static-npu takes a W8A8 static weight (its StaticInput)")
        with warm_up_work():
            k, st = w.in_features, w.static
            inv = (torch.ones_like(st.scale) / st.scale).repeat(k)
            return (
                w.qweight.t().contiguous(), inv, st.offset.to(inv.dtype).repeat(k),
                st.deq_scale.float().contiguous(), st.bias.to(torch.int32).contiguous(),
            )  # fmt: skip

    def int8_static_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        weight, inv, offset, deq_scale, bias = w.form("npu-w8a8-static", static_form)
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)
        if rows.shape[0] == 0:
            return x.new_empty(*lead, weight.shape[1])
        q = ops("npu_quantize")(rows, inv, offset, torch.qint8, -1, False)
        out = ops("npu_quant_matmul")(q, weight, deq_scale, bias=bias, output_dtype=x.dtype)
        return out.reshape(*lead, weight.shape[1])

    def check_token() -> None:
        for name in TOKEN_OPS:
            ops(name)

    def check_static() -> None:
        for name in STATIC_OPS:
            ops(name)

    def check_int4() -> None:
        for name in WEIGHT_ONLY_OPS:
            ops(name)

    return (
        Kernel("linear", "int8-npu", int8_linear, scheme="int8",
               check=ops.check("npu_weight_quant_batchmatmul"), version=VERSION,
               description="npu_weight_quant_batchmatmul, int8 [K, N], per-channel scale"),
        Kernel("linear", "int8g-npu", int8_linear, scheme="int8g",
               check=ops.check("npu_weight_quant_batchmatmul"), version=VERSION,
               description="npu_weight_quant_batchmatmul, int8 [K, N], group-wise scale [K/g, N]"),
        Kernel("linear", "int8z-npu", int8_linear, scheme="int8z",
               check=ops.check("npu_weight_quant_batchmatmul"), version=VERSION,
               description="npu_weight_quant_batchmatmul, int8 [K, N], group-wise scale and "
                           "antiquant_offset -z [K/g, N]"),
        Kernel("linear", "int8-token-npu", int8_token_linear, scheme="int8",
               activations="int8-token", check=check_token, version=VERSION,
               description="W8A8 dynamic: npu_dynamic_quant per token, npu_quant_matmul with "
                           "int8 [K, N], per-channel and per-token scales"),
        Kernel("linear", "int8-static-npu", int8_static_linear, scheme="int8",
               activations="int8-static", check=check_static, version=VERSION,
               description="W8A8 static: npu_quantize with the calibrated scale and offset, "
                           "npu_quant_matmul with int8 [K, N], quant_bias and deq_scale"),
        Kernel("linear", "int4-npu", int4_linear, scheme="int4",
               check=check_int4, version=VERSION,
               description="npu_weight_quant_batchmatmul, int4 packed by "
                           "npu_convert_weight_to_int4pack, group-wise scale [K/g, N]"),
    )  # fmt: skip
