"""Counting device ops: what a step would launch on an accelerator, counted on any device.

A ``TorchDispatchMode`` sees every op torch dispatches below autograd. :class:`DeviceOpCounter`
sorts them into:

- **device ops**: kernels a device would launch, one per dispatched op. A custom op counts
  once, whatever it runs inside (the mode does not see into it): an emulated torch_npu op
  (``drivers.npu.fused_ops``) counts as the one device op it stands for.
- **views**: ops whose result aliases an input without writing it (``view``, ``transpose``,
  ``split``, ``as_strided``...): metadata only, no device op.
- **allocations**: ``empty*`` ops: a caching allocator hands out memory without a kernel.
- **emulated ops** written in plain torch ops (``emulated_op``): one device op each.
- **host reads**: ``_local_scalar_dense`` (``.item()``, ``bool(tensor)``): the host waits for
  the device; counted as device ops too, and listed apart.

Usage (the lead's graph code can count around ``replay()`` the same way)::

    with DeviceOpCounter() as ops:
        engine.step()
    ops.device_ops, ops.by_name.most_common(10)
"""

from __future__ import annotations

import contextlib
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

_ACTIVE: list[DeviceOpCounter] = []  # the counters entered, innermost last
_EMULATING = [0]  # depth of emulated_op regions: their inner ops are the test double's


@contextlib.contextmanager
def emulated_op(name: str):
    """Mark the body as one emulated device op ``name`` (a test double written in plain torch
    ops, which a custom op would hide): counted once, its inner ops not at all."""
    for counter in _ACTIVE:
        counter.by_name[name] += 1
    _EMULATING[0] += 1
    try:
        yield
    finally:
        _EMULATING[0] -= 1


ALLOCATIONS = frozenset(("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"))
HOST_READS = frozenset(("_local_scalar_dense",))


def op_name(func) -> str:
    """``aten.mm``, ``rlt_npu_emulated.npu_rms_norm``: namespace and op, no overload."""
    return f"{func.namespace}.{func._schema.name.split('::')[-1]}"


def is_view(func) -> bool:
    """Whether ``func`` returns an alias of an input that it does not write (a view)."""
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns
    )


class DeviceOpCounter(TorchDispatchMode):
    """Counts the ops dispatched inside it, sorted as the module docstring says."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()  # device ops only
        self.views: Counter[str] = Counter()
        self.allocations = 0
        self.host_reads = 0

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _EMULATING[0]:
            return func(*args, **(kwargs or {}))
        name = op_name(func)
        short = name.split(".", 1)[1]
        if is_view(func):
            self.views[name] += 1
        elif short in ALLOCATIONS:
            self.allocations += 1
        else:
            self.by_name[name] += 1
            if short in HOST_READS:
                self.host_reads += 1
        return func(*args, **(kwargs or {}))

    @property
    def device_ops(self) -> int:
        return sum(self.by_name.values())

    def summary(self, top: int = 12) -> dict:
        return {
            "device_ops": self.device_ops,
            "views": sum(self.views.values()),
            "allocations": self.allocations,
            "host_reads": self.host_reads,
            "top_ops": dict(self.by_name.most_common(top)),
        }


def count_device_ops(fn, *args, **kwargs) -> tuple[object, DeviceOpCounter]:
    """``fn(*args, **kwargs)`` run under a :class:`DeviceOpCounter`: (its result, the counter)."""
    with DeviceOpCounter() as counter:
        result = fn(*args, **kwargs)
    return result, counter
