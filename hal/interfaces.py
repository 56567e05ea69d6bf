"""The interfaces a driver implements: Fence, Device, KVStore, AttentionBackend, Driver.

Static facts are typed class attributes; behaviour is methods that either have a safe default
or raise NotImplementedError. Nothing here imports a driver or the runtime.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, ClassVar

import torch

from hal.kernels import TORCH_KERNELS, WEIGHT_SCHEMES, Kernel
from hal.types import AttentionMetadata, KVLayout

if TYPE_CHECKING:
    from hal.graphs import StepGraphs


class Fence(abc.ABC):
    """A point in a device's work queue. ``done()`` polls, ``wait()`` blocks until reached."""

    @abc.abstractmethod
    def done(self) -> bool: ...

    @abc.abstractmethod
    def wait(self) -> None: ...


class CompletedFence(Fence):
    """The fence of a synchronous device: complete the moment it is recorded."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class EventFence(Fence):
    """A device event recorded on a stream (``torch.cuda.Event``, ``torch.npu.Event``)."""

    def __init__(self, event, stream=None) -> None:
        self.event = event
        self.event.record(stream)

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


class Device(abc.ABC):
    """One accelerator (or the host). Initialises lazily: construction never touches hardware."""

    device_type: ClassVar[str]
    # The environment variable that restricts which devices the process sees, if any.
    visible_devices_env_var: ClassVar[str | None] = None

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self._initialized = False

    def initialize(self) -> None:
        """Import the vendor stack and select the device. Idempotent."""
        self._initialized = True

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device_type, self.index)

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    @abc.abstractmethod
    def record_fence(self) -> Fence: ...

    def memory_stats(self) -> dict[str, int]:
        return {}

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` copied to the host, waiting for it: the engine's one read of a step's
        results goes through here (a host tensor on the cpu device, returned as it is)."""
        return tensor.cpu()

    def alloc_weights(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """One flat, uninitialised buffer that the loader fills with every model weight.

        Drivers may choose where it lives (the cpu driver aligns it to 2 MiB and asks the
        kernel for huge pages, since decode streams all of it once per loop).
        """
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    @property
    def pin_memory(self) -> bool:
        """Whether host buffers feeding this device should be pinned."""
        return False


class KVStore(abc.ABC):
    """One paged cache holding ``layout.num_planes`` (= T * L) planes of K and V.

    Slot ``s`` of a plane is token ``s % block_size`` of block ``s // block_size``. Slots count
    from the start of the plane named, and may reach past it: slot ``s`` of plane ``p`` is the
    store's row ``p * num_slots + s`` (``hal.types.KVAddressing`` addresses every loop of a
    layer from the layer's first plane so). A store must accept any such slot.
    """

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device

    @abc.abstractmethod
    def write(
        self, plane: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store ``key``/``value`` rows (``[N, kv_heads, head_dim]``) at ``slots`` (``[N]``)."""

    @abc.abstractmethod
    def gather(self, plane: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the rows at ``slots`` as contiguous ``[1, kv_heads, len(slots), head_dim]``."""

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the rows at slots ``src`` to slots ``dst`` (``[N]`` each) in every plane: a
        request forked from another's computed prompt (n > 1) gets its own copy of the
        partial last page. Through :meth:`gather` and :meth:`write`, in stream order."""
        for plane in range(self.layout.num_planes):
            k, v = self.gather(plane, src)
            self.write(plane, k[0].transpose(0, 1), v[0].transpose(0, 1), dst)


class AttentionBackend(abc.ABC):
    """Attention over the paged cache for every request of a step."""

    name: ClassVar[str]
    # True when the backend reproduces HF eager's rounding order bit for bit.
    hf_exact: ClassVar[bool] = False
    # True when the backend honours ``forward(..., deterministic=True)``: each row computed
    # alone over exactly its own context, so its bits depend on neither the step's other rows
    # nor how a prompt was chunked.
    supports_deterministic: ClassVar[bool] = False
    # True when deterministic mode was measured to cost next to nothing on this backend, so
    # the runtime turns it on unless told otherwise (see docs/determinism.md).
    deterministic_by_default: ClassVar[bool] = False
    # True when the deterministic form is also the backend's fastest, so that ``--mode fast``
    # (which keeps no bits) runs it too.
    deterministic_is_fastest: ClassVar[bool] = False
    # True when ``forward`` also takes a ``hal.graphs.StaticDecodeMetadata`` (static shapes,
    # no host reads): the decode step can then be captured as a step graph.
    step_graphs: ClassVar[bool] = False

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        plane: int,
        kv: KVStore,
        meta: AttentionMetadata,
        scaling: float,
        deterministic: bool = False,
    ) -> torch.Tensor:
        """``query``: ``[1, heads, N, head_dim]`` (HF layout, N = all tokens of the step).

        Returns ``[N, heads * head_dim]``, rows in the same order as the queries.
        """

    def write_kv(
        self, kv: KVStore, plane: int, key: torch.Tensor, value: torch.Tensor, meta
    ) -> None:
        """Store a step's ``key``/``value`` rows ``[N, kv_heads, d]`` at ``meta.slot_mapping``
        (a backend with a fused cache write of its own overrides this)."""
        kv.write(plane, key, value, meta.slot_mapping)

    def bind(self, kv: KVStore, meta, scaling: float, deterministic: bool) -> BoundAttention:
        """One loop's K/V writes and attention over ``kv`` with ``meta``, bound once for the
        planes a loop calls them on (a runtime's bound decode loop). By default this
        backend's ``write_kv`` and ``forward``; a backend may bind its own kernels, with the
        same bits."""

        def attend(query: torch.Tensor, plane: int, out: torch.Tensor) -> None:
            out.copy_(self.forward(query, plane, kv, meta, scaling, deterministic=deterministic))

        return BoundAttention(lambda plane, k, v: self.write_kv(kv, plane, k, v, meta), attend)


@dataclasses.dataclass(frozen=True)
class BoundAttention:
    """``AttentionBackend.bind``: ``write(plane, key, value)`` as ``write_kv`` and
    ``attend(query, plane, out)``, which writes ``forward``'s ``[N, heads * d]`` into ``out``."""

    write: Callable[[int, torch.Tensor, torch.Tensor], None]
    attend: Callable[[torch.Tensor, int, torch.Tensor], None]
    operands: tuple = ()  # what the calls read by address, kept alive as long as they are


class Driver:
    """A device with its attention backends, its KV store factory and its kernels.

    ``kernels`` are the driver's own implementations of the ops in ``hal.kernels.OPS``; torch's
    forms (``hal.kernels.TORCH_KERNELS``, named "torch") are always offered besides them.
    Quantized linear kernels (``Kernel.scheme``) are offered only by drivers that list them:
    ``quantization_schemes`` are the schemes a driver runs.
    ``fused_backends`` are attention backends that only a fast plan may use, once admitted
    by a check on the device (``--mode fast``); ``backend(name)`` finds them too.
    """

    def __init__(
        self,
        name: str,
        device: Device,
        backends: Mapping[str, AttentionBackend],
        default_backend: str,
        kernels: Iterable[Kernel] = (),
        fused_backends: Mapping[str, AttentionBackend] | None = None,
    ) -> None:
        if default_backend not in backends:
            raise ValueError(f"default backend {default_backend!r} is not among {sorted(backends)}")
        self.name = name
        self.device = device
        self.backends = dict(backends)
        self.fused_backends = dict(fused_backends or {})
        self.default_backend = default_backend
        self.kernels: tuple[Kernel, ...] = (*TORCH_KERNELS, *kernels)
        names = [(k.op, k.name) for k in self.kernels]
        if len(set(names)) != len(names):
            raise ValueError(f"driver {name!r} offers two kernels with one (op, name): {names}")
        self.label = name  # what reports and logs call it ("npu (emulated ...)", "cuda:1")

    def backend(self, name: str | None = None) -> AttentionBackend:
        name = name or self.default_backend
        if name in self.fused_backends:
            return self.fused_backends[name]
        if name not in self.backends:
            known = ", ".join(sorted([*self.backends, *self.fused_backends]))
            raise ValueError(
                f"attention backend {name!r} is not offered by driver {self.name!r}; "
                f"choose one of: {known}"
            )
        return self.backends[name]

    def create_kv_store(self, layout: KVLayout) -> KVStore:
        raise NotImplementedError(f"driver {self.name!r} does not provide a KV store")

    def step_graphs(self) -> StepGraphs | None:
        """The driver's step graphs (``hal.graphs``), or None where it has none (cpu)."""
        return None

    @property
    def offers_step_graphs(self) -> bool:
        """Whether the driver has step graphs, asked without starting its device: a driver
        that has them overrides :meth:`step_graphs`."""
        return type(self).step_graphs is not Driver.step_graphs

    def kernels_for(self, op: str, scheme: str | None = "bf16") -> tuple[Kernel, ...]:
        """Every kernel offered for ``op`` taking weights in ``scheme`` (None: any), torch's
        first."""
        return tuple(
            k for k in self.kernels if k.op == op and (scheme is None or k.scheme == scheme)
        )

    @property
    def quantization_schemes(self) -> tuple[str, ...]:
        """The weight-only schemes (``hal.quant``) this driver runs: those of its linear
        kernels. A driver runs a scheme by offering a kernel for it (at least
        ``hal.quant.REFERENCE_KERNELS``' one)."""
        return tuple(
            dict.fromkeys(k.scheme for k in self.kernels_for("linear", None) if k.scheme != "bf16")
        )

    def kernel(self, op: str, name: str) -> Kernel:
        for k in self.kernels_for(op, None):
            if k.name == name:
                return k
        offered = sorted(self.kernels_for(op, None), key=lambda k: WEIGHT_SCHEMES.index(k.scheme))
        known = ", ".join(k.name for k in offered)  # bf16 kernels first
        raise ValueError(
            f"{op} kernel {name!r} is not offered by driver {self.name!r}; choose one of: {known}"
        )

    def __repr__(self) -> str:
        return f"Driver({self.name!r}, backends={sorted(self.backends)})"
