"""BlockPool and StatePool: distinct ids, exhaustion, and bookkeeping bugs caught at free()."""

import pytest

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.state_pool import StatePool


def test_block_pool_hands_out_distinct_ids_and_takes_them_back():
    pool = BlockPool(5)
    first, second = pool.allocate(3), pool.allocate(2)
    assert sorted(first + second) == [0, 1, 2, 3, 4] and pool.num_free_blocks == 0
    pool.free(first)
    assert pool.num_free_blocks == 3 and sorted(pool.allocate(3)) == sorted(first)


def test_block_pool_hands_out_never_used_pages_first_then_returned_ones_oldest_first():
    pool = BlockPool(6)
    first = pool.allocate(4)
    pool.free([first[2], first[0]])
    assert pool.allocate(3) == [4, 5, first[2]]  # the two never used, then the oldest returned
    assert pool.num_free_blocks == 1 and pool.allocate(1) == [first[0]] and pool.num_free_blocks == 0


def test_a_pool_of_a_hundred_million_pages_holds_a_byte_a_page():
    """A small model's GPU cache has tens of millions of pages: no per-page Python objects (a list of ids was
    ~60 bytes a page and seconds to build)."""
    pool = BlockPool(100_000_000)
    assert pool.num_free_blocks == 100_000_000 and len(pool._freed) == 0
    assert pool.allocate(3) == [0, 1, 2] and pool.num_free_blocks == 100_000_000 - 3


def test_block_pool_refuses_more_than_free_and_takes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(RuntimeError, match=r"allocate\(2\): 1 of 4 pages are free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


@pytest.mark.parametrize("bad_ids, match", [([7], "not in \\[0, 4\\)"), ([-1], "not in"), ([0, 0], "double free")])
def test_block_pool_rejects_foreign_ids_and_double_free(bad_ids, match):
    pool = BlockPool(4)
    pool.allocate(4)
    with pytest.raises(ValueError, match=match):
        pool.free(bad_ids)


def test_block_pool_rejects_freeing_a_never_allocated_block():
    with pytest.raises(ValueError, match="block 2 is already free"):
        BlockPool(4).free([2])


def test_state_pool_hands_out_each_slot_once():
    pool = StatePool(3)
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.num_free_slots == 0
    with pytest.raises(RuntimeError, match="all 3 KDA state slots are in use"):
        pool.allocate()
    pool.free(slots[1])
    assert pool.allocate() == slots[1]


@pytest.mark.parametrize("slot, match", [(3, "not in \\[0, 3\\)"), (None, "not in"), (1, "double free")])
def test_state_pool_rejects_foreign_slot_and_double_free(slot, match):
    pool = StatePool(3)
    pool.allocate()
    with pytest.raises(ValueError, match=match):
        pool.free(slot)


@pytest.mark.parametrize("make", [BlockPool, StatePool])
def test_pools_need_a_positive_size(make):
    with pytest.raises(ValueError, match="must be a positive integer"):
        make(0)
