"""Where a request's K/V lives in the pool: one strategy, chosen once (``--kv-sharing``).

- :class:`PerDepth` (``none``): every position keeps its K/V in all ``T * L`` planes; a request's
  pages are one block table, position ``p`` in ``blocks[p // bs]``.
- :class:`SharedDecode` (``last``): prompt positions keep all ``T * L`` planes (in the blocks the
  prompt reaches; its last block also holds the first generated positions), later generated
  positions keep ``L`` shared planes in *generated blocks*, a quarter of a page each
  (``runtime_glue.engine.shared_blocks``), which every loop overwrites in turn
  (``hal.shared_kv``: loop ``t``'s table points a generated block at the loop plane it lies in).

The strategy answers every question whose answer depends on that choice: what a request lacks
for its first ``n`` positions, allocating it (all or none), whether a new request fits, what to
free or trim, how many generated positions a step may compute at once, whether a request could
ever fit the pool, and the addressing of a step's rows (which physical block a (loop, layer,
block) reads). The scheduler, the validation, the step builder and the graphs ask it and never
test the option themselves.
"""

from __future__ import annotations

from hal.interfaces import Fence
from hal.shared_kv import build_shared_addressing, check_kv_sharing, prompt_blocks
from hal.types import AttentionMetadata, KVAddressing, KVLayout
from runtime_glue.engine.kv_manager import BlockAllocator
from runtime_glue.engine.request import Request
from runtime_glue.engine.shared_blocks import SharedBlocks


class PerDepth:
    """Every position in every (loop, layer) plane, paged by one block table per request."""

    tables = 1  # addressing tables per step: one metadata serves every loop

    def __init__(self, allocator: BlockAllocator, loops: int, layers: int) -> None:
        self.allocator, self.loops, self.layers = allocator, loops, layers
        self.block_size = allocator.block_size

    # -- what a request needs --------------------------------------------------------------

    def needs(self, req: Request, tokens: int) -> tuple[int, int]:
        """The pages and generated blocks ``req`` lacks for its first ``tokens`` positions."""
        return max(0, self.allocator.blocks_for(tokens) - len(req.blocks)), 0

    def chunk_limit(self, req: Request) -> int | None:
        """The most positions of ``req`` one step may compute (None: no limit of ours)."""
        return None

    def pool_refusal(self, prompt_len: int, tokens: int, pool_blocks: int) -> str | None:
        """Why a request of ``tokens`` positions could never fit ``pool_blocks``; None if it can."""
        if self.allocator.blocks_for(tokens) <= pool_blocks:
            return None
        return (
            f"needs {tokens} tokens of KV cache, but the whole pool holds "
            f"{pool_blocks * self.block_size} tokens ({pool_blocks} blocks of {self.block_size})"
        )

    # -- allocation ------------------------------------------------------------------------

    def take(self, req: Request, tokens: int) -> bool:
        """Allocate what ``req`` lacks for its first ``tokens`` positions: all or none."""
        need, gen_need = self.needs(req, tokens)
        pages = self.allocator.allocate(need) if need else []
        if pages is None:
            return False
        gen = self._allocate_generated(gen_need)
        if gen is None:
            self.allocator.free_after(pages, None)  # never used
            return False
        req.blocks += pages
        req.gen_blocks += gen
        return True

    def admit(self, req: Request, cached: list[int], running: int) -> bool:
        """Give a starting ``req`` its pages past the ``cached`` ones, leaving a page for each
        of the ``running`` requests to grow into; False (nothing taken) if they cannot be had."""
        need, gen_need = self.needs(req, req.num_tokens)
        need -= len(cached)
        self.allocator.reclaim()
        if not self._fits(need, gen_need, running):
            return False
        fresh = self.allocator.allocate(need)
        gen = None if fresh is None else self._allocate_generated(gen_need)
        if fresh is None or gen is None:
            if fresh:
                self.allocator.free_after(fresh, None)
            return False
        req.blocks, req.gen_blocks = cached + fresh, gen
        return True

    def release(self, req: Request, fence: Fence | None) -> None:
        generated = req.gen_blocks
        if req.blocks:  # its pages first, then its generated blocks, as they were taken
            self.allocator.free_after(req.blocks, fence)
        req.blocks, req.gen_blocks = [], []
        if generated:
            self._free_generated(generated, fence)

    # What a placement with generated blocks refines (here every block is a page).

    def _fits(self, need: int, gen_need: int, running: int) -> bool:
        return need + running <= self.allocator.num_free

    def _allocate_generated(self, n: int) -> list[int] | None:
        return []

    def _free_generated(self, blocks: list[int], fence: Fence | None) -> None:
        raise RuntimeError(f"generated blocks {blocks} in a placement without them")

    def trim(self, req: Request, tokens: int, fence: Fence | None) -> None:
        """Free ``req``'s pages past its first ``tokens`` positions (rejected drafts only)."""
        keep = self.allocator.blocks_for(tokens)
        if len(req.blocks) > keep:
            self.allocator.free_after(req.blocks[keep:], fence)
            req.blocks = req.blocks[:keep]

    @property
    def num_pending(self) -> int:
        return self.allocator.num_pending

    def reclaim(self, wait: bool = False) -> None:
        self.allocator.reclaim(wait=wait)

    # -- addressing ------------------------------------------------------------------------

    def entry(self, req: Request, n: int, ctx: int, loop: int = 0) -> tuple:
        """One attention entry: ``n`` rows of ``req`` after ``ctx`` computed positions, run
        at ``loop`` by a step that calls every layer at loop 0 (depth-wise rows,
        docs/depth-batching.md); a plain step's entries are at loop 0 and run every loop."""
        if not 0 <= loop < self.loops:
            raise ValueError(f"loop must be in [0, {self.loops}), got {loop}")
        return (n, ctx, req.blocks, loop)

    def addressing(self, entries: list[tuple]) -> KVAddressing:
        """The step's addressing. An entry at loop ``t`` has its blocks shifted by ``t`` loops'
        planes (``t * layers * num_blocks``): called with layer ``l``'s loop-0 plane, its rows
        reach plane ``t * layers + l`` (block ids may reach past a plane: ``AttentionMetadata``),
        so rows at different loops share one pass over the layers. Each entry's slots are
        checked against its own plane first."""
        slots = self.allocator.num_blocks * self.block_size
        plain = [(n, ctx, blocks) for n, ctx, blocks, _ in entries]
        meta = AttentionMetadata.build(self.block_size, plain, slots)  # checked on the host
        if any(loop for *_, loop in entries):
            shift = self.layers * self.allocator.num_blocks
            shifted = [(n, c, [b + loop * shift for b in bl]) for n, c, bl, loop in entries]
            reach = ((self.loops - 1) * self.layers + 1) * slots  # from layer 0's plane
            meta = AttentionMetadata.build(self.block_size, shifted, reach)
        return KVAddressing.uniform(meta, self.layers, slots)

    # -- bookkeeping -----------------------------------------------------------------------

    def audit(self, running: list[Request], reserved: list[int]) -> None:
        self.allocator.audit([req.blocks for req in running] + [reserved])

    def describe(self, layout: KVLayout) -> str:
        return ""

    @property
    def generated(self) -> SharedBlocks | None:
        """The generated blocks' allocator (None: every block is a page)."""
        return None


class SharedDecode(PerDepth):
    """Prompt positions in every plane; generated positions in one shared plane per layer."""

    def __init__(
        self, allocator: BlockAllocator, loops: int, layers: int, shared: SharedBlocks
    ) -> None:
        super().__init__(allocator, loops, layers)
        self.shared = shared
        self.tables = loops  # one addressing table per loop

    def needs(self, req: Request, tokens: int) -> tuple[int, int]:
        blocks = self.allocator.blocks_for(tokens)
        split = min(blocks, prompt_blocks(len(req.prompt_ids), self.block_size))
        return max(0, split - len(req.blocks)), max(0, blocks - split - len(req.gen_blocks))

    def chunk_limit(self, req: Request) -> int | None:
        # A generated position must see the earlier ones' last-loop K/V, which a chunk of them
        # computed together does not have yet: one at a time.
        return None if req.num_computed < len(req.prompt_ids) else 1

    def pool_refusal(self, prompt_len: int, tokens: int, pool_blocks: int) -> str | None:
        blocks = prompt_blocks(prompt_len, self.block_size)
        blocks += self.shared.physical_for(self.allocator.blocks_for(tokens) - blocks)
        if blocks <= pool_blocks:
            return None
        return (
            f"needs {blocks} blocks of KV cache under kv sharing, but the whole pool has "
            f"{pool_blocks} blocks of {self.block_size}"
        )

    def _fits(self, need: int, gen_need: int, running: int) -> bool:
        return self.shared.fits(need, gen_need + running)

    def _allocate_generated(self, n: int) -> list[int] | None:
        return self.shared.allocate(n) if n else []

    def _free_generated(self, blocks: list[int], fence: Fence | None) -> None:
        self.shared.free_after(blocks, fence)

    def trim(self, req: Request, tokens: int, fence: Fence | None) -> None:
        total = self.allocator.blocks_for(tokens)
        keep = total - min(total, prompt_blocks(len(req.prompt_ids), self.block_size))
        if len(req.gen_blocks) > keep:
            self.shared.free_after(req.gen_blocks[keep:], fence)
            req.gen_blocks = req.gen_blocks[:keep]

    @property
    def num_pending(self) -> int:
        return self.allocator.num_pending + self.shared.num_pending

    def reclaim(self, wait: bool = False) -> None:
        self.shared.reclaim(wait=wait)
        self.allocator.reclaim(wait=wait)

    def entry(self, req: Request, n: int, ctx: int, loop: int = 0) -> tuple:
        if not 0 <= loop < self.loops:
            raise ValueError(f"loop must be in [0, {self.loops}), got {loop}")
        return (n, ctx, req.blocks, len(req.prompt_ids), req.gen_blocks, loop)

    def addressing(self, entries: list[tuple]) -> KVAddressing:
        """Loop ``t``'s tables for each entry at loop ``o``: loop ``t + o``'s (depth-wise rows
        run one loop a step, from loop 0's metadata)."""
        nb = self.allocator.num_blocks
        requests = [e[:5] for e in entries]
        offsets = [e[5] for e in entries]
        return build_shared_addressing(
            self.block_size, requests, nb, self.layers, self.loops, offsets
        )

    def audit(self, running: list[Request], reserved: list[int]) -> None:
        self.shared.audit([req.gen_blocks for req in running])
        self.allocator.audit([req.blocks for req in running] + [reserved, self.shared.homes])

    def describe(self, layout: KVLayout) -> str:
        loops = self.loops
        return (
            f"; kv sharing last: a prompt block keeps {layout.num_planes} planes, a generated "
            f"block {layout.num_planes // loops} (1/{loops} of a block, "
            f"{layout.bytes_per_token // loops} bytes/token): the pool holds "
            f"{layout.num_blocks} prompt blocks or {layout.num_blocks * loops} generated blocks"
        )

    @property
    def generated(self) -> SharedBlocks | None:
        return self.shared


KVPlacement = PerDepth  # the interface: SharedDecode refines it


def placement_for(args, allocator: BlockAllocator, cfg) -> KVPlacement:
    """The strategy ``args.kv_sharing`` (``--kv-sharing``) names, over ``allocator`` (an
    ``LLM`` builds it once and its variants share it, as they share the pool)."""
    loops, layers = cfg.total_ut_steps, cfg.num_hidden_layers
    if check_kv_sharing(args.kv_sharing) == "last":
        return SharedDecode(allocator, loops, layers, SharedBlocks(allocator, loops))
    return PerDepth(allocator, loops, layers)
