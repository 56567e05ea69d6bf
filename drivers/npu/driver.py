"""Ascend NPU driver: lazy torch_npu, ``ascend_eager`` attention, ScatterND KV writes, fences.

torch_npu is imported in ``NpuDevice.initialize()`` and nowhere else. With ``emulate=True``
(or ``RLT_HAL_NPU_EMULATE=1``) the driver runs on the CPU through ``drivers.npu.emulation``,
a test double for the hardware, and labels itself "emulated".
"""

from __future__ import annotations

import importlib.metadata
import os
import types
from typing import Any

import torch

from drivers.npu import environment, fused, quantized
from drivers.npu.emulation import emulation_requested
from drivers.npu.graphs import NpuStepGraphs
from hal.eager import EagerBackend, TensorKVStore
from hal.interfaces import Device, Driver, EventFence, Fence
from hal.quant import REFERENCE_KERNELS
from hal.types import KVLayout


def _versions() -> tuple[str, str]:
    """torch's and the installed torch_npu's version, without importing torch_npu."""
    try:
        npu = importlib.metadata.version("torch-npu")
    except importlib.metadata.PackageNotFoundError:
        npu = "?"
    return torch.__version__.split("+")[0], npu


def _pairing_hint(torch_version: str) -> str:
    return (
        f"install the torch-npu build for torch {torch_version}: `pip index versions torch-npu` "
        f"lists them (X.Y.Z or X.Y.Z.postN pairs with torch X.Y.Z; .postN builds pair with newer "
        f"CANN releases; docs/ascend.md has the table)"
    )


def explain_import_failure(exc: BaseException) -> str:
    """What a failed ``import torch_npu`` means and what to do, from the error's text."""
    text = str(exc)
    torch_version, npu_version = _versions()
    if "undefined symbol" in text:
        return (
            f"torch_npu {npu_version} was built for another torch than this torch "
            f"{torch_version} ({text}); {_pairing_hint(torch_version)}"
        )
    if "libascend_hal" in text or "libdrvdsmi" in text:
        return f"the Ascend NPU driver is not installed or not on the library path ({text}); " + (
            environment.DRIVER_HINT
        )
    if any(lib in text for lib in ("libhccl", "libascendcl", "libacl", "libge_", "libopapi")):
        return f"CANN is not set up ({text}); {environment.CANN_HINT}"
    return f"importing torch_npu failed: {text}"


def import_torch_npu() -> types.SimpleNamespace:
    """Import torch_npu and return the operations the driver uses, with actionable errors."""
    try:
        import torch_npu  # noqa: F401 - registers torch.npu
    except ModuleNotFoundError as exc:
        if exc.name != "torch_npu":
            raise RuntimeError(explain_import_failure(exc)) from exc
        raise RuntimeError(
            f"torch_npu is not installed; {_pairing_hint(_versions()[0])}, with a matching CANN"
        ) from None
    except (OSError, ImportError, RuntimeError) as exc:
        raise RuntimeError(explain_import_failure(exc)) from exc
    npu = torch.npu  # type: ignore[attr-defined]
    return types.SimpleNamespace(
        label="torch_npu",
        device_count=npu.device_count,
        set_device=npu.set_device,
        current_stream=npu.current_stream,
        Event=npu.Event,
        synchronize=npu.synchronize,
        to_host=lambda tensor: tensor.to("cpu"),
        npu_scatter_nd_update_=torch_npu.npu_scatter_nd_update_,
        **{name: getattr(torch_npu, name, None) for name in fused.FUSED_OPS},
        **{name: getattr(torch_npu, name, None) for name in quantized.QUANT_OPS},
        # Step graphs (drivers.npu.graphs); looked up lazily, only --step-graphs needs them.
        NPUGraph=getattr(npu, "NPUGraph", None),
        graph=getattr(npu, "graph", None),
        graph_pool_handle=getattr(npu, "graph_pool_handle", None),
    )


class NpuDevice(Device):
    device_type = "npu"
    visible_devices_env_var = "ASCEND_RT_VISIBLE_DEVICES"

    def __init__(self, index: int = 0, emulate: bool = False, event_delay: int = 0) -> None:
        super().__init__(index)
        self.emulated = emulate
        self.event_delay = event_delay
        self.ops: Any = None  # torch_npu's operations, or their emulation
        self.stream: Any = None
        self._init_pid: int | None = None

    def initialize(self) -> None:
        if self._initialized:
            if self._init_pid != os.getpid():
                raise RuntimeError(
                    "the NPU was initialised in a parent process and cannot be re-initialised "
                    "after fork; start workers with the 'spawn' start method"
                )
            return
        if self.emulated:
            from drivers.npu.emulation import EmulatedTorchNpu

            self.ops = EmulatedTorchNpu(event_delay=self.event_delay)
        else:
            self.ops = import_torch_npu()
        count = self.ops.device_count()
        visible = os.environ.get(self.visible_devices_env_var)
        if count == 0:
            raise RuntimeError(
                f"no Ascend device is visible (ASCEND_RT_VISIBLE_DEVICES="
                f"{visible!r}); check npu-smi info and that variable"
            )
        if self.index >= count:
            raise RuntimeError(
                f"npu:{self.index} requested but {count} device(s) are visible "
                f"(ASCEND_RT_VISIBLE_DEVICES={visible!r})"
            )
        try:
            self.ops.set_device(self.index)
        except RuntimeError as exc:
            if "fork" in str(exc).lower():
                raise RuntimeError(
                    "NPU cannot be initialised in a forked process; use the "
                    f"'spawn' start method ({exc})"
                ) from None
            raise
        self.stream = self.ops.current_stream()  # cached: each call builds a new object
        self._init_pid = os.getpid()
        self._initialized = True

    @property
    def label(self) -> str:
        return "npu (emulated torch_npu on CPU)" if self.emulated else f"npu:{self.index}"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.emulated else torch.device("npu", self.index)

    def synchronize(self) -> None:
        self.ops.synchronize()

    def record_fence(self) -> Fence:
        return EventFence(self.ops.Event(), self.stream)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.ops.to_host(tensor)

    def memory_stats(self) -> dict[str, int]:
        if self.emulated:
            return {"emulated": 1}
        npu = torch.npu  # type: ignore[attr-defined]
        return {
            "allocated_bytes": npu.memory_allocated(self.index),
            "peak_allocated_bytes": npu.max_memory_allocated(self.index),
        }

    @property
    def pin_memory(self) -> bool:
        return not self.emulated


class AscendEagerBackend(EagerBackend):
    """HF eager order over pages gathered through the block table (shared with cpu_eager)."""

    name = "ascend_eager"


class ScatterNDKVStore(TensorKVStore):
    """K/V rows written with ``npu_scatter_nd_update_``; indices built once per step.

    The op's behaviour is undefined for out-of-range indices. The slot mapping it receives
    was checked on the host when the step's metadata was built
    (``hal.types.check_slot_mapping``); checking it here would read the device every write.
    """

    def __init__(self, layout: KVLayout, device: NpuDevice) -> None:
        super().__init__(layout, device.torch_device)
        self.npu = device
        self._indices_for: torch.Tensor | None = None
        self._indices: torch.Tensor | None = None

    def indices(self, slots: torch.Tensor) -> torch.Tensor:
        """``[N, 1]`` int64 ScatterND indices for a step's slot mapping, built once per step."""
        if slots is not self._indices_for:
            self._indices = slots.to(torch.int64).reshape(-1, 1)
            self._indices_for = slots
        assert self._indices is not None
        return self._indices

    def _write_rows(self, cache, slots, rows):
        self.npu.ops.npu_scatter_nd_update_(cache, self.indices(slots), rows.contiguous())


class NpuDriver(Driver):
    device: NpuDevice

    def create_kv_store(self, layout: KVLayout) -> ScatterNDKVStore:
        self.device.initialize()
        return ScatterNDKVStore(layout, self.device)

    def step_graphs(self) -> NpuStepGraphs:
        self.device.initialize()
        return NpuStepGraphs(self.device)


def create(
    index: int | None = None, emulate: bool | None = None, event_delay: int = 0
) -> NpuDriver:
    emulate = emulation_requested() if emulate is None else emulate
    device = NpuDevice(index or 0, emulate=emulate, event_delay=event_delay)
    driver = NpuDriver(
        "npu",
        device,
        {"ascend_eager": AscendEagerBackend()},
        "ascend_eager",
        kernels=(*REFERENCE_KERNELS, *quantized.kernels(device), *fused.kernels(device)),
        fused_backends={"ascend_fia": fused.AscendFiaBackend(device)},
    )
    driver.label = device.label
    return driver
