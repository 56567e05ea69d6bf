"""The cuda driver's weight-only quantized linears: torch's own CUDA kernels.

- ``int8-torch``: ``torch._weight_int8pack_mm(x, w [N, K] int8, scale [N] bf16)``: the
  canonical int8 layout as it is (``hal.quant``).
- ``int4-torch``: ``torch._weight_int4pack_mm(x, packed, group, scales_and_zeros)`` (tinygemm,
  sm80+): the values re-packed once per weight by ``torch._convert_weight_to_int4pack`` from
  uint8 ``[N, K / 2]`` (even input in the high nibble, as torchao packs), and
  ``scales_and_zeros [K / group, N, 2]`` with zero 0: torch's convention is
  ``(u - 8) * scale + zero`` for ``u = q + 8``, which is ``hal.quant``'s ``q * scale``.

Each claims nothing (torch's kernels choose their own order) and each ``check`` runs the
kernel on the device against dequantize-then-matmul at each group size: a torch build or GPU
without it, or a packing convention that differs, makes the kernel unavailable with the
reason (the model's own shapes are the plan's trials' to meet). No GPU was lent where this was written: the conformance kit checks both on the
device (``benchmarks/cuda_check.sh`` runs it).
"""

from __future__ import annotations

import functools

import torch

from hal.kernels import Kernel, KernelUnavailable
from hal.quant import GROUP_SIZES, QuantizedWeight, quantize
from hal.reference import qlinear_f64

INNER_K_TILES = 8  # torchao's choice for tinygemm


def int8_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return torch._weight_int8pack_mm(rows, w.qweight, w.scale).view(*x.shape[:-1], -1)


def _int4_form(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    u = (w.integers().to(torch.int32) + 8).to(torch.uint8)  # [N, K]
    packed = torch._convert_weight_to_int4pack(u[:, ::2] << 4 | u[:, 1::2], INNER_K_TILES)
    scale = w.scale.t().contiguous()  # [K / group, N]
    scales_and_zeros = torch.stack((scale, torch.zeros_like(scale)), dim=2).contiguous()
    return packed, scales_and_zeros


def int4_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    packed, scales_and_zeros = w.form("cuda-int4pack", _int4_form)
    rows = x.reshape(-1, x.shape[-1])
    out = torch._weight_int4pack_mm(rows, packed, w.group_size, scales_and_zeros)
    return out.view(*x.shape[:-1], -1)


def _checked(fn, scheme: str):
    """A ``Kernel.check``: calls on the device at every group size of the scheme, each within
    the float64 bound of the reference, or KernelUnavailable saying what happened."""

    @functools.cache  # once per process: it runs a kernel on the device
    def check() -> None:
        if not torch.cuda.is_available():
            raise KernelUnavailable("no CUDA device")
        gen = torch.Generator().manual_seed(5)
        for group in (None,) if scheme == "int8" else GROUP_SIZES:
            w = quantize(torch.randn(256, 1024, generator=gen).bfloat16(), scheme, group)
            x = torch.randn(3, 1024, generator=gen).bfloat16()
            try:
                got = fn(x.cuda(), w.to("cuda")).double().cpu()
            except (RuntimeError, NotImplementedError) as exc:
                raise KernelUnavailable(f"torch's {scheme} kernel cannot run here: {exc}") from exc
            exact, bound = qlinear_f64(x, w)
            if ((got - exact).abs() > bound).any():
                raise KernelUnavailable(
                    f"torch's {scheme} kernel (group {group}) disagrees with dequantize-then-matmul"
                )

    return check


KERNELS = (
    Kernel(
        "linear",
        "int8-torch",
        int8_linear,
        scheme="int8",
        check=_checked(int8_linear, "int8"),
        description="torch._weight_int8pack_mm",
    ),
    Kernel(
        "linear",
        "int4-torch",
        int4_linear,
        scheme="int4",
        check=_checked(int4_linear, "int4"),
        description="torch._weight_int4pack_mm (tinygemm) on its own packing",
    ),
)
