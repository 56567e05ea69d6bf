"""Page bookkeeping for the per-depth paged KV cache, with automatic prefix caching.

One block id names the same block in all T * L planes, so a request owns a list of block ids
(its block table) and its token at position p lives in slot ``table[p // bs] * bs + p % bs``
of every plane.

Prefix caching: a full block of prompt positions is named by a hash chained over its tokens and
every token before it, salted with what else decides its K/V (the model, the execution plan:
the engine's ``prefix_salt``).
Requests whose prompts share full blocks share those pages read-only, counted by references. A
block whose last user is done stays cached until the pool needs its page, least recently used
first; a block in use is never evicted or written. Only prompt positions are cached: in
deterministic mode a generated position runs other kernels than the same token as a prompt
position would (runtime_glue.ouro.plan), so its K/V is not what a later prompt would compute.

Every page, cached or not, becomes reusable only after the fence of the last step that used it
has completed.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque

from hal.interfaces import Fence


class BlockAllocator:
    """Free pages, pages in use (with their reference counts), pages waiting for a fence, and
    cached pages no request uses (evictable). Validates before it mutates."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs: dict[int, int] = {}  # pages in use -> how many requests use them
        self._pending: dict[int, Fence | None] = {}  # unused pages waiting for their fence
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused: LRU first
        self._hash_of: dict[int, bytes] = {}  # cached page -> its hash
        self._page_of: dict[bytes, int] = {}  # hash -> the cached page holding it
        self.reserved: list[int] = []  # pages set aside for padding rows (:meth:`reserve`)
        self._holders = 0

    # -- counts ----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now: free ones, and cached ones no request uses."""
        return len(self._free) + len(self._evictable)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_in_use(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # -- prefix caching --------------------------------------------------------------------

    def block_hashes(self, tokens: list[int], salt: bytes) -> list[bytes]:
        """The chained hash of every full block of ``tokens``, starting from ``salt``."""
        hashes, parent, bs = [], salt, self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            block = ",".join(map(str, tokens[start : start + bs])).encode()
            parent = hashlib.sha256(parent + b"|" + block).digest()
            hashes.append(parent)
        return hashes

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The pages holding the longest cached prefix of ``hashes`` (nothing changes)."""
        pages = []
        for h in hashes:
            if h not in self._page_of:
                break
            pages.append(self._page_of[h])
        return pages

    def share(self, pages: list[int]) -> None:
        """Start using cached ``pages`` (from :meth:`cached_prefix`) read-only."""
        for page in pages:
            if page not in self._hash_of:
                raise RuntimeError(f"page {page} is not cached")
        for page in pages:
            self._evictable.pop(page, None)
            self._pending.pop(page, None)
            self._refs[page] = self._refs.get(page, 0) + 1

    def register(self, page: int, block_hash: bytes) -> None:
        """``page``, in use and now full of computed prompt tokens, holds ``block_hash``.
        A hash another page already holds stays with that page."""
        if page not in self._refs:
            raise RuntimeError(f"registering page {page}, which is not in use")
        if block_hash not in self._page_of and page not in self._hash_of:
            self._page_of[block_hash] = page
            self._hash_of[page] = block_hash

    # -- allocation ------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages, or None when not enough can be had now ("not now"): free pages
        first, then cached pages no request uses, least recently used first."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_blocks:
            raise ValueError(f"needs {n} blocks, but the pool has {self.num_blocks}")
        self.reclaim()
        if n > self.num_free:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                pages.append(self._free.popleft())
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
                pages.append(page)
        for page in pages:
            self._refs[page] = 1
        return pages

    def reserve(self, n: int) -> list[int] | None:
        """``n`` pages for step graphs' padding rows, or None when the pool cannot spare them.
        Every engine on this pool (an ``LLM`` and its variants, which run one at a time) holds
        the same pages: the reservation grows to the largest need and is not counted again per
        engine. The pages stay in use until the last holder calls :meth:`release_reserved`."""
        more = n - len(self.reserved)
        if more > 0:
            pages = self.allocate(more)
            if pages is None:
                return None
            self.reserved += pages
        self._holders += 1
        return self.reserved[:n]

    def release_reserved(self, fence: Fence | None) -> None:
        """A holder of the reservation no longer needs it; the last one frees its pages."""
        self._holders -= 1
        if self._holders == 0 and self.reserved:
            pages, self.reserved = self.reserved, []
            self.free_after(pages, fence)

    def free_after(self, pages: list[int], fence: Fence | None) -> None:
        """A request stops using ``pages``; one no request uses any more becomes reusable (free,
        or evictable if cached) once ``fence``, the last step that used it, has completed."""
        stray = [p for p in pages if p not in self._refs]
        if stray or len(set(pages)) != len(pages):
            raise RuntimeError(f"freeing blocks that are not allocated: {stray or pages}")
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] == 0:
                del self._refs[page]
                self._pending[page] = fence
        self.reclaim()

    def audit(self, tables: list[list[int]]) -> None:
        """Raise AssertionError unless the pages are consistent with ``tables``, the block
        tables of every live request: each page in exactly one of in use / pending / free /
        evictable, reference counts equal to the tables' uses, the hash maps each other's
        inverse. Tests call it after every step; it costs O(pages)."""
        uses: dict[int, int] = {}
        for table in tables:
            for page in table:
                uses[page] = uses.get(page, 0) + 1
        assert uses == self._refs, f"reference counts {self._refs} != the tables' uses {uses}"
        states = [set(self._refs), set(self._pending), set(self._free), set(self._evictable)]
        assert sum(map(len, states)) == self.num_blocks == len(set().union(*states)), (
            f"pages are not partitioned: in use {states[0]}, pending {states[1]}, "
            f"free {states[2]}, evictable {states[3]}"
        )
        assert len(self._free) == len(states[2]), "a page is free twice"
        assert {p: h for h, p in self._page_of.items()} == self._hash_of, "hash maps disagree"
        assert not set(self._hash_of) & states[2], "a free page is still cached"
        assert set(self._evictable) <= set(self._hash_of), "an evictable page is not cached"

    def reclaim(self, wait: bool = False) -> int:
        """Move pages whose fence has completed to the free or evictable pages; returns how
        many moved."""
        moved = 0
        for page, fence in list(self._pending.items()):
            if fence is not None and wait:
                fence.wait()
            if fence is None or fence.done():
                del self._pending[page]
                if page in self._hash_of:
                    self._evictable[page] = None  # the most recently used end
                else:
                    self._free.append(page)
                moved += 1
        return moved
