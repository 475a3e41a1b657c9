"""The prefix index: chained block hashes, shared pages by reference count, LRU eviction of unreferenced pages only;
the KDA snapshot cache; and the CacheManager's lookup (pages AND a snapshot at exactly the prefix's end)."""

import pytest

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.manager import CacheManager
from deltaserve.cache.prefix_cache import ROOT_HASH, PrefixCache, extend_block_hashes, hash_block
from deltaserve.cache.snapshot_cache import SnapshotCache
from deltaserve.request import Request
from deltaserve.sampling_params import SamplingParams

BS = 4


def hashes(token_ids, block_size=BS):
    out = []
    extend_block_hashes(out, token_ids, block_size)
    return out


def test_block_hash_names_the_whole_prefix():
    a, b = hashes([1, 2, 3, 4, 5, 6, 7, 8]), hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and a[0] != b[0]
    assert a[1] != b[1], "the same second block after another first block is another prefix"
    assert a[0] == hash_block(ROOT_HASH, [1, 2, 3, 4]) and a[1] == hash_block(a[0], [5, 6, 7, 8])


def test_block_hashes_cover_full_blocks_only_and_extend_incrementally():
    tokens = list(range(100, 123))  # 5 full blocks of 4 and 3 tokens
    grown = []
    for end in range(len(tokens) + 1):
        extend_block_hashes(grown, tokens[:end], BS)
        assert len(grown) == end // BS
    assert grown == hashes(tokens)


def test_block_hashes_extend_from_the_tokens_after_those_covered():
    """The manager passes only the tokens from the first uncovered block on (a long prompt is not copied each step):
    the same hashes as from the whole sequence, and an offset past the covered tokens is refused."""
    tokens = list(range(200, 237))
    grown = []
    for end in range(len(tokens) + 1):
        covered = len(grown) * BS
        extend_block_hashes(grown, tokens[covered:end], BS, covered)
    assert grown == hashes(tokens)
    with pytest.raises(ValueError, match="cover 0 tokens"):
        extend_block_hashes([], tokens[4:], BS, 4)


def test_request_token_ids_from_is_a_suffix_of_all_token_ids():
    req = Request("r", list(range(10)), SamplingParams(max_tokens=8))
    req.output_token_ids.extend([50, 51, 52])
    for start in range(15):
        assert req.token_ids_from(start) == req.all_token_ids[start:]


def test_lookup_returns_the_longest_cached_run_from_the_first_block():
    cache = PrefixCache(BlockPool(8))
    chain = hashes(list(range(16)))
    pages = cache.allocate(4)
    for block_hash, page in zip(chain[:2], pages):
        cache.insert(block_hash, page)
    cache.insert(chain[3], pages[3])  # a hole at block 2: block 3 is unreachable
    assert cache.lookup(chain) == pages[:2]
    assert cache.lookup(hashes(list(range(1, 17)))) == []


def test_released_cached_pages_stay_indexed_and_count_as_free():
    pool = BlockPool(4)
    cache = PrefixCache(pool)
    chain = hashes(list(range(8)))
    pages = cache.allocate(3)
    cache.insert(chain[0], pages[0])
    cache.insert(chain[1], pages[1])
    cache.release(pages)
    assert pool.num_free_blocks == 2, "only the unindexed page went back to the free list"
    assert cache.num_free_blocks == 4 and cache.num_unreferenced_blocks == 2
    assert cache.lookup(chain) == pages[:2]


def test_shared_pages_are_counted_and_survive_one_holder_leaving():
    cache = PrefixCache(BlockPool(4))
    chain = hashes(list(range(4)))
    (page,) = cache.allocate(1)
    cache.insert(chain[0], page)
    cache.acquire([page])
    assert cache.ref_count(page) == 2
    cache.release([page])
    assert cache.ref_count(page) == 1 and cache.num_unreferenced_blocks == 0
    assert cache.num_reclaimed_by([page]) == 0
    cache.release([page])
    assert cache.num_reclaimed_by([page]) == 1
    cache.acquire([page])
    assert cache.num_unreferenced_blocks == 0 and cache.ref_count(page) == 1
    cache.release([page])


def test_allocate_takes_free_pages_first_then_evicts_least_recently_released():
    cache = PrefixCache(BlockPool(4))
    chain = hashes(list(range(16)))
    pages = cache.allocate(4)
    for block_hash, page in zip(chain, pages):
        cache.insert(block_hash, page)
    cache.release(pages[:2])  # a sequence's pages are released last first: page 1, then page 0
    cache.release(pages[2:])
    assert cache.num_free_blocks == 4 and cache.num_evictions == 0
    assert cache.allocate(1) == [pages[1]], "the tail of the first sequence is the least recently released"
    assert cache.num_evictions == 1 and cache.lookup(chain) == [pages[0]]


def test_a_referenced_page_is_never_evicted():
    cache = PrefixCache(BlockPool(3))
    chain = hashes(list(range(12)))
    pages = cache.allocate(3)
    for block_hash, page in zip(chain, pages):
        cache.insert(block_hash, page)
    cache.release(pages[1:])
    assert cache.allocate(2) == [pages[2], pages[1]]
    with pytest.raises(RuntimeError, match="free or evictable"):
        cache.allocate(1)
    assert cache.lookup(chain) == [pages[0]] and cache.ref_count(pages[0]) == 1


def test_insert_keeps_the_first_copy_of_a_block_and_checks_references():
    cache = PrefixCache(BlockPool(4))
    chain = hashes(list(range(4)))
    first, second = cache.allocate(2)
    cache.insert(chain[0], first)
    cache.insert(chain[0], second)  # computed at the same time by another request: stays private
    assert cache.lookup(chain) == [first] and cache.num_cached_blocks == 1
    cache.release([second])
    assert cache.block_pool.num_free_blocks == 3, "the private copy went back to the free list"
    cache.release([first])
    with pytest.raises(ValueError, match="not held"):
        cache.insert(hash_block(ROOT_HASH, [7, 7, 7, 7]), first)
    with pytest.raises(ValueError, match="double free"):
        cache.release([first])


def test_snapshot_cache_evicts_committed_unpinned_slots_lru_first():
    snapshots = SnapshotCache(2)
    a, b = snapshots.allocate(), snapshots.allocate()
    snapshots.commit(a, b"a")
    snapshots.commit(b, b"b")
    assert snapshots.num_available == 2 and snapshots.get(b"a") == a
    snapshots.pin(a)  # being restored from in this step
    assert snapshots.allocate() == b and snapshots.get(b"b") is None and snapshots.num_evictions == 1
    assert snapshots.num_available == 0
    with pytest.raises(RuntimeError, match="held or pinned"):
        snapshots.allocate()
    snapshots.unpin(a)
    snapshots.discard(b)
    assert snapshots.num_available == 2 and snapshots.get(b"a") == a


def test_snapshot_commit_of_a_known_position_frees_the_duplicate():
    snapshots = SnapshotCache(3)
    first, second = snapshots.allocate(), snapshots.allocate()
    snapshots.commit(first, b"x")
    snapshots.commit(second, b"x")
    assert snapshots.get(b"x") == first and snapshots.num_committed == 1 and snapshots.pool.num_free_slots == 2


def request(req_id, token_ids, **params):
    return Request(req_id, list(token_ids), SamplingParams(max_tokens=4, **params))


def computed(manager, req, num_tokens):
    """As a step does: allocate, schedule a save where one is due, advance, index."""
    assert manager.allocate_slots(req, num_tokens) is not None
    end = req.num_computed_tokens + num_tokens
    saves = manager.plan_snapshot_saves(req, num_tokens)
    req.num_computed_tokens = end
    manager.cache_computed(req, end)
    manager.end_step()
    return saves


def test_a_cached_prefix_needs_its_pages_and_a_snapshot_at_exactly_its_end():
    manager = CacheManager(num_blocks=16, num_slots=4, block_size=BS, num_snapshot_slots=4)
    tokens = list(range(1, 15))  # 14 tokens: the prompt's last full block ends at 12
    first = request("a", tokens)
    saves = computed(manager, first, 14)
    assert [position for _, _, position in saves] == [12], "saved inside the chunk, which runs whole"
    manager.free(first)
    hit = manager.find_cached_prefix(request("b", tokens + [99]))
    assert len(hit.block_ids) == 3 and hit.snapshot_slot is not None
    short = manager.find_cached_prefix(request("c", tokens[:10] + [99, 98]))
    assert short.block_ids == [], "pages of blocks 0-1 are cached but no state was saved at token 8"
    assert manager.find_cached_prefix(request("d", tokens[:12])).block_ids == [], "one token must be left to compute"
    assert manager.find_cached_prefix(request("e", tokens, prompt_logprobs=1)) is None


def test_a_hit_shares_the_pages_and_pins_the_snapshot_until_the_step_ends():
    manager = CacheManager(num_blocks=8, num_slots=4, block_size=BS, num_snapshot_slots=1)
    tokens = list(range(1, 9))
    first = request("a", tokens + [9])  # its prompt-end snapshot: at 8
    computed(manager, first, 8)
    second = request("b", tokens + [50, 51])
    hit = manager.find_cached_prefix(second)
    new_block_ids = manager.allocate_slots(second, 2, hit)
    assert second.block_ids == first.block_ids + new_block_ids and len(new_block_ids) == 1
    assert second.num_computed_tokens == 8
    assert all(manager.prefix_cache.ref_count(b) == 2 for b in first.block_ids)
    assert manager.snapshots.num_available == 0, "pinned while the runner restores from it"
    manager.end_step()
    assert manager.snapshots.num_available == 1
    for req in (first, second):
        manager.free(req)
    assert manager.num_free_blocks == 8 and manager.usage == 0.0
    stats = manager.prefix_cache_stats()
    assert (stats.num_queries, stats.num_hits, stats.num_hit_tokens, stats.num_cached_blocks) == (1, 1, 8, 2)


def test_a_recompute_chunk_saves_one_snapshot_inside_it_the_shared_one_first():
    """Preempted after 8 outputs and recomputed from 0 in one chunk of 14 tokens (block 4): the runner splits a
    chunk once, so the shared snapshot (at 4) is saved there if it is not published, else the rolling one (at 12)."""
    manager = CacheManager(num_blocks=32, num_slots=2, block_size=4, num_snapshot_slots=4)
    req = request("a", range(1, 7))
    req.output_token_ids.extend(range(100, 108))
    manager.allocate_slots(req, req.num_tokens)
    assert [save[2] for save in manager.plan_snapshot_saves(req, req.num_tokens)] == [4]
    manager.free(req)

    first_run = request("b", range(1, 7))  # the same prompt: its shared snapshot at 4 is published now
    assert [save[2] for save in computed(manager, first_run, 6)] == [4]
    manager.free(first_run)
    req = request("c", range(1, 7))
    req.output_token_ids.extend(range(100, 108))
    manager.allocate_slots(req, req.num_tokens)
    assert [save[2] for save in manager.plan_snapshot_saves(req, req.num_tokens)] == [12]
