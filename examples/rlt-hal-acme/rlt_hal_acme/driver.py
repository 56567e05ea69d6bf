"""The acme driver: host CPU, ``index_copy_`` KV writes, HF-order eager attention."""

from __future__ import annotations

import torch

from hal import CompletedFence, Device, Driver
from hal.eager import EagerBackend, TensorKVStore


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
    return AcmeDriver("acme", AcmeDevice(), {"acme_eager": AcmeEagerBackend()}, "acme_eager")
