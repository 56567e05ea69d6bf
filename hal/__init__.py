"""rlt-hal's hardware-abstraction layer: the contract between the runtime and device drivers."""

import os

# torch >= 2.5 imports every installed device extension during `import torch` (the
# "torch.backends" entry points), and torch_npu without CANN makes that import fail before any
# of rlt-hal can say why. rlt-hal's drivers import their vendor stacks themselves, in
# Device.initialize(), and turn each failure into an error that says what to install or set,
# so auto-loading is off unless the environment asks for it. This must run before torch loads:
# every rlt-hal package imports hal first.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

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
from hal.spec import DriverSpec, ProbeResult
from hal.types import AttentionMetadata, KVLayout

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
