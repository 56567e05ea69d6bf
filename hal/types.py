"""Frozen value types shared by the HAL, the drivers and the runtime."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import torch

if TYPE_CHECKING:
    from hal.interfaces import Driver


@attrs.frozen
class ProbeResult:
    """Whether a driver can run here; ``reason`` says why not (and what to install or set)."""

    available: bool
    reason: str = ""
    # An emulated driver (a test double for absent hardware) is never chosen by ``auto``.
    emulated: bool = False


@attrs.frozen
class DriverSpec:
    """What a plugin hands to the registry.

    ``probe`` must be cheap and must never import a vendor stack; ``create`` builds the driver
    (still without touching the device: the device initialises lazily).
    """

    name: str
    probe: Callable[[], ProbeResult]
    create: Callable[..., Driver]
    description: str = ""


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
class SequenceSlice:
    """One request's share of a step: rows ``[query_start, query_start + query_len)`` of the
    flat token batch, placed after ``context_len`` tokens already in the cache.

    ``kv_slots`` (device tensor, int64, ``[context_len + query_len]``) are the cache slots of
    every position the queries may attend to, in position order: the gather index for all
    planes, built once per step from the block table.
    """

    query_start: int
    query_len: int
    context_len: int
    kv_slots: torch.Tensor

    @property
    def kv_len(self) -> int:
        return self.context_len + self.query_len


@attrs.frozen(eq=False)
class AttentionMetadata:
    """Everything attention needs for one step; identical for all T * L planes of that step."""

    seqs: tuple[SequenceSlice, ...]
    slot_mapping: torch.Tensor  # [N] int64: cache slot each new token's K/V is written to
    num_tokens: int
