"""Weight-only quantization: the schemes, their one canonical layout, and the reference.

A projection weight ``w [N, K]`` (bf16) becomes a :class:`QuantizedWeight`:

- ``int8``: symmetric, one scale per output channel. ``qweight`` int8 ``[N, K]`` (the whole
  range: rlt-hal's own quantization gives ``[-127, 127]``, ``bf16(amax / 127)``; checkpoints
  quantized elsewhere may hold -128), ``scale`` bf16 ``[N]``. Value ``q * scale``.
- ``int8g``: int8 with one scale per ``group_size`` (32, 64 or 128) inputs of a channel, as
  llm-compressor's W8A16 writes it: ``qweight`` int8 ``[N, K]``, ``scale`` bf16 ``[N, K //
  group_size]`` (``bf16(amax / 127)`` of each group). Value ``q * scale``.
- ``int4``: symmetric, one scale per ``group_size`` (32, 64 or 128) inputs of a channel, as
  llama.cpp's Q4_0: the group's largest-magnitude weight ``m`` maps to -8 (``scale =
  bf16(m / -8)``), ``q = clamp(round(w / scale), -8, 7)``. ``qweight`` uint8 ``[N, K // 2]``
  holds ``q + 8``: each 32 inputs of a row in 16 bytes, byte ``j`` holding input ``j`` in its
  low nibble and input ``j + 16`` in its high one (one 16-byte load gives 32 values in order).
  ``scale`` bf16 ``[N, K // group_size]``. Value ``q * scale``.
- ``int8z``: asymmetric int8, one scale and one integer zero point ``z`` per ``group_size``
  (32, 64 or 128) inputs of a channel, as msModelSlim's asymmetric W8A16 and compressed-tensors'
  asymmetric 8-bit weights hold them: ``qweight`` int8 ``[N, K + K // group_size]``, each row
  its ``q`` then its groups' ``z`` (so that a row slice carries its zero points), ``scale``
  bf16 ``[N, K // group_size]``. Value ``(q - z) * scale`` (``q - z`` in [-255, 255], exact
  in bf16: the value compressed-tensors decompresses, and ``npu_weight_quant_batchmatmul``'s
  ``(w + antiquant_offset) * antiquant_scale`` with ``antiquant_offset = -z``).

Every driver's quantized ``linear`` kernel (``hal.kernels.Kernel`` with ``scheme`` "int8" or
"int4") is called ``fn(x [..., K] bf16, w: QuantizedWeight) -> [..., N] bf16``. A kernel that
needs another layout (a device's packing) derives it once per weight with
:meth:`QuantizedWeight.form`.

The reference (:data:`REFERENCE_KERNELS`, named "int8-dequant" and "int4-dequant") is
``F.linear(x, w.dequantize())``: Hugging Face's arithmetic on the dequantized bf16 weights,
so a quantized model in HF-exact mode equals the HF reference run on
:func:`dequantized <QuantizedWeight.dequantize>` weights, bit for bit. A driver runs a
scheme when it offers a kernel for it (``Driver.quantization_schemes``); the cpu, cuda and npu
drivers offer the reference besides their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from hal.kernels import Kernel, _big_columns, adversarial_rows
from hal.quant_activations import (  # noqa: F401  (the activations' side, named here too)
    ACTIVATION_BLOCK,
    ACTIVATION_KINDS,
    STATIC_REFERENCE,
    TOKEN_CHUNK,
    TOKEN_REFERENCE,
    StaticInput,
    kernel_activations,
    quantize_activations,
    quantize_per_token,
    quantize_static,
    static_linear,
    token_linear,
    with_static_input,
)

SCHEMES = ("int8", "int8g", "int4", "int8z")
GROUPED = ("int8g", "int4", "int8z")  # one scale per group_size inputs
GROUP_SIZES = (32, 64, 128)
INT4_CHUNK = 32  # inputs per 16 packed bytes


def check_scheme(scheme: str, group_size: int | None = None) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if scheme in GROUPED and group_size not in GROUP_SIZES:
        raise ValueError(
            f"{scheme} quantization's group size must be one of {GROUP_SIZES}, got {group_size!r}"
        )


@attrs.frozen(eq=False)
class QuantizedWeight:
    """One projection's quantized weight ``[N, K]`` (see the module docstring's layout)."""

    scheme: str
    qweight: torch.Tensor
    scale: torch.Tensor
    group_size: int  # inputs per scale: K for int8
    in_features: int
    # W8A8 static (int8 only): how its input is quantized (None: any other arithmetic).
    static: StaticInput | None = attrs.field(default=None, kw_only=True)
    # Derived layouts some kernels use (a device's packing), made once per weight.
    forms: dict[str, Any] = attrs.field(factory=dict, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[0], self.in_features)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def nbytes(self) -> int:
        """Bytes a projection reads: the packed weight and its scales (and a static input's
        bias and scales)."""
        extra = 0 if self.static is None else self.static.nbytes
        return self.qweight.nbytes + self.scale.nbytes + extra

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tensors it is made of: the packed weight and its scales."""
        return self.qweight, self.scale

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output channels ``start:stop`` (views): a member of a stacked projection."""
        static = None if self.static is None else self.static.rows(start, stop)
        return attrs.evolve(
            self,
            qweight=self.qweight[start:stop],
            scale=self.scale[start:stop],
            forms={},
            static=static,
        )

    def form(self, key: str, make: Callable[[QuantizedWeight], Any]) -> Any:
        """``make(self)``, computed on first use and kept with the weight."""
        if key not in self.forms:
            self.forms[key] = make(self)
        return self.forms[key]

    def integers(self) -> torch.Tensor:
        """The quantized values ``q`` as int8 ``[N, K]`` (int8z: ``q - z``, int16)."""
        if self.scheme == "int8z":
            k, g = self.in_features, self.group_size
            z = self.zero_points().to(torch.int16).repeat_interleave(g, dim=1)
            return self.qweight[:, :k].to(torch.int16) - z
        if self.scheme != "int4":
            return self.qweight
        n = self.qweight.shape[0]
        packed = self.qweight.view(n, -1, INT4_CHUNK // 2)
        q = torch.stack((packed & 15, packed >> 4), dim=2)  # [N, K/32, 2, 16]
        return (q.view(n, self.in_features).to(torch.int8) - 8).to(torch.int8)

    def zero_points(self) -> torch.Tensor:
        """int8z: each group's zero point ``z``, int8 ``[N, K // group_size]`` (a view)."""
        if self.scheme != "int8z":
            raise ValueError(f"{self.scheme} weights have no zero points")
        return self.qweight[:, self.in_features :]

    def scales(self) -> torch.Tensor:
        """One fp32 scale per weight element ``[N, K]`` (a view where it can be)."""
        n, k, g = self.qweight.shape[0], self.in_features, self.group_size
        return self.scale.float().view(n, -1, 1).expand(n, k // g, g).reshape(n, k)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``q * scale`` (exact in fp32), rounded to ``dtype``: the reference's weight."""
        n, k, g = self.qweight.shape[0], self.in_features, self.group_size
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        q = self.integers().to(wide).view(n, k // g, g)
        return (q * self.scale.to(wide).view(n, -1, 1)).view(n, k).to(dtype)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same weight on ``device`` (derived forms are not carried)."""
        static = None if self.static is None else self.static.to(device)
        return attrs.evolve(
            self,
            qweight=self.qweight.to(device),
            scale=self.scale.to(device),
            forms={},
            static=static,
        )


def layout(scheme: str, n: int, k: int, group_size: int | None) -> tuple[tuple, tuple]:
    """The (shape, dtype) of a ``[N, K]`` weight's two parts in ``scheme``: its packed weight
    and its scales (the module docstring's layout)."""
    if scheme == "int8":
        return ((n, k), torch.int8), ((n,), torch.bfloat16)
    assert group_size is not None  # int8g, int4 and int8z have one
    packed = ((n, k // 2), torch.uint8) if scheme == "int4" else ((n, k), torch.int8)
    if scheme == "int8z":  # each row's zero points after its values
        packed = ((n, k + k // group_size), torch.int8)
    return packed, ((n, k // group_size), torch.bfloat16)


def quantize(w: torch.Tensor, scheme: str, group_size: int | None = None) -> QuantizedWeight:
    """``w [N, K]`` (bf16) in ``scheme``, on ``w``'s device, computed in fp32."""
    check_scheme(scheme, group_size)
    n, k = w.shape
    if scheme == "int8z":
        assert group_size is not None
        if k % group_size:
            raise ValueError(
                f"int8z with group size {group_size} needs the input width {k} to be a multiple"
            )
        wg = w.float().view(n, k // group_size, group_size)
        lo, hi = wg.amin(dim=2).clamp(max=0), wg.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / 255).bfloat16()
        up = torch.nextafter(scale, torch.full_like(scale, float("inf")))
        scale = torch.where(scale.float() * 255 < hi - lo, up, scale)  # the range covered
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        z = torch.round(-128 - lo / scale.float()).clamp_(-128, 127)
        q = (torch.round(wg / scale.float()[..., None]) + z[..., None]).clamp_(-128, 127)
        return from_integers(q.view(n, k), scale, "int8z", group_size, zero=z)
    if scheme != "int4":
        size = k if scheme == "int8" else group_size
        assert size is not None  # check_scheme: int8g has one
        if k % size:
            raise ValueError(
                f"int8g with group size {size} needs the input width {k} to be a multiple"
            )
        wg = w.float().view(n, k // size, size)
        scale = (wg.abs().amax(dim=2) / 127).bfloat16()
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(wg / scale.float()[..., None]).clamp_(-127, 127).view(n, k)
        return from_integers(q, scale if scheme == "int8g" else scale[:, 0], scheme, size)
    assert group_size is not None
    if k % group_size or k % INT4_CHUNK:
        raise ValueError(
            f"int4 with group size {group_size} needs the input width {k} to be a multiple of "
            f"{max(group_size, INT4_CHUNK)}"
        )
    g = w.float().view(n, k // group_size, group_size)
    at = g.abs().argmax(dim=2, keepdim=True)
    scale = (g.gather(2, at)[..., 0] / -8).bfloat16()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(g / scale.float()[..., None]).clamp_(-8, 7).view(n, k)
    return from_integers(q, scale, "int4", group_size)


def from_integers(
    q: torch.Tensor,
    scale: torch.Tensor,
    scheme: str,
    group_size: int | None = None,
    zero: torch.Tensor | None = None,
) -> QuantizedWeight:
    """A weight with the given values ``q`` (``[N, K]``, integers in the scheme's range:
    [-128, 127] or [-8, 7]) and scales (int8z: and zero points ``zero`` ``[N, K //
    group_size]`` in [-128, 127], zeros if None), packed in the canonical layout."""
    n, k = q.shape
    lo, hi = (-8, 7) if scheme == "int4" else (-128, 127)
    if q.numel() and not (lo <= int(q.min()) and int(q.max()) <= hi):
        raise ValueError(f"{scheme} values must lie in [{lo}, {hi}] (kernels rely on it)")
    if zero is not None and scheme != "int8z":
        raise ValueError(f"{scheme} weights take no zero points (int8z does)")
    if scheme == "int8":
        return QuantizedWeight("int8", q.to(torch.int8).contiguous(), scale.bfloat16(), k, k)
    check_scheme(scheme, group_size)
    assert group_size is not None  # check_scheme: grouped schemes have one
    if scale.shape != (n, k // group_size) or k % group_size:
        raise ValueError(
            f"{scheme} group {group_size}: scale {list(scale.shape)} does not fit weight [{n}, {k}]"
        )
    if scheme == "int8g":
        qs = q.to(torch.int8).contiguous()
        return QuantizedWeight("int8g", qs, scale.bfloat16().contiguous(), group_size, k)
    if scheme == "int8z":
        z = torch.zeros(n, k // group_size) if zero is None else zero
        if tuple(z.shape) != (n, k // group_size) or (
            z.numel() and not (int(z.min()) >= -128 and int(z.max()) <= 127)
        ):
            raise ValueError(
                f"int8z zero points must be [{n}, {k // group_size}] in [-128, 127], got "
                f"{list(z.shape)}"
            )
        qs = torch.cat((q.to(torch.int8), z.to(torch.int8)), dim=1).contiguous()
        return QuantizedWeight("int8z", qs, scale.bfloat16().contiguous(), group_size, k)
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(n, k // INT4_CHUNK, 2, INT4_CHUNK // 2)
    # byte j of each 16: input j in the low nibble, input j + 16 in the high one
    packed = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return QuantizedWeight("int4", packed, scale.bfloat16().contiguous(), group_size, k)


def scheme_of(w: Any) -> str:
    """ "bf16" for a plain tensor, else the quantized weight's scheme."""
    return w.scheme if isinstance(w, QuantizedWeight) else "bf16"


def describe(scheme: str | None, group_size: int | None) -> str:
    """How the plan and the banner name a scheme: "bf16", "int8", "int4 (group 32)"."""
    if scheme is None or scheme == "bf16":
        return "bf16"
    if scheme == "int8g":
        return f"int8 (group {group_size})"
    if scheme == "int8z":
        return f"int8 asymmetric (group {group_size})"
    return f"int4 (group {group_size})" if scheme == "int4" else scheme


def dequantized_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """The reference: ``F.linear`` on the dequantized weight, in ``x``'s dtype."""
    return F.linear(x, w.dequantize(x.dtype))


REFERENCE_KERNELS = tuple(
    Kernel(
        "linear",
        f"{scheme}-dequant",
        dequantized_linear,
        hf_exact=True,
        scheme=scheme,
        description="F.linear on the dequantized bf16 weight (HF's arithmetic on it)",
    )
    for scheme in SCHEMES
) + (
    Kernel(
        "linear",
        TOKEN_REFERENCE,
        token_linear,
        row_invariant=True,
        column_invariant=True,
        scheme="int8",
        activations="int8-token",
        description="W8A8 dynamic in torch: x per token, exact integer sums, fp32 scales",
    ),
    Kernel(
        "linear",
        STATIC_REFERENCE,
        static_linear,
        row_invariant=True,
        column_invariant=True,
        scheme="int8",
        activations="int8-static",
        description="W8A8 static in torch: x with the calibrated scale and offset, exact "
        "integer sums plus quant_bias, times deq_scale",
    ),
)


# -- checking a quantized kernel's claim of row invariance -----------------------------------


def adversarial_qweight(n: int, k: int, scheme: str, group_size: int | None, gen):
    """A quantized weight for :func:`adversarial_qrows`: small values (1..3 in magnitude,
    scale 1), except at ``hal.kernels``' big column pairs, where each row holds its scheme's
    largest value twice (127 or -8). With the rows' matching big inputs, the products there
    are +-2^24 and cancel exactly: any two summation orders give different bits."""
    mag = torch.randint(1, 4, (n, k), generator=gen)
    sign = torch.randint(0, 2, (n, k), generator=gen) * 2 - 1
    q = mag * sign
    big = -8 if scheme == "int4" else 127
    for a, b in _big_columns(k):
        q[:, a] = q[:, b] = big
    groups = k // group_size if scheme in GROUPED and group_size else 1
    scale = torch.ones(n, groups) if scheme in GROUPED else torch.ones(n)
    return from_integers(q, scale, scheme, group_size)


def adversarial_qrows(rows: int, k: int, scheme: str, gen) -> torch.Tensor:
    """``hal.kernels.adversarial_rows`` with the big inputs scaled so that their products
    with :func:`adversarial_qweight`'s big values are +-2^24 (exact in bf16 and fp32)."""
    x = adversarial_rows(rows, k, gen)  # big inputs +-2^12
    cols = torch.tensor(_big_columns(k), dtype=torch.int64).flatten()
    x[:, cols] *= 2.0**9 if scheme == "int4" else 2.0**5  # x 127: about 2^24; x -8: 2^24
    return x
