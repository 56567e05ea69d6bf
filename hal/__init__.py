"""rlt-hal's hardware-abstraction layer: the contract between the runtime and device drivers.

Importing ``hal`` is cheap: it sets one environment variable and imports nothing else. Its
names (``hal.Driver``, ``hal.DriverSpec``, ...) load their modules, and torch with them, on
first use, so that ``rlt-hal --help`` parses without importing torch.

May import: nothing. The contract stands alone: never the runtime, never a driver. Its
conformance kit, a subpackage, declares its own list.
"""

import importlib
import os
from typing import TYPE_CHECKING, Any

# torch >= 2.5 imports every installed device extension during `import torch` (the
# "torch.backends" entry points), and torch_npu without CANN makes that import fail before any
# of rlt-hal can say why. rlt-hal's drivers import their vendor stacks themselves, in
# Device.initialize(), and turn each failure into an error that says what to install or set,
# so auto-loading is off unless the environment asks for it. This must run before torch loads:
# every rlt-hal package imports hal first.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

if TYPE_CHECKING:
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

# Each exported name -> the module that defines it.
_EXPORTS = {
    "hookimpl": "hal.hookspecs",
    "hookspec": "hal.hookspecs",
    "AttentionBackend": "hal.interfaces",
    "CompletedFence": "hal.interfaces",
    "Device": "hal.interfaces",
    "Driver": "hal.interfaces",
    "EventFence": "hal.interfaces",
    "Fence": "hal.interfaces",
    "KVStore": "hal.interfaces",
    "Kernel": "hal.kernels",
    "KernelUnavailable": "hal.kernels",
    "DEVICE_ENV_VAR": "hal.registry",
    "Registry": "hal.registry",
    "Selection": "hal.registry",
    "default_registry": "hal.registry",
    "parse_device": "hal.registry",
    "DriverSpec": "hal.spec",
    "ProbeResult": "hal.spec",
    "AttentionMetadata": "hal.types",
    "KVLayout": "hal.types",
}

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value
