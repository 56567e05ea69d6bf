"""Frozen value types shared by the HAL, the drivers and the runtime."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch


@attrs.frozen
class KVLayout:
    """Shape of one paged KV store holding ``num_planes = T * L`` per-depth planes."""

    num_planes: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __attrs_post_init__(self) -> None:
        for name in ("num_planes", "num_blocks", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_block_size(self.block_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every plane: 2 * T * L * kv_heads * head_dim * dtype size."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_planes * self.num_kv_heads * self.head_dim * itemsize


def check_block_size(block_size: int) -> None:
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")


@attrs.frozen(eq=False)
class AttentionMetadata:
    """Everything attention needs for one step, identical for all T * L planes of that step.

    Flat tensors, in the form fused paged-attention kernels take (vLLM's and Ascend's paged
    and fused-infer attention), built once per step on the host and copied to the device once.
    Request ``r`` of ``R`` owns rows ``query_start_loc[r] : query_start_loc[r + 1]`` of the
    step's ``num_tokens`` rows. They sit at positions ``context_lens[r] ..`` after the tokens
    already in the cache, so row ``i`` of the request sees positions ``0 .. context_lens[r] + i``
    (``seq_lens[r] = context_lens[r] + query_len``), all in its own pages: position ``p``
    lives in slot ``block_tables[r, p // block_size] * block_size + p % block_size`` of every
    plane. ``slot_mapping[j]`` is the slot row ``j``'s new K/V is written to.

    ``host_query_start_loc`` and ``host_context_lens`` hold the same bounds on the host, for
    backends that loop over requests: reading them never waits for the device.

    Slots and block ids count from the start of the plane a backend is called with, and may
    reach past it into later planes: slot ``s`` of plane ``p`` is row ``p * num_slots + s`` of
    the store (``KVStore.rows``), block ``b`` its block ``p * num_blocks + b``. That is how one
    step's addressing reaches every (loop, layer) plane with ordinary tables
    (:class:`KVAddressing`): a backend never needs to know why a block lies where it does.
    """

    block_size: int
    slot_mapping: torch.Tensor  # [N] int64
    block_tables: torch.Tensor  # [R, max_blocks] int32, unused entries 0
    seq_lens: torch.Tensor  # [R] int32
    context_lens: torch.Tensor  # [R] int32
    query_start_loc: torch.Tensor  # [R + 1] int32
    host_query_start_loc: tuple[int, ...]
    host_context_lens: tuple[int, ...]
    _slots: dict = attrs.field(factory=dict, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.host_query_start_loc[-1]

    @property
    def num_requests(self) -> int:
        return len(self.host_context_lens)

    def request(self, r: int) -> tuple[int, int, int]:
        """``(query_start, query_len, context_len)`` of request ``r``, from the host copy."""
        start, end = self.host_query_start_loc[r], self.host_query_start_loc[r + 1]
        return start, end - start, self.host_context_lens[r]

    def request_slots(self, r: int) -> torch.Tensor:
        """Slots of positions ``0 .. seq_len - 1`` of request ``r`` (int64, on the device):
        the gather index of eager backends, derived once per step from the block table."""
        if r not in self._slots:
            start, n, ctx = self.request(r)
            blocks = -(-(ctx + n) // self.block_size)
            table = self.block_tables[r, :blocks].long()
            offsets = torch.arange(self.block_size, device=table.device)
            self._slots[r] = (table[:, None] * self.block_size + offsets).flatten()[: ctx + n]
        return self._slots[r]

    def select(self, requests: Sequence[int]) -> AttentionMetadata:
        """The metadata of some of the step's requests (their rows renumbered from 0)."""
        device = self.block_tables.device
        rows: list[int] = []
        starts, ctx = [0], []
        for r in requests:
            start, n, c = self.request(r)
            rows += range(start, start + n)
            starts.append(starts[-1] + n)
            ctx.append(c)
        which = torch.tensor(list(requests), dtype=torch.int64, device=device)
        return AttentionMetadata(
            self.block_size,
            self.slot_mapping.index_select(0, torch.tensor(rows, dtype=torch.int64, device=device)),
            self.block_tables.index_select(0, which),
            self.seq_lens.index_select(0, which),
            self.context_lens.index_select(0, which),
            torch.tensor(starts, dtype=torch.int32, device=device),
            tuple(starts),
            tuple(ctx),
        )

    @classmethod
    def build(
        cls,
        block_size: int,
        requests: Sequence[tuple[int, int, Sequence[int]]],
        num_slots: int | None = None,
    ) -> AttentionMetadata:
        """Host metadata for ``requests``: ``(query_len, context_len, block ids)`` each, rows
        in that order. The slot mapping is checked here, on the host (in ``[0, num_slots)``
        when given, no slot twice), before anything reaches a device: see :meth:`to`."""
        slots, starts, table = [], [0], []
        width = max((len(b) for _, _, b in requests), default=0)
        for query_len, ctx, blocks in requests:
            slots += [
                blocks[p // block_size] * block_size + p % block_size
                for p in range(ctx, ctx + query_len)
            ]
            starts.append(starts[-1] + query_len)
            table.append(list(blocks) + [0] * (width - len(blocks)))
        check_slot_mapping(slots, num_slots)
        ctx_lens = [ctx for _, ctx, _ in requests]
        return cls(
            block_size,
            torch.tensor(slots, dtype=torch.int64),
            torch.tensor(table, dtype=torch.int32).view(len(requests), width),
            torch.tensor([q + c for q, c, _ in requests], dtype=torch.int32),
            torch.tensor(ctx_lens, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32),
            tuple(starts),
            tuple(ctx_lens),
        )

    _TENSORS = ("slot_mapping", "block_tables", "seq_lens", "context_lens", "query_start_loc")

    def to(
        self, device: torch.device | str, *extra: torch.Tensor, pin: bool = False
    ) -> tuple[AttentionMetadata, list[torch.Tensor]]:
        """This metadata and ``extra`` host tensors (a step's token ids...) on ``device``,
        moved with one host-to-device copy: ``(metadata, [extra...])``."""
        mine = [getattr(self, n) for n in self._TENSORS]
        moved = move_tensors([*mine, *extra], device, pin)
        return self._with(moved[: len(mine)]), moved[len(mine) :]

    def _with(self, t: list[torch.Tensor]) -> AttentionMetadata:
        return attrs.evolve(
            self,
            slot_mapping=t[0],
            block_tables=t[1],
            seq_lens=t[2],
            context_lens=t[3],
            query_start_loc=t[4],
        )


def move_tensors(
    tensors: Sequence[torch.Tensor], device: torch.device | str, pin: bool = False
) -> list[torch.Tensor]:
    """Host tensors on ``device`` with one host-to-device copy (each keeps its dtype)."""
    if torch.device(device).type == "cpu":
        return list(tensors)
    host = torch.cat([t.reshape(-1).long() for t in tensors])
    if pin:
        host = host.pin_memory()
    flat = host.to(device, non_blocking=pin)
    moved, at = [], 0
    for t in tensors:
        moved.append(flat[at : at + t.numel()].view(t.shape).to(t.dtype))
        at += t.numel()
    return moved


def check_slot_mapping(slots: Sequence[int], num_slots: int | None) -> None:
    """Refuse, on the host, a step that would write outside the cache or one slot twice."""
    if slots and num_slots is not None and not (min(slots) >= 0 and max(slots) < num_slots):
        raise IndexError(
            f"slot mapping has a slot outside [0, {num_slots}): min {min(slots)}, max {max(slots)}"
        )
    if len(set(slots)) != len(slots):
        raise IndexError("slot mapping writes one slot twice in a step")


@attrs.frozen(eq=False)
class KVAddressing:
    """Where one step's rows write and read their K/V at every (loop, layer) plane: the plane
    a backend is called with for loop ``t`` and layer ``l``, and the metadata of loop ``t``.

    With one metadata (every loop addressed alike), loop ``t`` of layer ``l`` is plane
    ``t * layers + l`` itself. With one metadata per loop (decode KV sharing, ``hal.shared_kv``),
    every loop of layer ``l`` is called with plane ``l``, the layer's first, and loop ``t``'s
    tables reach the blocks where its positions lie in any of the layer's planes
    (``AttentionMetadata``: slots past a plane address later planes). Built once per step,
    copied to the device with the step; backends see ordinary metadata either way.
    """

    layers: int
    num_slots: int  # slots per plane
    # One for every loop, or one per loop: AttentionMetadata, or in a captured step graph
    # hal.graphs.StaticDecodeMetadata (which has no select, to, or host bounds).
    loops: tuple[Any, ...]

    @classmethod
    def uniform(cls, meta: AttentionMetadata, layers: int, num_slots: int) -> KVAddressing:
        return cls(layers, num_slots, (meta,))

    @property
    def per_loop(self) -> bool:
        return len(self.loops) > 1

    @property
    def base(self) -> AttentionMetadata:
        """Loop 0's metadata: the step's requests, rows and lengths (the same in every loop)."""
        return self.loops[0]

    def plane(self, t: int, layer: int) -> int:
        return layer if self.per_loop else t * self.layers + layer

    def meta(self, t: int) -> AttentionMetadata:
        return self.loops[t] if self.per_loop else self.loops[0]

    def write_slots(self, t: int) -> torch.Tensor:
        """Loop ``t``'s slot of every row, counted from the layer's first plane ``l``."""
        if self.per_loop:
            return self.loops[t].slot_mapping
        return self.loops[0].slot_mapping + t * self.layers * self.num_slots

    def to(
        self, device: torch.device | str, *extra: torch.Tensor, pin: bool = False
    ) -> tuple[KVAddressing, list[torch.Tensor]]:
        """Every loop's metadata and ``extra`` host tensors on ``device``, in one copy."""
        names = AttentionMetadata._TENSORS
        mine = [getattr(m, n) for m in self.loops for n in names]
        moved = move_tensors([*mine, *extra], device, pin)
        k = len(names)
        loops = tuple(m._with(moved[i * k : (i + 1) * k]) for i, m in enumerate(self.loops))
        return attrs.evolve(self, loops=loops), moved[len(mine) :]

    def select(self, requests: Sequence[int]) -> KVAddressing:
        """The addressing of some of the step's requests (their rows renumbered from 0)."""
        return attrs.evolve(self, loops=tuple(m.select(requests) for m in self.loops))

    def map(self, fn) -> KVAddressing:
        """Every loop's metadata through ``fn`` (e.g. the static decode form)."""
        return attrs.evolve(self, loops=tuple(fn(m) for m in self.loops))
