"""torch's own weight-only quantized kernels on the cpu, offered beside the driver's C kernels
(``drivers.cpu.quant_kernels``) so that the execution plan's trials measure them:
``torch._weight_int8pack_mm`` on hal.quant's int8 layout ("int8-torch") and
``torch._weight_int4pack_mm_for_cpu`` on its own packing, derived once per weight
("int4-torch"). Neither claims row invariance."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hal.kernels import Kernel, KernelUnavailable
from hal.quant import QuantizedWeight


def _torch_op_available(*names: str) -> None:
    missing = [n for n in names if not hasattr(torch, n)]
    if missing:
        raise KernelUnavailable(
            f"this torch ({torch.__version__}) has no {', '.join(missing)}: use the avx2 or "
            "dequant kernel"
        )


def _rows_2d(fn, x: Tensor, k: int) -> Tensor:
    y = fn(x.reshape(-1, k).contiguous())
    return y.view(*x.shape[:-1], y.shape[-1])


TORCH_INT8_K = 8  # torch's int8 kernel reads K in steps of 8: a tail gives wrong sums or a crash


def int8_torch(x: Tensor, w: QuantizedWeight) -> Tensor:
    """``torch._weight_int8pack_mm``: hal.quant's int8 layout is already its own (K padded
    with zeros to a multiple of 8, the weight's once)."""
    pad = -w.in_features % TORCH_INT8_K
    qweight = (
        w.form("torch-int8-padded", lambda w: F.pad(w.qweight, (0, pad))) if pad else w.qweight
    )

    def call(rows: Tensor) -> Tensor:
        return torch._weight_int8pack_mm(F.pad(rows, (0, pad)) if pad else rows, qweight, w.scale)

    return _rows_2d(call, x, w.in_features)


TORCH_INT4_N = 16  # torch's int4 packing takes N in multiples of 16


def torch_int4pack(w: QuantizedWeight) -> tuple[Tensor, Tensor]:
    """``w`` as ``torch._weight_int4pack_mm_for_cpu`` takes it: the packed ``u = q + 8``
    (int32 ``[N, K]`` handed to ``torch._convert_weight_to_int4pack_for_cpu``), and scales
    and zeros ``[K / group, N, 2]`` with zero 0 (torch dequantizes ``(u - 8) * scale +
    zero``). N is padded to a multiple of 16 with zero weights."""
    pad = -w.shape[0] % TORCH_INT4_N
    u = F.pad(w.integers().to(torch.int32) + 8, (0, 0, 0, pad), value=8)
    scale = F.pad(w.scale, (0, 0, 0, pad))
    packed = torch._convert_weight_to_int4pack_for_cpu(u.contiguous(), 1)
    scales_and_zeros = torch.stack((scale, torch.zeros_like(scale)), dim=-1)
    return packed, scales_and_zeros.transpose(0, 1).contiguous()


def int4_torch(x: Tensor, w: QuantizedWeight) -> Tensor:
    packed, scales_and_zeros = w.form("torch-int4pack", torch_int4pack)
    n, group = w.shape[0], w.group_size

    def call(rows: Tensor) -> Tensor:
        y = torch._weight_int4pack_mm_for_cpu(rows, packed, group, scales_and_zeros)
        return y if y.shape[-1] == n else y[:, :n].contiguous()

    return _rows_2d(call, x, w.in_features)


KERNELS = (
    Kernel(
        "linear",
        "int8-torch",
        int8_torch,
        scheme="int8",
        check=lambda: _torch_op_available("_weight_int8pack_mm"),
        description="torch._weight_int8pack_mm",
    ),
    Kernel(
        "linear",
        "int4-torch",
        int4_torch,
        scheme="int4",
        check=lambda: _torch_op_available(
            "_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"
        ),
        description="torch._weight_int4pack_mm_for_cpu on its own packing (made once a weight)",
    ),
)
