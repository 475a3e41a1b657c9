"""CacheManager: pages by token count, one slot per request, all-or-nothing allocation, free and usage."""

import pytest

from deltaserve.cache.manager import CacheManager
from deltaserve.cache.sizing import CachePlan
from deltaserve.request import Request
from deltaserve.sampling_params import SamplingParams


def request(req_id="a", prompt_len=5):
    return Request(req_id, list(range(prompt_len)), SamplingParams())


@pytest.mark.parametrize("computed, new, held, needed", [
    (0, 1, 0, 1), (0, 4, 0, 1), (0, 5, 0, 2), (3, 1, 1, 0), (4, 1, 1, 1), (0, 0, 0, 0),
])
def test_blocks_needed_counts_pages_beyond_those_held(computed, new, held, needed):
    manager = CacheManager(num_blocks=8, num_slots=2, block_size=4)
    req = request()
    req.num_computed_tokens = computed
    req.block_ids = manager.block_pool.allocate(held)
    assert manager.blocks_needed(req, new) == needed


def test_allocate_slots_gives_pages_and_one_slot_in_order():
    manager = CacheManager(num_blocks=8, num_slots=2, block_size=4)
    req = request()
    first = manager.allocate_slots(req, 5)
    slot = req.state_slot
    req.num_computed_tokens = 5
    second = manager.allocate_slots(req, 4)
    assert len(first) == 2 and len(second) == 1 and req.block_ids == first + second
    assert req.state_slot == slot and manager.num_free_slots == 1 and manager.usage == 3 / 8


def test_allocate_slots_returns_none_and_changes_nothing_when_short():
    manager = CacheManager(num_blocks=2, num_slots=2, block_size=4)
    req = request()
    assert manager.allocate_slots(req, 9) is None
    assert req.block_ids == [] and req.state_slot is None
    assert manager.num_free_blocks == 2 and manager.num_free_slots == 2


def test_no_free_slot_means_no_admission():
    manager = CacheManager(num_blocks=8, num_slots=1, block_size=4)
    manager.allocate_slots(request("a"), 1)
    assert not manager.can_allocate(request("b"), 1) and manager.allocate_slots(request("b"), 1) is None


def test_free_returns_everything_and_is_safe_twice():
    manager = CacheManager.from_plan(CachePlan(num_blocks=4, num_slots=2, block_size=4, bytes_per_block=1,
                                               bytes_per_slot=1))
    req = request()
    manager.allocate_slots(req, 16)
    assert manager.usage == 1.0
    manager.free(req)
    manager.free(req)
    assert req.block_ids == [] and req.state_slot is None
    assert manager.num_free_blocks == 4 and manager.num_free_slots == 2 and manager.usage == 0.0
