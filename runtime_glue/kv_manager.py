"""Page bookkeeping for the per-depth paged KV cache.

One block id names the same block in all T * L planes, so a request owns a list of block ids
(its block table) and its token at position p lives in slot ``table[p // bs] * bs + p % bs``
of every plane. Pages go back to the free list only after the fence of the last step that
used them has completed.
"""

from __future__ import annotations

import math
from collections import deque

from hal.interfaces import Fence


class BlockAllocator:
    """Free list plus pages waiting for their fence. Validates before it mutates."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owned: set[int] = set()
        self._pending: list[tuple[Fence, list[int]]] = []

    @property
    def num_free(self) -> int:
        """Pages that can be allocated now (pending pages are not yet free)."""
        return len(self._free)

    @property
    def num_pending(self) -> int:
        return sum(len(blocks) for _, blocks in self._pending)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` pages, or None when not enough are free now ("not now")."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_blocks:
            raise ValueError(f"needs {n} blocks, but the pool has {self.num_blocks}")
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        self._owned.update(blocks)
        return blocks

    def free_after(self, blocks: list[int], fence: Fence | None) -> None:
        """Return ``blocks`` once ``fence`` (the last step that used them) has completed."""
        stray = [b for b in blocks if b not in self._owned]
        if stray or len(set(blocks)) != len(blocks):
            raise RuntimeError(f"freeing blocks that are not allocated: {stray or blocks}")
        self._owned.difference_update(blocks)
        if fence is None or fence.done():
            self._free.extend(blocks)
        else:
            self._pending.append((fence, list(blocks)))

    def reclaim(self, wait: bool = False) -> int:
        """Move pages whose fence has completed to the free list; returns how many moved."""
        still, moved = [], 0
        for fence, blocks in self._pending:
            if wait:
                fence.wait()
            if fence.done():
                self._free.extend(blocks)
                moved += len(blocks)
            else:
                still.append((fence, blocks))
        self._pending = still
        return moved
