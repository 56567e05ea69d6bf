"""The CPU device: synchronous, so every fence is complete when recorded."""

from __future__ import annotations

import logging
import mmap
import resource
import sys

import attrs
import torch

from drivers.cpu import kernels, quant_kernels
from hal.eager import EagerBackend, TensorKVStore
from hal.interfaces import CompletedFence, Device, Driver, Fence
from hal.kernels import KernelUnavailable
from hal.quant import REFERENCE_KERNELS
from hal.types import AttentionMetadata, KVLayout

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20


class CpuDevice(Device):
    device_type = "cpu"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        return None

    def record_fence(self) -> Fence:
        return CompletedFence()

    def memory_stats(self) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss is KiB on Linux, bytes on macOS.
        return {"peak_rss_bytes": peak if sys.platform == "darwin" else peak * 1024}

    def alloc_weights(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Anonymous memory aligned to 2 MiB and advised for transparent huge pages (where
        the OS offers them): a decode step streams every weight once per loop, and huge
        pages spare the TLB. Measured on ouro-1.4b-shape against the loader's file-backed
        tensors: docs/benchmarks.md."""
        nbytes = numel * dtype.itemsize
        buf = mmap.mmap(-1, nbytes + HUGE_PAGE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            buf.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, so faults map huge pages
        base = torch.frombuffer(buf, dtype=torch.uint8, count=HUGE_PAGE)  # to learn the address
        offset = -base.data_ptr() % HUGE_PAGE
        return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset)


def _kernels_load(otherwise: str) -> bool:
    """Whether the C kernels load here; if not, logs ``otherwise`` (what runs instead) and why.
    (Asked once by each user: ``kernels.library`` retries a failed build at every call.)"""
    try:
        kernels.library()
    except KernelUnavailable as exc:
        logger.warning("%s: %s", otherwise, exc)
        return False
    return True


@attrs.frozen
class RowContexts:
    """Where each query row of a step reads its keys: ``slots[off[r] : off[r] + len[r]]``."""

    slots: torch.Tensor  # int64, every request's kv_slots back to back
    off: torch.Tensor  # int64 [rows]
    len: torch.Tensor  # int64 [rows]: context_len + i + 1 for the request's i-th row

    @classmethod
    def of(cls, meta: AttentionMetadata) -> RowContexts:
        off, lens = [0] * meta.num_tokens, [0] * meta.num_tokens
        base, parts = 0, []
        for r in range(meta.num_requests):
            start, q_len, ctx = meta.request(r)
            for i in range(q_len):
                off[start + i], lens[start + i] = base, ctx + i + 1
            base += ctx + q_len
            parts.append(meta.request_slots(r))
        slots = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        return cls(slots.contiguous(), torch.tensor(off), torch.tensor(lens))


class CpuEagerBackend(EagerBackend):
    """HF eager order; in deterministic mode, the driver's fp32 kernel over the paged cache
    (``kernels.paged_attention``), or the shared torch form where it cannot be built."""

    name = "cpu_eager"
    # Measured: the mode costs nothing here, or is faster (docs/benchmarks.md).
    deterministic_by_default = True
    # Its C kernel reads each row's context in place; the torch form gathers and pads it.
    deterministic_is_fastest = True
    # No graph form: the cpu offers no step graphs, and its deterministic kernel reads each
    # row's exact context (it takes no padded bucket).
    step_graphs = False

    def __init__(self) -> None:
        self._kernel: bool | None = None  # decided at the first deterministic step
        self._rows: tuple[AttentionMetadata, RowContexts] | None = None

    def _use_kernel(self) -> bool:
        if self._kernel is None:
            self._kernel = _kernels_load("deterministic attention runs on torch's kernels")
        return self._kernel

    def forward(self, query, plane, kv, meta, scaling, deterministic=False):
        if not (deterministic and isinstance(kv, TensorKVStore) and self._use_kernel()):
            return super().forward(query, plane, kv, meta, scaling, deterministic)
        if self._rows is None or self._rows[0] is not meta:  # built once per step, not per plane
            self._rows = (meta, RowContexts.of(meta))
        rows = self._rows[1]
        keys, values = kv.rows(kv.key_cache, plane), kv.rows(kv.value_cache, plane)
        return kernels.paged_attention(query, keys, values, rows.slots, rows.off, rows.len, scaling)

    def bind(self, kv, meta, scaling, deterministic):
        """The C write and attention called directly (``kernels.bound_attention``), where
        ``forward`` and ``kv.write`` would call them: a deterministic step over a
        ``CpuKVStore`` with int64 slots."""
        slots = meta.slot_mapping
        if not (
            deterministic and isinstance(kv, CpuKVStore) and kv.uses_kernel() and self._use_kernel()
            and slots.dtype == torch.int64 and slots.is_contiguous() and slots.is_cpu
            and kv.key_cache.dtype == torch.bfloat16
        ):  # fmt: skip
            return super().bind(kv, meta, scaling, deterministic)
        if self._rows is None or self._rows[0] is not meta:
            self._rows = (meta, RowContexts.of(meta))
        return kernels.bound_attention(kv.key_cache, kv.value_cache, slots, self._rows[1], scaling)


class CpuKVStore(TensorKVStore):
    """The paged cache in host memory; a step's K/V rows are written by one C call
    (``kernels.write_kv``) where it can run, else by ``index_put_``."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        super().__init__(layout, device)
        self._kernel: bool | None = None

    def uses_kernel(self) -> bool:
        if self._kernel is None:
            self._kernel = _kernels_load("K/V rows are written by index_put_")
        return self._kernel

    def write(self, plane, key, value, slots):
        self.uses_kernel()
        k_rows, v_rows = self.rows(self.key_cache, plane), self.rows(self.value_cache, plane)
        if not (self._kernel and kernels.write_kv(key, value, slots, k_rows, v_rows)):
            super().write(plane, key, value, slots)


class CpuDriver(Driver):
    def create_kv_store(self, layout: KVLayout) -> TensorKVStore:
        return CpuKVStore(layout, self.device.torch_device)


def create(index: int | None = None) -> CpuDriver:
    if index not in (None, 0):
        raise ValueError(f"the cpu driver has one device, index 0; got cpu:{index}")
    backends = {"cpu_eager": CpuEagerBackend()}
    offered = (*REFERENCE_KERNELS, *kernels.KERNELS, *quant_kernels.KERNELS)
    return CpuDriver("cpu", CpuDevice(), backends, "cpu_eager", offered)
