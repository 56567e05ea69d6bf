"""Generated blocks under decode KV sharing (``--kv-sharing last``): a quarter of a block each.

A prompt block keeps its positions in all T * L planes; a generated block keeps them in L
shared planes, one per layer (``hal.shared_kv``). So a physical block of the pool holds one
prompt block or T generated blocks: generated block ``g`` lies in loop plane
``g // num_blocks`` of physical block ``g % num_blocks``. ``SharedBlocks`` takes physical
blocks from the pool's ``BlockAllocator`` as it needs them, hands out their T generated
blocks, and gives a physical block back once all T are free again, each one after the fence of
the last step that used it. Generated blocks are never prefix-cached (prompt blocks are, as
without sharing). Validates before it mutates; ``audit`` checks every invariant.
"""

from __future__ import annotations

from hal.interfaces import Fence
from runtime_glue.engine.kv_manager import BlockAllocator


class SharedBlocks:
    def __init__(self, pool: BlockAllocator, loops: int) -> None:
        if loops < 1:
            raise ValueError(f"loops must be >= 1, got {loops}")
        self.pool = pool
        self.loops = loops
        self.block_size = pool.block_size
        self._homes: set[int] = set()  # physical blocks carved into generated blocks
        self._free: list[int] = []  # generated blocks to hand out (in homes)
        self._used: set[int] = set()
        self._pending: dict[int, Fence | None] = {}

    # -- geometry and counts ---------------------------------------------------------------

    def home(self, block: int) -> int:
        """The physical block a generated block lies in."""
        return block % self.pool.num_blocks

    def blocks_of(self, home: int) -> list[int]:
        return [j * self.pool.num_blocks + home for j in range(self.loops)]

    @property
    def num_free(self) -> int:
        """Generated blocks that can be had now without taking a physical block."""
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Generated blocks that can be had now, physical blocks of the pool included."""
        self.reclaim()
        return len(self._free) + self.loops * self.pool.num_free

    @property
    def homes(self) -> list[int]:
        """The physical blocks this allocator holds (one table for the pool's audit)."""
        return sorted(self._homes)

    @property
    def num_in_use(self) -> int:
        return len(self._used)

    def physical_for(self, generated_blocks: int) -> int:
        """Physical blocks that many generated blocks take at most (bounds, not allocation)."""
        return -(-generated_blocks // self.loops)

    # -- allocation ------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """``n`` generated blocks, or None when they cannot be had now ("not now")."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} generated blocks")
        self.reclaim()
        missing = max(0, n - len(self._free))
        homes_needed = self.physical_for(missing)
        if homes_needed:
            pages = self.pool.allocate(homes_needed)
            if pages is None:
                return None
            for page in pages:
                self._homes.add(page)
                self._free += self.blocks_of(page)
        # Fill the fullest homes first, so that homes empty out and go back to the pool.
        idle: dict[int, int] = {}
        for b in self._free:
            idle[self.home(b)] = idle.get(self.home(b), 0) + 1
        self._free.sort(key=lambda b: (idle[self.home(b)], b))
        blocks, self._free = self._free[:n], self._free[n:]
        self._used.update(blocks)
        return blocks

    def fits(self, prompt_blocks: int, generated_blocks: int) -> bool:
        """Whether that many prompt blocks and generated blocks can be had now, together."""
        self.reclaim()
        spare = self.pool.num_free - prompt_blocks
        return spare >= 0 and spare * self.loops + len(self._free) >= generated_blocks

    def free_after(self, blocks: list[int], fence: Fence | None) -> None:
        stray = [b for b in blocks if b not in self._used]
        if stray or len(set(blocks)) != len(blocks):
            raise RuntimeError(
                f"freeing generated blocks that are not allocated: {stray or blocks}"
            )
        for b in blocks:
            self._used.discard(b)
            self._pending[b] = fence
        self.reclaim()

    def reclaim(self, wait: bool = False) -> int:
        """Free the generated blocks whose fence completed; give back homes left empty."""
        moved = 0
        for b, fence in list(self._pending.items()):
            if fence is not None and wait:
                fence.wait()
            if fence is None or fence.done():
                del self._pending[b]
                self._free.append(b)
                moved += 1
        if moved:
            free = set(self._free)
            for home in [h for h in self._homes if all(b in free for b in self.blocks_of(h))]:
                self._homes.discard(home)
                self._free = [b for b in self._free if self.home(b) != home]
                free -= set(self.blocks_of(home))
                self.pool.free_after([home], None)
        return moved

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def audit(self, tables: list[list[int]]) -> None:
        """Raise AssertionError unless the generated blocks are consistent with ``tables``,
        the generated block tables of every live request."""
        used = [b for table in tables for b in table]
        assert len(used) == len(set(used)), f"a generated block is in two tables: {used}"
        assert set(used) == self._used, f"in use {sorted(self._used)} != the tables' {used}"
        every = [*self._used, *self._pending, *self._free]
        assert len(every) == len(set(every)), "a generated block is in two states"
        assert {self.home(b) for b in every} <= self._homes, "a generated block has no home"
        assert len(every) == self.loops * len(self._homes), (
            f"{len(every)} generated blocks in {len(self._homes)} homes of {self.loops}"
        )
        for home in self._homes:
            assert self.pool._refs.get(home) == 1, f"home {home} is not held once in the pool"
            assert home not in self.pool._hash_of, f"home {home} is prefix-cached"
