"""Frozen value types shared by the HAL, the drivers and the runtime."""

from __future__ import annotations

from collections.abc import Sequence

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

    ``shared``: under decode KV sharing, where each position's K/V lives (``hal.shared_kv``):
    the block tables then cover prompt positions only, and generated ones live in shared planes.
    """

    block_size: int
    slot_mapping: torch.Tensor  # [N] int64
    block_tables: torch.Tensor  # [R, max_blocks] int32, unused entries 0
    seq_lens: torch.Tensor  # [R] int32
    context_lens: torch.Tensor  # [R] int32
    query_start_loc: torch.Tensor  # [R + 1] int32
    host_query_start_loc: tuple[int, ...]
    host_context_lens: tuple[int, ...]
    shared: SharedRegion | None = None
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
        if self.shared is not None:
            raise RuntimeError(
                "a kv-sharing step has no per-plane slots: read a request's K/V with "
                "hal.shared_kv.request_kv"
            )
        if r not in self._slots:
            start, n, ctx = self.request(r)
            blocks = -(-(ctx + n) // self.block_size)
            table = self.block_tables[r, :blocks].long()
            offsets = torch.arange(self.block_size, device=table.device)
            self._slots[r] = (table[:, None] * self.block_size + offsets).flatten()[: ctx + n]
        return self._slots[r]

    def select(self, requests: Sequence[int]) -> AttentionMetadata:
        """The metadata of some of the step's requests (their rows renumbered from 0)."""
        if self.shared is not None:  # hal.types depends on nothing else of the HAL
            raise ValueError("under kv sharing, select with hal.shared_kv.select_metadata")
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

    def to(
        self, device: torch.device | str, *extra: torch.Tensor, pin: bool = False
    ) -> tuple[AttentionMetadata, list[torch.Tensor]]:
        """This metadata and ``extra`` host tensors (a step's token ids...) on ``device``,
        moved with one host-to-device copy: ``(metadata, [extra...])``."""
        names = ("slot_mapping", "block_tables", "seq_lens", "context_lens", "query_start_loc")
        mine = [getattr(self, n) for n in names]
        if torch.device(device).type == "cpu":
            return self, list(extra)
        parts = [t.reshape(-1).long() for t in (*mine, *extra)]
        host = torch.cat(parts)
        if pin:
            host = host.pin_memory()
        flat = host.to(device, non_blocking=pin)
        moved, at = [], 0
        for t in (*mine, *extra):
            moved.append(flat[at : at + t.numel()].view(t.shape).to(t.dtype))
            at += t.numel()
        slots, tables, seq_lens, ctx_lens, starts = moved[: len(names)]
        meta = attrs.evolve(
            self,
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=seq_lens,
            context_lens=ctx_lens,
            query_start_loc=starts,
            shared=None if self.shared is None else self.shared.to(device),
        )
        return meta, moved[len(names) :]


def check_slot_mapping(slots: Sequence[int], num_slots: int | None) -> None:
    """Refuse, on the host, a step that would write outside the cache or one slot twice."""
    if slots and num_slots is not None and not (min(slots) >= 0 and max(slots) < num_slots):
        raise IndexError(
            f"slot mapping has a slot outside [0, {num_slots}): min {min(slots)}, max {max(slots)}"
        )
    if len(set(slots)) != len(slots):
        raise IndexError("slot mapping writes one slot twice in a step")


# (query_len, context_len, prompt block ids, prompt length, generated block ids)
SharedRequest = tuple[int, int, Sequence[int], int, Sequence[int]]


@attrs.frozen(eq=False)
class SharedRegion:
    """(``hal.shared_kv`` builds and reads it.) The per-step addressing of a step's requests under decode KV sharing (see the module
    docstring). ``row_*`` are per row of the step (where its new K/V goes), ``kv_*`` per
    position ``0 .. seq_len - 1`` of every request back to back (where it reads its keys
    from); request ``r``'s positions are ``kv_start[r] : kv_start[r + 1]``."""

    layers: int
    loops: int
    num_slots: int  # S, slots per plane
    requests: tuple[SharedRequest, ...]  # what it was built from, on the host
    kv_start: tuple[int, ...]  # [R + 1]
    row_base: torch.Tensor  # [N] int64
    row_prompt: torch.Tensor  # [N] int64, 1 for a prompt position, 0 for a generated one
    kv_base: torch.Tensor  # [sum seq_len] int64
    kv_prompt: torch.Tensor  # [sum seq_len] int64

    def _at(self, base: torch.Tensor, prompt: torch.Tensor, plane: int) -> torch.Tensor:
        t, li = divmod(plane, self.layers)
        at = base + li * self.num_slots
        return at if t == 0 else at + prompt * (t * self.layers * self.num_slots)

    def write_addresses(self, plane: int) -> torch.Tensor:
        """Where each row of the step writes its plane-``plane`` K/V (``[N]`` int64)."""
        return self._at(self.row_base, self.row_prompt, plane)

    def kv_addresses(self, plane: int) -> torch.Tensor:
        """Every request's keys at ``plane``, back to back (``[sum seq_len]`` int64)."""
        return self._at(self.kv_base, self.kv_prompt, plane)

    def request_addresses(self, plane: int, r: int) -> torch.Tensor:
        a, b = self.kv_start[r], self.kv_start[r + 1]
        return self._at(self.kv_base[a:b], self.kv_prompt[a:b], plane)

    def to(self, device: torch.device | str) -> SharedRegion:
        if torch.device(device).type == "cpu":
            return self
        host = torch.cat((self.row_base, self.row_prompt, self.kv_base, self.kv_prompt))
        flat = host.to(device)
        n, m = self.row_base.numel(), self.kv_base.numel()
        parts = flat.split((n, n, m, m))
        return attrs.evolve(
            self, row_base=parts[0], row_prompt=parts[1], kv_base=parts[2], kv_prompt=parts[3]
        )
