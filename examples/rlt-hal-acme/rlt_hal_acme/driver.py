"""The acme driver: host CPU, ``index_copy_`` KV writes, HF-order eager attention, and one
projection kernel of its own (fp32 accumulation), offered as a ``hal.Kernel`` value."""

from __future__ import annotations

import torch

from hal import CompletedFence, Device, Driver, Kernel
from hal.eager import EagerBackend, TensorKVStore
from hal.quant import REFERENCE_KERNELS


def fp32_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in fp32, rounded to bf16 once. It claims nothing the kit would have to
    refute: not HF's bits, and no invariance (an fp32 GEMM's path depends on the row count)."""
    return torch.nn.functional.linear(x.float(), w.float()).to(x.dtype)


class AcmeDevice(Device):
    device_type = "cpu"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        return None

    def record_fence(self):
        return CompletedFence()


class AcmeKVStore(TensorKVStore):
    def _write_rows(self, cache, slots, rows):
        cache.index_copy_(0, slots, rows)


class AcmeEagerBackend(EagerBackend):
    name = "acme_eager"


class AcmeDriver(Driver):
    def create_kv_store(self, layout):
        return AcmeKVStore(layout, self.device.torch_device)


def create(index: int | None = None) -> AcmeDriver:
    if index not in (None, 0):
        raise ValueError(f"acme has one device, index 0; got acme:{index}")
    kernels = [Kernel("linear", "fp32", fp32_linear, description="F.linear in fp32")]
    kernels += REFERENCE_KERNELS  # runs --quantization int8 and int4 (dequantize, F.linear)
    backends = {"acme_eager": AcmeEagerBackend()}
    return AcmeDriver("acme", AcmeDevice(), backends, "acme_eager", kernels)
