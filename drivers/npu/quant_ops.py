"""EMULATED torch_npu quantized matmuls: CPU test doubles for the Ascend ops the npu driver's
W8A16, W4A16 and W8A8 dynamic linears call (``drivers.npu.quantized``).

- ``npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None,
  quant_scale=None, quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0)``:
  ``x [M, K] @ antiquant(weight [K, N])``, where ``antiquant(w) = (w + antiquant_offset) *
  antiquant_scale`` per tensor (scale ``(1,)``/``(1, 1)``), per output channel (``(N,)``/
  ``(1, N)``) or per group of ``antiquant_group_size`` inputs (``(ceil(K / g), N)``).
  ``weight`` is int8, or int32 carrying int4 (``[K, N / 8]`` as packed by
  ``npu_convert_weight_to_int4pack``; or the transpose of a packed ``[N, K / 8]``).
- ``npu_convert_weight_to_int4pack(weight, inner_k_tiles=0)``: int32 ``(r, c)`` with values in
  ``[-8, 7]`` -> int32 ``(r, c / 8)``, eight int4 per int32.

Signatures, argument rules and output shapes are written from torch_npu 2.13.0's
documentation (``torch_npu/_op_plugin_docs.py``) and its meta registration of
``npu_weight_quant_batchmatmul`` (``op_plugin/meta/_meta_registrations.py``: ``M`` is
``x.size(0)``; an int32 weight that is contiguous has ``N = weight.size(1) * 8``, otherwise
``N = weight.size(1)``; the output has ``x``'s dtype without ``quant_scale``). The antiquant
convention, ``(weight + antiquant_offset) * antiquant_scale`` (an additive offset), is the one
torch_npu's own tests of the op compare against.

What is this emulation's own model, not a documented or measured fact (nothing here is a
hardware result):

- the arithmetic: the antiquant in fp32, rounded once to ``x``'s dtype (the dtype the matrix
  unit takes), then the product summed in fp32 (plus ``bias``) and rounded once to ``x``'s
  dtype. ``inner_precise`` 1 (the documented high-performance mode) computes the same.
- the order of the eight int4 inside an int32: the docs say only that they are interleaved
  ("交叠排放"). The emulation interleaves them (:data:`NIBBLE_ORDER`), so that only its own
  ``npu_weight_quant_batchmatmul`` reads what its ``npu_convert_weight_to_int4pack`` wrote, as
  on the device: a caller that packs int4 itself is caught.

- ``npu_dynamic_quant(x)``: per-token symmetric int8, documented as "scale = rowMax(abs(x)) /
  DTYPE_MAX, y = round(x / scale)" (fp32 scale per row); emulated as CANN's DynamicQuant
  kernel computes it (``y = rint(x * (127 / rowmax))``, ``scale = 1 / (127 / rowmax)``; a
  newer kernel writes ``rowmax * (1 / 127)``, at most one fp32 ulp apart).
- ``npu_quantize(input, scales, zero_points, dtype, axis, div_mode)``: with ``div_mode``
  False, documented as ``input * scales + zero_points`` to ``dtype``; emulated for int8
  (``torch.qint8``) as fp32 steps, rounded half to even, saturated (the emulation's model).
- ``npu_quant_matmul(x1, x2, scale, *, pertoken_scale, bias, output_dtype)``: int8 ``x1 [m,
  k] @ x2 [k, n]``, ``scale`` float32/bfloat16 ``(1,)`` or ``(n,)``, ``pertoken_scale`` float32
  ``(m,)``, int32 ``bias``. The docs give no formula; the emulation's: exact integer sums,
  then ``(fp32(acc + bias) * scale[n]) * pertoken_scale[m]`` in fp32, rounded once.

Only the weight-only forms of npu_weight_quant_batchmatmul (W8A16, W4A16: no ``quant_scale``)
with float scales, and npu_quant_matmul's 2-D int8 form with float output, are emulated;
anything else raises ``NotImplementedError`` naming it. A documented rule broken raises
``RuntimeError`` ("... (torch_npu's documented rule)"), as the real op refuses it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from drivers.npu.fused_ops import refuse

WQBMM = "npu_weight_quant_batchmatmul"
PACK = "npu_convert_weight_to_int4pack"
MAX_DIM = 65535  # K and N are in [1, 65535]
INT4_PER_INT32 = 8
# Nibble s of a packed int32 (bits 4s..4s+3) holds element NIBBLE_ORDER[s] of its eight: the
# emulation's interleaving (the real order is not documented; nothing outside the op pair may
# depend on it).
NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# -- npu_convert_weight_to_int4pack ----------------------------------------------------------


def _check_pack(weight: Tensor) -> None:
    if weight.dtype != torch.int32:
        refuse(PACK, f"weight must be int32, got {weight.dtype}")
    if weight.dim() != 2:
        refuse(PACK, f"weight must be 2-D, (k, n) or (n, k), got {list(weight.shape)}")
    if not weight.is_contiguous():
        refuse(PACK, "weight must be contiguous")
    if weight.numel() == 0 or weight.shape[-1] % INT4_PER_INT32:
        refuse(PACK, f"the last dimension must be a non-zero multiple of 8, got {weight.shape[-1]}")
    if int(weight.min()) < -8 or int(weight.max()) > 7:
        refuse(PACK, "values must be in int4's range [-8, 7]")


def pack_int4(values: Tensor) -> Tensor:
    """int ``(r, c)`` in ``[-8, 7]`` -> int32 ``(r, c / 8)`` in the emulation's nibble order."""
    r, c = values.shape
    nibbles = (values.to(torch.int64) & 0xF).view(r, c // INT4_PER_INT32, INT4_PER_INT32)
    word = torch.zeros(r, c // INT4_PER_INT32, dtype=torch.int64)
    for slot, element in enumerate(NIBBLE_ORDER):
        word |= nibbles[..., element] << (4 * slot)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int4(packed: Tensor) -> Tensor:
    """int32 ``(r, c / 8)`` -> int8 ``(r, c)``: :func:`pack_int4` undone."""
    r, words = packed.shape
    word = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(r, words, INT4_PER_INT32, dtype=torch.int64)
    for slot, element in enumerate(NIBBLE_ORDER):
        out[..., element] = (word >> (4 * slot)) & 0xF
    return torch.where(out >= 8, out - 16, out).to(torch.int8).view(r, words * INT4_PER_INT32)


@torch.library.custom_op("rlt_npu_emulated::npu_convert_weight_to_int4pack", mutates_args=())
def _convert_weight_to_int4pack(weight: Tensor, inner_k_tiles: int) -> Tensor:
    with torch._C.DisableTorchFunction():  # the range check reads values; the real op never does
        _check_pack(weight)
    return pack_int4(weight)


@_convert_weight_to_int4pack.register_fake
def _(weight, inner_k_tiles):
    return weight.new_empty(weight.shape[0], weight.shape[1] // INT4_PER_INT32)


def npu_convert_weight_to_int4pack(weight: Tensor, inner_k_tiles: int = 0) -> Tensor:
    """``torch_npu.npu_convert_weight_to_int4pack(weight, inner_k_tiles=0)``: int32
    ``(r, c)`` in ``[-8, 7]`` -> int32 ``(r, c / 8)`` (``inner_k_tiles`` is reserved, unused)."""
    return _convert_weight_to_int4pack(weight, inner_k_tiles)


# -- npu_weight_quant_batchmatmul ------------------------------------------------------------


def weight_dims(weight: Tensor) -> tuple[int, int]:
    """``(K, N)`` of a weight as the op reads it (the meta function's rule for ``N``)."""
    if weight.dtype == torch.int32 and weight.is_contiguous():
        return weight.shape[0], weight.shape[1] * INT4_PER_INT32
    if weight.dtype == torch.int32:  # the transpose of a packed (N, K / 8)
        return weight.shape[0] * INT4_PER_INT32, weight.shape[1]
    return weight.shape[0], weight.shape[1]


def _mode(scale: Tensor, k: int, n: int, group: int) -> str:
    """ "tensor", "channel" or "group", from the scale's shape (the documented ones only)."""
    shape = tuple(scale.shape)
    if shape in ((1,), (1, 1)):
        return "tensor"
    if shape in ((n,), (1, n)):
        return "channel"  # antiquant_group_size has no effect outside per-group (the docs)
    if group and scale.dim() == 2 and shape[1] == n:
        if group % 32 or not 32 <= group <= k - 1:
            refuse(WQBMM, f"antiquant_group_size must be a multiple of 32 in [32, K-1 = {k - 1}], "
                          f"got {group}")  # fmt: skip
        if shape[0] != -(-k // group):
            refuse(WQBMM, f"a per-group antiquant_scale must be (ceil(K / antiquant_group_size), "
                          f"N) = ({-(-k // group)}, {n}), got {list(shape)}")  # fmt: skip
        return "group"
    refuse(WQBMM, f"antiquant_scale must be (1,) or (1, 1) per tensor, ({n},) or (1, {n}) per "
                  f"channel, or (ceil(K / g), {n}) with antiquant_group_size g, got "
                  f"{list(shape)}")  # fmt: skip
    raise AssertionError  # refuse raises


def _check_wqbmm(x, weight, scale, offset, bias, group, inner_precise) -> str:
    """The documented rules (Atlas A2/A3, ND weight); returns the quantization mode."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        refuse(WQBMM, f"x must be float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2:
        refuse(WQBMM, f"x must be 2-D (M, K), got {list(x.shape)}")
    if weight.dtype not in (torch.int8, torch.int32):
        refuse(WQBMM, f"weight must be int8, or int32 carrying int4, got {weight.dtype}")
    if weight.dim() != 2:
        refuse(WQBMM, f"weight must be 2-D (K, N), got {list(weight.shape)}")
    if weight.dtype == torch.int32 and not (weight.is_contiguous() or weight.t().is_contiguous()):
        refuse(WQBMM, "an int32 (int4) weight must be a packed (K, N/8) or the transpose of a "
                      "packed (N, K/8)")  # fmt: skip
    if x.numel() == 0 or weight.numel() == 0:
        refuse(WQBMM, "empty tensors are not supported")
    k, n = weight_dims(weight)
    if x.shape[1] != k:
        refuse(WQBMM, f"x (M, K) = {list(x.shape)} and weight (K, N) = ({k}, {n}) disagree on K")
    if not (1 <= k <= MAX_DIM and 1 <= n <= MAX_DIM):
        refuse(WQBMM, f"K and N must be in [1, {MAX_DIM}], got K={k}, N={n}")
    if scale.dtype == torch.int64:
        raise NotImplementedError(
            f"{WQBMM}: an int64 antiquant_scale (npu_trans_quant_param) is not emulated"
        )
    if scale.dtype != x.dtype:
        refuse(WQBMM, f"antiquant_scale must have x's dtype {x.dtype}, got {scale.dtype}")
    if group < 0:
        refuse(WQBMM, f"antiquant_group_size must be 0 or a multiple of 32, got {group}")
    mode = _mode(scale, k, n, group)
    if offset is not None:
        if offset.shape != scale.shape:
            refuse(WQBMM, f"antiquant_offset {list(offset.shape)} must have antiquant_scale's "
                          f"shape {list(scale.shape)}")  # fmt: skip
        if offset.dtype != scale.dtype:
            refuse(WQBMM, f"antiquant_offset must have antiquant_scale's dtype {scale.dtype} "
                          f"(int32 only with an int64 scale), got {offset.dtype}")  # fmt: skip
    if bias is not None:
        want = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        if bias.dtype != want:
            refuse(WQBMM, f"bias must be {want} with {x.dtype} x, got {bias.dtype}")
        if tuple(bias.shape) not in ((n,), (1, n)) or not bias.is_contiguous():
            refuse(WQBMM, f"bias must be a contiguous ({n},) or (1, {n}), got {list(bias.shape)}")
    if inner_precise not in (0, 1):
        refuse(WQBMM, f"inner_precise must be 0 (high precision) or 1, got {inner_precise}")
    return mode


def _per_element(t: Tensor, mode: str, k: int, n: int, group: int) -> Tensor:
    """A scale or offset as fp32 ``[K, N]`` (broadcast where it can be)."""
    t = t.float()
    if mode == "tensor":
        return t.reshape(1, 1).expand(k, n)
    if mode == "channel":
        return t.reshape(1, n).expand(k, n)
    return t.repeat_interleave(group, dim=0)[:k]  # group j covers inputs j*g .. j*g + g - 1


def antiquant(weight: Tensor, scale: Tensor, offset: Tensor | None, group: int, mode: str):
    """``(weight + offset) * scale`` as fp32 ``[K, N]`` (weight's int4 unpacked)."""
    k, n = weight_dims(weight)
    if weight.dtype == torch.int8:
        values = weight
    elif weight.is_contiguous():
        values = unpack_int4(weight)
    else:
        values = unpack_int4(weight.t()).t()
    w = values.float()
    if offset is not None:
        w = w + _per_element(offset, mode, k, n, group)
    return w * _per_element(scale, mode, k, n, group)


@torch.library.custom_op("rlt_npu_emulated::npu_weight_quant_batchmatmul", mutates_args=())
def _weight_quant_batchmatmul(
    x: Tensor,
    weight: Tensor,
    antiquant_scale: Tensor,
    antiquant_offset: Tensor | None,
    bias: Tensor | None,
    antiquant_group_size: int,
    inner_precise: int,
) -> Tensor:
    mode = _check_wqbmm(x, weight, antiquant_scale, antiquant_offset, bias,
                        antiquant_group_size, inner_precise)  # fmt: skip
    w = antiquant(weight, antiquant_scale, antiquant_offset, antiquant_group_size, mode)
    out = x.float() @ w.to(x.dtype).float()  # the matrix unit takes x's dtype, sums in fp32
    if bias is not None:
        out = out + bias.float().reshape(1, -1)
    return out.to(x.dtype)


@_weight_quant_batchmatmul.register_fake
def _(x, weight, antiquant_scale, antiquant_offset, bias, antiquant_group_size, inner_precise):
    return x.new_empty(x.shape[0], weight_dims(weight)[1])


def npu_weight_quant_batchmatmul(
    x: Tensor, weight: Tensor, antiquant_scale: Tensor, antiquant_offset: Tensor | None = None,
    quant_scale: Tensor | None = None, quant_offset: Tensor | None = None,
    bias: Tensor | None = None, antiquant_group_size: int = 0, inner_precise: int = 0,
) -> Tensor:  # fmt: skip
    """``torch_npu.npu_weight_quant_batchmatmul``: ``x [M, K] @ ((weight + antiquant_offset) *
    antiquant_scale)`` (+ ``bias``) in ``x``'s dtype, ``[M, N]``; W8A16 and W4A16 forms only."""
    if quant_offset is not None and quant_scale is None:
        refuse(WQBMM, "quant_offset cannot be given without quant_scale")
    if quant_scale is not None:
        raise NotImplementedError(
            f"{WQBMM}: only the weight-only forms (W8A16, W4A16: no quant_scale or "
            "quant_offset, the output in x's dtype) are emulated"
        )
    return _weight_quant_batchmatmul(
        x, weight, antiquant_scale, antiquant_offset, bias, antiquant_group_size, inner_precise
    )


# -- W8A8 dynamic: npu_dynamic_quant, then npu_quant_matmul ----------------------------------

DYNQ = "npu_dynamic_quant"
QMM = "npu_quant_matmul"


@torch.library.custom_op("rlt_npu_emulated::npu_dynamic_quant", mutates_args=())
def _dynamic_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    if x.dtype not in (torch.float16, torch.bfloat16):
        refuse(DYNQ, f"x must be float16 or bfloat16, got {x.dtype}")
    if x.dim() < 2:
        refuse(DYNQ, f"x must have more than one dimension, got {list(x.shape)}")
    # Documented: scale = rowMax(abs(x)) / DTYPE_MAX, y = round(x / scale). Computed (CANN's
    # DynamicQuant kernel, A2/A3): m = rowmax(|x|) in fp32, q = 127 / m, y = rint(x * q) (half
    # to even), scale = 1 / q. A row of zeros is undocumented; the emulation gives y = 0 and
    # scale 1 (the op's test golden's choice).
    xf = x.float()
    m = xf.abs().amax(dim=-1)
    q = torch.full_like(m, 127.0) / torch.where(m == 0, torch.full_like(m, 127.0), m)  # fp32 Div
    y = torch.round(xf * q[..., None]).clamp_(-128, 127).to(torch.int8)
    return y, torch.ones_like(q) / q


@_dynamic_quant.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


def npu_dynamic_quant(
    x: Tensor, *, smooth_scales: Tensor | None = None, group_index: Tensor | None = None,
    dst_type: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``torch_npu.npu_dynamic_quant``: per-token symmetric int8 (``y`` int8 with ``x``'s
    shape, ``scale`` fp32 with ``x``'s shape less the last dimension); no smooth_scales."""
    if smooth_scales is not None or group_index is not None:
        raise NotImplementedError(f"{DYNQ}: smooth_scales and group_index are not emulated")
    if dst_type not in (None, torch.int8):
        raise NotImplementedError(f"{DYNQ}: only int8 output is emulated, got {dst_type}")
    return _dynamic_quant(x)


def _check_qmm(x1, x2, scale, pertoken_scale, bias, output_dtype) -> None:
    """The documented rules of the int8 x int8 form with per-token scales (Atlas A2/A3)."""
    if x1.dtype != torch.int8 or x2.dtype != torch.int8:
        refuse(QMM, f"x1 and x2 must both be int8 here, got {x1.dtype} and {x2.dtype}")
    if x1.dim() != 2 or x2.dim() != 2:
        refuse(QMM, f"x1 (m, k) and x2 (k, n) must be 2-D here, got {list(x1.shape)} and "
                    f"{list(x2.shape)}")  # fmt: skip
    if x1.numel() == 0 or x2.numel() == 0 or scale.numel() == 0:
        refuse(QMM, "x1, x2 and scale cannot be empty")
    (m, k), (k2, n) = x1.shape, x2.shape
    if k != k2:
        refuse(QMM, f"x1 (m, k) = {list(x1.shape)} and x2 (k, n) = {list(x2.shape)} disagree "
                    "on k")  # fmt: skip
    if k > MAX_DIM or n > MAX_DIM:
        refuse(QMM, f"the last dimensions of x1 and x2 must not exceed {MAX_DIM}")
    if scale.dtype not in (torch.float32, torch.bfloat16) or tuple(scale.shape) not in ((1,), (n,)):
        refuse(QMM, f"scale must be float32 or bfloat16 (1,) or ({n},) here, got {scale.dtype} "
                    f"{list(scale.shape)}")  # fmt: skip
    if pertoken_scale is not None and (
        pertoken_scale.dtype != torch.float32 or tuple(pertoken_scale.shape) != (m,)
    ):
        refuse(QMM, f"pertoken_scale must be float32 ({m},), got {pertoken_scale.dtype} "
                    f"{list(pertoken_scale.shape)}")  # fmt: skip
    if bias is not None and (bias.dtype != torch.int32 or tuple(bias.shape) not in ((n,), (1, n))):
        refuse(QMM, f"bias must be int32 ({n},) or (1, {n}) here, got {bias.dtype} "
                    f"{list(bias.shape)}")  # fmt: skip
    if output_dtype not in (torch.bfloat16, torch.float16):
        raise NotImplementedError(f"{QMM}: only float16 / bfloat16 output is emulated")
    if (
        pertoken_scale is not None
        and output_dtype == torch.float16
        and scale.dtype != torch.float32
    ):
        refuse(QMM, "with pertoken_scale and float16 output, scale must be float32")


@torch.library.custom_op("rlt_npu_emulated::npu_quant_matmul", mutates_args=())
def _quant_matmul(
    x1: Tensor, x2: Tensor, scale: Tensor, pertoken_scale: Tensor | None, bias: Tensor | None,
    output_dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    _check_qmm(x1, x2, scale, pertoken_scale, bias, output_dtype)
    # The emulation's own model (the docs give no formula): the integer sums exact, then in
    # fp32 (float(acc + bias) * scale[n]) * pertoken_scale[m], rounded once to output_dtype.
    acc = x1.double() @ x2.double()
    if bias is not None:
        acc = acc + bias.double().reshape(1, -1)
    y = acc.float() * scale.float().reshape(1, -1)
    if pertoken_scale is not None:
        y = y * pertoken_scale.reshape(-1, 1)
    return y.to(output_dtype)


@_quant_matmul.register_fake
def _(x1, x2, scale, pertoken_scale, bias, output_dtype):
    return x1.new_empty(x1.shape[0], x2.shape[1], dtype=output_dtype)


def npu_quant_matmul(
    x1: Tensor, x2: Tensor, scale: Tensor, *, offset: Tensor | None = None,
    pertoken_scale: Tensor | None = None, bias: Tensor | None = None,
    output_dtype: torch.dtype | None = None,
) -> Tensor:  # fmt: skip
    """``torch_npu.npu_quant_matmul``: int8 ``x1 [m, k] @ x2 [k, n]`` dequantized by ``scale``
    (per tensor or channel) and ``pertoken_scale`` (``[m]``), to float16 / bfloat16."""
    if offset is not None:
        raise NotImplementedError(f"{QMM}: offset (int8 output) is not emulated")
    return _quant_matmul(x1, x2, scale, pertoken_scale, bias, output_dtype)


# -- npu_quantize ----------------------------------------------------------------------------

QUANTIZE = "npu_quantize"


def _check_quantize(x, scales, zero_points, dtype, axis, div_mode) -> None:
    """The documented rules of the form vllm-ascend's W8A8 static calls (div_mode False, int8
    output, A2/A3): scales (and zero_points, "of scales' shape and dtype") 1-D of the last
    axis' size or 1, in float, float16 or bfloat16."""
    if div_mode or dtype != torch.qint8:
        raise NotImplementedError(
            f"{QUANTIZE}: only div_mode=False with dtype torch.qint8 is emulated"
        )
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        refuse(QUANTIZE, f"input must be float, float16 or bfloat16, got {x.dtype}")
    if axis < -2 or axis >= x.dim():
        refuse(QUANTIZE, f"axis must be in [-2, {x.dim() - 1}], got {axis}")
    if axis == -2:
        raise NotImplementedError(f"{QUANTIZE}: axis -2 is not emulated")
    last = x.shape[-1]
    if scales.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        refuse(QUANTIZE, f"scales must be float, float16 or bfloat16, got {scales.dtype}")
    if scales.dim() != 1 or scales.shape[0] not in (1, last):
        refuse(QUANTIZE, f"scales must be 1-D of size {last} or 1 here, got {list(scales.shape)}")
    if zero_points is not None and (
        zero_points.shape != scales.shape or zero_points.dtype != scales.dtype
    ):
        refuse(QUANTIZE, "zero_points must have scales' shape and dtype with div_mode=False")


@torch.library.custom_op("rlt_npu_emulated::npu_quantize", mutates_args=())
def _quantize(
    x: Tensor, scales: Tensor, zero_points: Tensor | None, dtype: torch.dtype, axis: int,
    div_mode: bool,
) -> Tensor:  # fmt: skip
    _check_quantize(x, scales, zero_points, dtype, axis, div_mode)
    # The emulation's own model (the docs give "input * scales + zero_points" only): each step
    # in fp32, rounded half to even, saturated to int8.
    y = x.float() * scales.float()
    if zero_points is not None:
        y = y + zero_points.float()
    return torch.round(y).clamp_(-128, 127).to(torch.int8)


@_quantize.register_fake
def _(x, scales, zero_points, dtype, axis, div_mode):
    return x.new_empty(x.shape, dtype=torch.int8)


def npu_quantize(
    input: Tensor, scales: Tensor, zero_points: Tensor | None, dtype, axis: int = 1,
    div_mode: bool = True,
) -> Tensor:  # fmt: skip
    """``torch_npu.npu_quantize``: ``input * scales + zero_points`` (div_mode False) to int8,
    the form vllm-ascend's W8A8 static linear calls (``torch.qint8``, axis -1)."""
    return _quantize(input, scales, zero_points, dtype, axis, div_mode)


OPS = {
    WQBMM: npu_weight_quant_batchmatmul,
    QUANTIZE: npu_quantize,
    PACK: npu_convert_weight_to_int4pack,
    DYNQ: npu_dynamic_quant,
    QMM: npu_quant_matmul,
}
