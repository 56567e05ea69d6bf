"""Step graphs: a driver capability that captures one decode step and replays it.

A graph freezes the sequence of device ops it saw and the addresses of every tensor they
touched (CUDA: ``torch.cuda.CUDAGraph``; Ascend: ``torch.npu.NPUGraph``, whose ACL graphs also
take per-step host arguments through ``NPUGraph.update(cpu_update_input=...)``). Replaying it
costs one host call instead of one per op, which is what an accelerator that is launch-bound
needs. The price is a contract on the captured step:

- its inputs live in *static buffers*: each step copies its data into them in place, never
  rebinding a name to a new tensor (a graph would keep reading the old one);
- its shapes are static: the runtime captures one graph per padded batch size and context
  bucket (:class:`StaticDecodeMetadata`);
- nothing in it reads the device from the host (``.item()``, ``.tolist()``, ``bool(t)``,
  ``.cpu()``) or synchronises, and no tensor is built from host data inside it: control flow
  that depends on device values would be frozen at its capture-time branch.

A driver offers the capability by returning a :class:`StepGraphs` from
``Driver.step_graphs()`` (the default, ``None``: no graphs, as on cpu). An attention backend
that can run inside a graph says so with ``AttentionBackend.step_graphs`` and then accepts a
:class:`StaticDecodeMetadata` in ``forward``.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import attrs
import torch

_state = threading.local()


def _listeners() -> list[Callable[[str], None]]:
    if not hasattr(_state, "listeners"):
        _state.listeners, _state.depth = [], 0
    return _state.listeners


@contextlib.contextmanager
def device_call(name: str) -> Iterator[None]:
    """The work inside is one host call to the device (a graph's replay, an emulated vendor
    op): listeners (host-call counters) hear ``name`` once, and :func:`inside_device_call`
    tells them to skip the torch ops that carry it out."""
    for listener in list(_listeners()):
        if not inside_device_call():
            listener(name)
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1


def inside_device_call() -> bool:
    _listeners()
    return _state.depth > 0


@contextlib.contextmanager
def listening(listener: Callable[[str], None]) -> Iterator[None]:
    """Call ``listener(name)`` for every :func:`device_call` while the block runs."""
    _listeners().append(listener)
    try:
        yield
    finally:
        _listeners().remove(listener)


class StepGraph(abc.ABC):
    """One captured step. ``replay()`` re-issues its work on the same buffers."""

    def replay(self) -> None:
        with device_call("graph.replay"):
            self._replay()

    @abc.abstractmethod
    def _replay(self) -> None: ...

    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        """Refresh per-step host arguments of the captured ops (ACL graphs only)."""
        raise NotImplementedError(f"{type(self).__name__} takes no per-step host arguments")


class StepGraphs(abc.ABC):
    """The capability: capture a callable that reads static buffers, once per shape."""

    name: ClassVar[str]
    emulated: bool = False  # a test double standing in for the hardware's graphs

    @abc.abstractmethod
    def capture(self, fn: Callable[[], Any]) -> tuple[StepGraph, Any]:
        """Warm ``fn`` up, capture one call of it and return ``(graph, outputs)``: the
        outputs' tensors are static, overwritten by every ``graph.replay()``."""

    @property
    def label(self) -> str:
        return f"{self.name} (emulated)" if self.emulated else self.name


def context_bucket(blocks: int) -> int:
    """The context bucket, in blocks, of a decode row that reads ``blocks`` blocks: the next
    power of two. Step graphs are captured per bucket; a backend whose decode form reads a
    padded bucket eagerly too (``ascend_fia``) takes the same one."""
    return 1 << max(blocks - 1, 0).bit_length()


@attrs.frozen(eq=False)
class StaticDecodeMetadata:
    """Attention metadata of a decode-only step in static shapes (one query row per request).

    ``B`` rows, padded (padding rows write a scratch page and read only scratch pages), and a
    context bucket of ``W`` blocks: row ``r`` reads slots ``block_tables[r, :W]`` of which the
    first ``seq_lens[r]`` positions are its context (its new token last); the rest are masked.
    Every tensor lives on the device and is a view of the step's static buffer, or derived
    from one inside the captured step (:meth:`of`): no field is read on the host.
    """

    block_size: int
    slot_mapping: torch.Tensor  # [B] int64: where each row's new K/V goes
    block_tables: torch.Tensor  # [B, W] int64
    seq_lens: torch.Tensor  # [B] int64: context + 1
    gather_slots: torch.Tensor  # [B * W * block_size] int64: the slots each row reads
    masked: torch.Tensor  # [B, 1, 1, W * block_size] bool: positions past seq_lens
    static: ClassVar[bool] = True
    shared: ClassVar[None] = None  # no kv sharing under graphs (EngineArgs.CONFLICTS)

    @classmethod
    def of(cls, block_size: int, slot_mapping, block_tables, seq_lens) -> StaticDecodeMetadata:
        """Derive the gather index and the mask on the device (ops inside the graph)."""
        rows, width = block_tables.shape
        offsets = torch.arange(block_size, device=block_tables.device)
        slots = (block_tables[:, :, None] * block_size + offsets).reshape(-1)
        positions = torch.arange(width * block_size, device=block_tables.device)
        masked = (positions[None, :] >= seq_lens[:, None]).view(rows, 1, 1, width * block_size)
        return cls(block_size, slot_mapping, block_tables, seq_lens, slots, masked)

    @classmethod
    def bucketed(cls, meta, width: int | None = None) -> StaticDecodeMetadata:
        """The static form of an eager decode-only step (``hal.types.AttentionMetadata`` with one
        query row per request): the step's context bucket (``width`` blocks, by default its
        rows' own), spare table entries repeating each row's first block. A plan that runs
        decode steps in this form eagerly too (``--mode fast``) gives a step the same ops and
        arguments whether it is replayed or not."""
        bs, tables = meta.block_size, meta.block_tables
        if width is None:
            width = context_bucket(max(-(-(c + 1) // bs) for c in meta.host_context_lens))
        cols = torch.arange(width, device=tables.device)
        picked = tables[:, cols.clamp(max=tables.shape[1] - 1)].long()
        used = (meta.seq_lens[:, None].long() + bs - 1) // bs
        table = torch.where(cols[None] < used, picked, picked[:, :1])
        return cls.of(bs, meta.slot_mapping, table, meta.seq_lens.long())

    @property
    def num_rows(self) -> int:
        return self.block_tables.shape[0]

    @property
    def context(self) -> int:
        """Positions each row reads (its bucket, padded): ``W * block_size``."""
        return self.block_tables.shape[1] * self.block_size
