"""CUDA device with ``torch.cuda.Event`` fences; ``cuda_eager`` (HF order) and ``cuda_sdpa``."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from drivers.cuda import quantized
from drivers.cuda.graphs import CudaStepGraphs
from hal.eager import EagerBackend, TensorKVStore, causal_mask, paged_attention, repeat_kv
from hal.interfaces import AttentionBackend, Device, Driver, EventFence, Fence
from hal.quant import REFERENCE_KERNELS
from hal.types import KVLayout


class CudaDevice(Device):
    device_type = "cuda"
    visible_devices_env_var = "CUDA_VISIBLE_DEVICES"

    def initialize(self) -> None:
        if self._initialized:
            return
        count = torch.cuda.device_count()
        if self.index >= count:
            raise RuntimeError(
                f"cuda:{self.index} requested but {count} CUDA device(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        torch.cuda.set_device(self.index)
        self._initialized = True

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def record_fence(self) -> Fence:
        return EventFence(torch.cuda.Event())

    def memory_stats(self) -> dict[str, int]:
        return {
            "allocated_bytes": torch.cuda.memory_allocated(self.index),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.index),
        }

    @property
    def pin_memory(self) -> bool:
        return True


class CudaEagerBackend(EagerBackend):
    name = "cuda_eager"


def sdpa_attention(q, k, v, scaling: float, context_len: int) -> torch.Tensor:
    """One request through ``scaled_dot_product_attention``; returns ``[1, S, H, d]``."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    q_len = q.shape[2]
    mask = causal_mask(q_len, context_len, q.dtype, q.device) if q_len > 1 else None
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return o.transpose(1, 2).contiguous()


class CudaSdpaBackend(AttentionBackend):
    """``scaled_dot_product_attention`` over gathered pages: fast, not bit-exact with HF."""

    name = "cuda_sdpa"
    hf_exact = False

    def forward(self, query, plane, kv, meta, scaling, deterministic=False):
        return paged_attention(query, plane, kv, meta, scaling, sdpa_attention, deterministic)


class CudaDriver(Driver):
    def create_kv_store(self, layout: KVLayout) -> TensorKVStore:
        self.device.initialize()
        return TensorKVStore(layout, self.device.torch_device)

    def step_graphs(self) -> CudaStepGraphs:
        self.device.initialize()
        return CudaStepGraphs(self.device.index)


def create(index: int | None = None) -> CudaDriver:
    backends = {"cuda_eager": CudaEagerBackend(), "cuda_sdpa": CudaSdpaBackend()}
    kernels = (*REFERENCE_KERNELS, *quantized.KERNELS)
    return CudaDriver("cuda", CudaDevice(index or 0), backends, "cuda_eager", kernels)
