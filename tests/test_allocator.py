"""Property test of the block allocator and slot mapping under random request lifecycles."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hal.interfaces import Fence
from hal.types import AttentionMetadata
from runtime_glue.engine.kv_manager import BlockAllocator


class _Fence(Fence):
    def __init__(self):
        self.complete = False

    def done(self):
        return self.complete

    def wait(self):
        self.complete = True


ops = st.lists(
    st.tuples(st.sampled_from(["add", "finish", "abort", "tick"]), st.integers(1, 80)), max_size=60
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 12), block_size=st.sampled_from([16, 32]))
def test_random_lifecycles_never_double_allocate_or_leak_a_page(ops, num_blocks, block_size):
    alloc = BlockAllocator(num_blocks, block_size)
    live: dict[int, list[int]] = {}
    fences: list[_Fence] = []
    for i, (op, n) in enumerate(ops):
        if op == "add":
            want = alloc.blocks_for(n)
            if want > num_blocks:
                with pytest.raises(ValueError, match=f"needs {want} blocks, but the pool has"):
                    alloc.allocate(want)
                continue
            blocks = alloc.allocate(want)
            if blocks is not None:
                live[i] = blocks
        elif op in ("finish", "abort") and live:
            blocks = live.pop(sorted(live)[n % len(live)])
            fence = _Fence()
            fences.append(fence)
            alloc.free_after(blocks, fence)
        elif op == "tick" and fences:
            fences[n % len(fences)].wait()
            alloc.reclaim()
        owned = [b for blocks in live.values() for b in blocks]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        # A step writing every live request's whole pages: the engine's slot mapping checks on
        # the host that each slot is in the pool and that none is written twice.
        full = [(len(b) * block_size, 0, b) for b in live.values()]
        AttentionMetadata.build(block_size, full, num_blocks * block_size)
        assert len(owned) + alloc.num_free + alloc.num_pending == num_blocks
    for blocks in live.values():
        alloc.free_after(blocks, None)
    alloc.reclaim(wait=True)
    assert alloc.num_free == num_blocks


def test_freeing_a_page_twice_is_refused_before_anything_changes():
    alloc = BlockAllocator(4, 16)
    blocks = alloc.allocate(2)
    alloc.free_after(blocks, None)
    with pytest.raises(RuntimeError, match="freeing blocks that are not allocated"):
        alloc.free_after(blocks, None)
    assert alloc.num_free == 4


def test_a_reservation_is_shared_grows_to_the_largest_need_and_ends_with_its_last_holder():
    alloc = BlockAllocator(8, 16)
    alloc.allocate(3)  # a request's pages
    first = alloc.reserve(2)
    second = alloc.reserve(5)  # another engine on the pool needs more: the same pages, and more
    assert first is not None and second is not None and second[:2] == first
    assert alloc.reserved == second and alloc.num_free == 0
    assert alloc.reserve(6) is None and alloc.reserved == second  # cannot be had: nothing changes
    alloc.release_reserved(None)
    assert alloc.num_free == 0  # one holder left
    alloc.release_reserved(None)
    assert alloc.num_free == 5 and alloc.reserved == []
