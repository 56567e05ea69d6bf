"""rlt-hal's hardware-abstraction layer: the contract between the runtime and device drivers."""

from hal.hookspecs import hookimpl, hookspec
from hal.interfaces import (
    AttentionBackend,
    CompletedFence,
    Device,
    Driver,
    EventFence,
    Fence,
    KVStore,
)
from hal.kernels import Kernel, KernelUnavailable
from hal.registry import DEVICE_ENV_VAR, Registry, Selection, default_registry, parse_device
from hal.types import AttentionMetadata, DriverSpec, KVLayout, ProbeResult

__all__ = [
    "DEVICE_ENV_VAR",
    "AttentionBackend",
    "AttentionMetadata",
    "CompletedFence",
    "Device",
    "Driver",
    "DriverSpec",
    "EventFence",
    "Fence",
    "KVLayout",
    "KVStore",
    "Kernel",
    "KernelUnavailable",
    "ProbeResult",
    "Registry",
    "Selection",
    "default_registry",
    "hookimpl",
    "hookspec",
    "parse_device",
]
