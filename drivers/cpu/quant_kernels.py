"""The cpu driver's quantized projection kernels (``hal.quant``'s layout), as torch custom ops
built with the driver's other kernels (``drivers.cpu.kernels``: one library, one header):

- ``linear_int8_avx2`` and ``linear_int4_avx2`` (``csrc/linear_quant_avx2.c``): weight-only
  quantized projections in ``hal.quant``'s layout (W8A16, W4A16): each weight widened to fp32
  in registers (int4 dequantized exactly, ``q * scale``), activations kept in fp32, the sums
  in linear_avx2's order. Offered as the "int8-avx2" and "int4-avx2" linear kernels; torch's
  own ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` (on its packing, derived
  once per weight: ``drivers.cpu.torch_quant``) are offered beside them as "int8-torch" and
  "int4-torch" (neither claims row invariance), so the execution plan measures which to use.
- ``linear_int8g_avx2`` and ``linear_int8g_a8_avx2``: int8 with one scale per group
  (``hal.quant``'s int8g, llm-compressor's W8A16), each weight dequantized exactly as int4's.
- ``linear_int8_a8_avx2`` and ``linear_int4_a8_avx2`` (``csrc/linear_a8_avx2.c``): the same
  weights with the activations quantized per block of 32 as llama.cpp's Q8_0 does, summed
  with int8 dot products (W8A8, W4A8: "int8-a8-avx2", "int4-a8-avx2", ``Kernel.activations``
  "int8"); the int4 kernel reads its weight repacked eight rows at a time (``int4_octets``,
  a form made once per weight), so that what each block costs beside its dot products is
  spent once for eight rows. About half the instructions per weight of widening it to fp32, which is what
  bounds decode on a CPU without bf16 or VNNI instructions; the arithmetic differs from the
  weight-only kernels by the activations' rounding (``hal.quant.quantize_activations``).
- ``linear_int8_token_avx2``: int8 weights per channel with each row of x quantized with one
  scale, vllm-ascend's W8A8 dynamic ("int8-token-avx2", ``Kernel.activations`` "int8-token"):
  the integer sums exact, so its bits are ``hal.quant.token_linear``'s.
- The four W8A8 / W4A8 kernels again with AVX512-VNNI dot products (``csrc/linear_a8_vnni.c``:
  the same source with vpdpbusd, 256-bit): "int8-a8-vnni", "int8-token-vnni", "int8g-a8-vnni"
  and "int4-a8-vnni", offered where the CPU has avx512_vnni; the same int32 lanes, so the
  same bits as their avx2 forms (the plan times both and picks).
- "int8z-avx2": asymmetric int8 (``hal.quant``'s int8z) dequantized for each call, then the
  bf16 ``linear_avx2``: row- and column-invariant, so deterministic mode runs such
  checkpoints; no kernel reads the zero points in place yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from drivers.cpu.kernels import (
    VERSION,
    _bf16_cpu,
    _loaded,
    _ptr,
    bound_linear,
    custom_op,
    library,
    linear_avx2,
)
from drivers.cpu.torch_quant import KERNELS as TORCH_QUANT_KERNELS
from drivers.cpu.torch_quant import int4_torch, int8_torch  # noqa: F401 - benchmarks call them
from hal.kernels import Kernel, KernelUnavailable
from hal.quant import GROUP_SIZES, QuantizedWeight


def _quant_operands(name: str, x: Tensor, qweight: Tensor, qdtype: torch.dtype, scale: Tensor):
    _bf16_cpu(name, x, scale)
    if qweight.dtype != qdtype or qweight.device.type != "cpu":
        raise TypeError(
            f"{name} takes a {qdtype} CPU qweight, got {qweight.dtype} on {qweight.device}"
        )
    if not (qweight.is_contiguous() and scale.is_contiguous()):
        raise TypeError(f"{name} takes a contiguous qweight and scale (hal.quant's layout)")


def _quant_linear(name: str, x: Tensor, qweight: Tensor, scale: Tensor, n: int, k: int, *extra):
    # A decode row's call costs more here than in C: a 2-D contiguous x (the model's) is used
    # and returned as it is, without a reshape or a view.
    flat = x.dim() == 2 and x.is_contiguous()
    rows = x if flat else x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    kernel = getattr(library()[1], f"rlt_{name}")
    if m and kernel(_ptr(rows), _ptr(qweight), _ptr(scale), _ptr(out), m, n, k, *extra):
        raise MemoryError(f"{name}: no scratch memory for {m} x {k}")
    return out if flat else out.view(*x.shape[:-1], n)


def _custom_op(name: str, op, doc: str):
    """``op`` as the custom op ``rlt_cpu::NAME(x, qweight, ...)``, with a fake implementation
    (``[..., N]`` bf16 from x and qweight ``[N, ...]``)."""
    op.__doc__ = doc
    return custom_op(
        f"rlt_cpu::{name}", lambda x, qweight, *_: x.new_empty(*x.shape[:-1], qweight.shape[0])
    )(op)


def _int8_operands(name: str, x: Tensor, qweight: Tensor, scale: Tensor) -> tuple[int, int]:
    _quant_operands(name, x, qweight, torch.int8, scale)
    n, k = qweight.shape
    if scale.shape != (n,) or x.shape[-1] != k:
        raise ValueError(
            f"{name}: x [..., {x.shape[-1]}], qweight {list(qweight.shape)} and "
            f"scale {list(scale.shape)} do not match (scale [N], x [..., K])"
        )
    return n, k


def _int8_op(name: str, doc: str):
    """A custom op ``rlt_cpu::NAME(x, qweight, scale)`` on hal.quant's int8 layout."""

    def op(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
        return _quant_linear(name, x, qweight, scale, *_int8_operands(name, x, qweight, scale))

    return _custom_op(name, op, doc)


def _int8_a8_op(name: str, doc: str):
    """``rlt_cpu::NAME(x, qweight, scale, full)``: ``_int8_op``'s, told whether the weight
    holds -128 (``full``: a slower form that is exact there)."""

    def op(x: Tensor, qweight: Tensor, scale: Tensor, full: bool) -> Tensor:
        n, k = _int8_operands(name, x, qweight, scale)
        return _quant_linear(name, x, qweight, scale, n, k, int(full))

    return _custom_op(name, op, doc)


def _grouped_operands(name, x, qweight, scale, group, bits) -> tuple[int, int]:
    """N and K of a grouped weight: int4 (uint8 [N, K / 2]) or int8g (int8 [N, K])."""
    _quant_operands(name, x, qweight, torch.uint8 if bits == 4 else torch.int8, scale)
    n, k = qweight.shape[0], qweight.shape[1] * 8 // bits
    if group not in GROUP_SIZES or k % group:
        raise ValueError(f"{name}: group {group} must be one of {GROUP_SIZES} and divide K {k}")
    if scale.shape != (n, k // group) or x.shape[-1] != k:
        raise ValueError(
            f"{name}: x [..., {x.shape[-1]}], qweight {list(qweight.shape)} and scale "
            f"{list(scale.shape)} do not match group {group} (qweight [N, K{' / 2' if bits == 4 else ''}], "
            "scale [N, K / group])"
        )
    return n, k


def _grouped_op(name: str, doc: str, bits: int):
    """A custom op ``rlt_cpu::NAME(x, qweight, scale, group)`` on hal.quant's int4 (bits 4)
    or int8g (bits 8) layout."""

    def op(x: Tensor, qweight: Tensor, scale: Tensor, group: int) -> Tensor:
        n, k = _grouped_operands(name, x, qweight, scale, group, bits)
        return _quant_linear(name, x, qweight, scale, n, k, group)

    return _custom_op(name, op, doc)


def _int8g_a8_op(name: str, doc: str):
    """``rlt_cpu::NAME(x, qweight, scale, group, full)``: W8A8 on the int8g layout."""

    def op(x: Tensor, qweight: Tensor, scale: Tensor, group: int, full: bool) -> Tensor:
        n, k = _grouped_operands(name, x, qweight, scale, group, 8)
        return _quant_linear(name, x, qweight, scale, n, k, group, int(full))

    return _custom_op(name, op, doc)


linear_int8_avx2 = _int8_op(
    "linear_int8_avx2",
    "``x @ (qweight * scale[:, None]).T``: x ``[..., K]`` bf16, qweight int8 ``[N, K]``, scale "
    "bf16 ``[N]`` (hal.quant's int8 layout); fp32 sums, AVX2 + FMA.",
)
linear_int4_avx2 = _grouped_op(
    "linear_int4_avx2",
    "``x @ dequant(qweight).T``: x ``[..., K]`` bf16, qweight uint8 ``[N, K / 2]`` and scale "
    "bf16 ``[N, K / group]`` in hal.quant's int4 layout; fp32 sums, AVX2 + FMA.",
    4,
)
linear_int8g_avx2 = _grouped_op(
    "linear_int8g_avx2",
    "``x @ dequant(qweight).T``: x ``[..., K]`` bf16, qweight int8 ``[N, K]`` and scale bf16 "
    "``[N, K / group]`` (hal.quant's int8g layout); fp32 sums, AVX2 + FMA.",
    8,
)
linear_int8_a8_avx2 = _int8_a8_op(
    "linear_int8_a8_avx2",
    "W8A8: ``linear_int8_avx2`` with x quantized per block of 32 "
    "(``hal.quant.quantize_activations``), int8 dot products; ``full``: qweight may hold -128.",
)
OCTET = 8  # rows the W4A8 kernel reads together
OCTET_LANES = tuple(range(OCTET))  # the rows' order its sums come out in: row i in lane i


def int4_octets(w: QuantizedWeight) -> tuple[Tensor, Tensor]:
    """``w`` repacked for ``linear_int4_a8_avx2``: the packed bytes ``[N8 / 8, K / 32, 4, 8, 4]``
    (each octet of rows, block by block of 32 inputs, in four groups: group v holds each row's
    bytes 4v..4v+3 in turn, so that a 256-bit load has row i in lane i; an octet is one stream
    a thread) and the scales ``[N8 / 8, K / group, 8]`` in ``OCTET_LANES`` order; N8 is N
    rounded up to 8 with rows of zeros (u = 8, scale 0)."""
    n, k, g = w.shape[0], w.in_features, w.group_size
    pad = -n % OCTET
    qweight = F.pad(w.qweight, (0, 0, 0, pad), value=0x88)
    scale = F.pad(w.scale, (0, 0, 0, pad))
    octets = (n + pad) // OCTET
    w8 = qweight.view(octets, OCTET, k // 32, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    s8 = scale.view(octets, OCTET, k // g)[:, list(OCTET_LANES)].transpose(1, 2).contiguous()
    return w8, s8


def _int4_a8(name: str, x: Tensor, w8: Tensor, s8: Tensor, n: int, group: int) -> Tensor:
    _quant_operands(name, x, w8, torch.uint8, s8)
    octets, blocks, *form = w8.shape
    k = blocks * 32
    if (
        form != [4, OCTET, 4]
        or group not in GROUP_SIZES
        or k % group
        or tuple(s8.shape) != (octets, k // group, OCTET)
        or x.shape[-1] != k
        or not 0 < n <= octets * OCTET < n + OCTET
    ):
        raise ValueError(
            f"{name}: x [..., {x.shape[-1]}], w8 {list(w8.shape)}, s8 {list(s8.shape)}, N {n} "
            f"and group {group} do not match int4_octets' layout"
        )
    return _quant_linear(name, x, w8, s8, n, k, group)


def _int4_a8_op(name: str):
    """``rlt_cpu::NAME(x, w8, s8, n, group)``: W4A8 on ``int4_octets``' layout."""

    def op(x: Tensor, w8: Tensor, s8: Tensor, n: int, group: int) -> Tensor:
        return _int4_a8(name, x, w8, s8, n, group)

    op.__doc__ = (
        "W4A8: ``linear_int4_avx2`` with x quantized per block of 32 "
        "(``hal.quant.quantize_activations``), int8 dot products, on ``int4_octets``' layout."
    )
    return custom_op(f"rlt_cpu::{name}", lambda x, w8, s8, n, group: x.new_empty(*x.shape[:-1], n))(
        op
    )


linear_int4_a8_avx2 = _int4_a8_op("linear_int4_a8_avx2")
TOKEN_MAX_K = 132103  # int32 sums of 127 * 128 products stay exact below this K
linear_int8_token_avx2 = _int8_a8_op(
    "linear_int8_token_avx2",
    "W8A8 dynamic: ``hal.quant.token_linear`` (x quantized per row with one scale, exact int32 "
    "sums, fp32 scales) on hal.quant's int8 layout; ``full``: qweight may hold -128.",
)
linear_int8g_a8_avx2 = _int8g_a8_op(
    "linear_int8g_a8_avx2",
    "W8A8: ``linear_int8g_avx2`` with x quantized per block of 32 "
    "(``hal.quant.quantize_activations``), int8 dot products; ``full``: qweight may hold -128.",
)


# The same four with AVX512-VNNI dot products (csrc/linear_a8_vnni.c): the same bits.
VNNI = {
    "int8": _int8_a8_op("linear_int8_a8_vnni", "``linear_int8_a8_avx2`` with vpdpbusd."),
    "int8-token": _int8_a8_op(
        "linear_int8_token_vnni", "``linear_int8_token_avx2`` with vpdpbusd."
    ),
    "int8g": _int8g_a8_op("linear_int8g_a8_vnni", "``linear_int8g_a8_avx2`` with vpdpbusd."),
    "int4": _int4_a8_op("linear_int4_a8_vnni"),
}


def vnni_available() -> None:
    """Raise KernelUnavailable unless this CPU has AVX512-VNNI (and AVX512-VL, -BW)."""
    _, lib = library()
    if not lib.rlt_has_avx512vnni():
        raise KernelUnavailable(
            "the vnni kernels need a CPU with avx512_vnni and avx512vl (grep avx512_vnni "
            "/proc/cpuinfo); the avx2 kernels compute the same bits"
        )


def int8_a8_vnni(x: Tensor, w: QuantizedWeight) -> Tensor:
    return VNNI["int8"](x, w.qweight, w.scale, _holds_min(w))


def int8_token_vnni(x: Tensor, w: QuantizedWeight) -> Tensor:
    if w.in_features > TOKEN_MAX_K:
        raise ValueError(f"int8-token-vnni sums in int32: K {w.in_features} > {TOKEN_MAX_K}")
    return VNNI["int8-token"](x, w.qweight, w.scale, _holds_min(w))


def int8g_a8_vnni(x: Tensor, w: QuantizedWeight) -> Tensor:
    return VNNI["int8g"](x, w.qweight, w.scale, w.group_size, _holds_min(w))


def int4_a8_vnni(x: Tensor, w: QuantizedWeight) -> Tensor:
    w8, s8 = w.form("int4-octets", int4_octets)
    return VNNI["int4"](x, w8, s8, w.shape[0], w.group_size)


def int8z_avx2(x: Tensor, w: QuantizedWeight) -> Tensor:
    """int8z: the weight dequantized for the call (``(q - z) * scale``, exact, bf16), then the
    bf16 ``linear_avx2`` (row- and column-invariant): correct and deterministic, not fast."""
    return linear_avx2(x, w.dequantize())


def int8_avx2(x: Tensor, w: QuantizedWeight) -> Tensor:
    return linear_int8_avx2(x, w.qweight, w.scale)


def int4_avx2(x: Tensor, w: QuantizedWeight) -> Tensor:
    return linear_int4_avx2(x, w.qweight, w.scale, w.group_size)


def int8g_avx2(x: Tensor, w: QuantizedWeight) -> Tensor:
    return linear_int8g_avx2(x, w.qweight, w.scale, w.group_size)


def _holds_min(w: QuantizedWeight) -> bool:
    """Whether an int8 weight holds -128 (the W8A8 kernel's slower, exact form then)."""
    return w.form("int8-holds-min", lambda w: bool((w.qweight == -128).any()))


def int8_a8_avx2(x: Tensor, w: QuantizedWeight) -> Tensor:
    return linear_int8_a8_avx2(x, w.qweight, w.scale, _holds_min(w))


def int8_token_avx2(x: Tensor, w: QuantizedWeight) -> Tensor:
    if w.in_features > TOKEN_MAX_K:
        raise ValueError(f"int8-token-avx2 sums in int32: K {w.in_features} > {TOKEN_MAX_K}")
    return linear_int8_token_avx2(x, w.qweight, w.scale, _holds_min(w))


def int8g_a8_avx2(x: Tensor, w: QuantizedWeight) -> Tensor:
    return linear_int8g_a8_avx2(x, w.qweight, w.scale, w.group_size, _holds_min(w))


def int4_a8_avx2(x: Tensor, w: QuantizedWeight) -> Tensor:
    w8, s8 = w.form("int4-octets", int4_octets)
    return linear_int4_a8_avx2(x, w8, s8, w.shape[0], w.group_size)


# -- Kernel.into: each C kernel's operands as its wrapper passes them (tensors, then ints) ---


def _plain(w: QuantizedWeight):
    return (w.qweight, w.scale), (w.shape[0], w.in_features)


def _full(w: QuantizedWeight):
    return (w.qweight, w.scale), (w.shape[0], w.in_features, int(_holds_min(w)))


def _token(w: QuantizedWeight):
    if w.in_features > TOKEN_MAX_K:
        raise ValueError(f"int8-token sums in int32: K {w.in_features} > {TOKEN_MAX_K}")
    return _full(w)


def _grouped(w: QuantizedWeight):
    return (w.qweight, w.scale), (w.shape[0], w.in_features, w.group_size)


def _grouped_full(w: QuantizedWeight):
    (q, s), ints = _grouped(w)
    return (q, s), (*ints, int(_holds_min(w)))


def _octets(w: QuantizedWeight):
    return w.form("int4-octets", int4_octets), (w.shape[0], w.in_features, w.group_size)


def _into(c_name: str, operands):
    def into(w: QuantizedWeight):
        tensors, ints = operands(w)
        return bound_linear(c_name, tensors, *ints)

    return into


def _own(
    name: str,
    fn,
    scheme: str,
    description: str,
    activations: str = "bf16",
    check=_loaded,
    into=None,
) -> Kernel:
    """One of the driver's own C kernels: row- and column-invariant by construction."""
    return Kernel(
        "linear", name, fn, row_invariant=True, column_invariant=True, scheme=scheme,
        activations=activations, check=check, version=VERSION, description=description,
        into=into,
    )  # fmt: skip


KERNELS = (
    _own(
        "int8-avx2",
        int8_avx2,
        "int8",
        "csrc/linear_quant_avx2.c: int8 widened in registers, fp32 FMA sums, scaled",
        into=_into("linear_int8_avx2", _plain),
    ),
    _own(
        "int8g-avx2",
        int8g_avx2,
        "int8g",
        "csrc/linear_quant_avx2.c: int8 dequantized per group in registers, fp32 FMA",
        into=_into("linear_int8g_avx2", _grouped),
    ),
    _own(
        "int4-avx2",
        int4_avx2,
        "int4",
        "csrc/linear_quant_avx2.c: int4 dequantized exactly in registers, fp32 FMA",
        into=_into("linear_int4_avx2", _grouped),
    ),
    _own(
        "int8-a8-avx2",
        int8_a8_avx2,
        "int8",
        "csrc/linear_a8_avx2.c: W8A8, x quantized per 32, int8 dot products",
        "int8",
        into=_into("linear_int8_a8_avx2", _full),
    ),
    _own(
        "int8-token-avx2",
        int8_token_avx2,
        "int8",
        "csrc/linear_a8_avx2.c: W8A8 dynamic, x quantized per token, exact int32 sums",
        "int8-token",
        into=_into("linear_int8_token_avx2", _token),
    ),
    _own(
        "int8g-a8-avx2",
        int8g_a8_avx2,
        "int8g",
        "csrc/linear_a8_avx2.c: W8A8 on int8 per group, x quantized per 32, int8 dot products",
        "int8",
        into=_into("linear_int8g_a8_avx2", _grouped_full),
    ),
    _own(
        "int4-a8-avx2",
        int4_a8_avx2,
        "int4",
        "csrc/linear_a8_avx2.c: W4A8 on rows repacked by eights, x quantized per 32, int8 dots",
        "int8",
        into=_into("linear_int4_a8_avx2", _octets),
    ),
    _own(
        "int8z-avx2",
        int8z_avx2,
        "int8z",
        "asymmetric int8 dequantized per call, then csrc/linear_avx2.c",
    ),
    *(
        _own(
            f"{name}-vnni",
            fn,
            scheme,
            f"csrc/linear_a8_vnni.c: {name}-avx2 with AVX512-VNNI "
            "dot products (vpdpbusd), the same bits",
            activations,
            vnni_available,
            _into(c_name, operands),
        )
        for name, fn, scheme, activations, c_name, operands in (
            ("int8-a8", int8_a8_vnni, "int8", "int8", "linear_int8_a8_vnni", _full),
            ("int8-token", int8_token_vnni, "int8", "int8-token", "linear_int8_token_vnni", _token),
            ("int8g-a8", int8g_a8_vnni, "int8g", "int8", "linear_int8g_a8_vnni", _grouped_full),
            ("int4-a8", int4_a8_vnni, "int4", "int8", "linear_int4_a8_vnni", _octets),
        )
    ),  # fmt: skip
    *TORCH_QUANT_KERNELS,
)
