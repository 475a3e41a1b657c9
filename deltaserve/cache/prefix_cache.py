"""PrefixCache: MLA pages indexed by content, shared by reference count, kept after their requests finish.

A full page is named by a chained hash: SHA-256 of the parent block's hash and the block's token ids, so one hash
names the whole prefix (not Python's 64-bit hash(): a collision would silently give a request another's cache).

Pages enter the index only once full and computed, so an indexed page never changes: requests share it read-only.
Each page has a reference count (the running requests whose block table holds it); an unreferenced cached page
stays indexed until its id is needed: allocate() takes never-cached free pages first, then evicts unreferenced
cached pages, least recently released first. CPU bookkeeping only."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from deltaserve.cache.block_pool import BlockPool

ROOT_HASH = b""  # the parent of a sequence's first block


@dataclass
class PrefixCacheStats:
    """What the prefix cache did since start (its lookups at admission) and how full its two pools are now."""

    num_queries: int  # admissions that looked up a cached prefix (a recompute after preemption counts again)
    num_hits: int  # of those, admissions that found one
    num_query_tokens: int  # tokens of those requests
    num_hit_tokens: int  # tokens whose prefill was skipped
    num_blocks: int  # MLA pages in all
    num_cached_blocks: int  # pages in the index, held by requests or not
    num_unreferenced_blocks: int  # cached pages no request holds (evictable, counted as free)
    num_block_evictions: int
    num_snapshot_slots: int  # KDA state snapshots in all
    num_snapshots: int  # snapshots in the index
    num_snapshot_evictions: int

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up tokens served from the cache."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of one full block: names the block's tokens and, through parent_hash, all before it."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(block_hashes: list[bytes], token_ids: Sequence[int], block_size: int, offset: int = 0
                        ) -> None:
    """Append to block_hashes the hashes of the full blocks of a sequence's tokens that it does not cover yet;
    token_ids are the sequence's from position `offset` on (at most the first token block_hashes does not cover)."""
    covered = len(block_hashes) * block_size
    if offset > covered:
        raise ValueError(f"tokens from {offset} on cannot extend hashes that cover {covered} tokens")
    for start in range(covered, offset + len(token_ids) - block_size + 1, block_size):
        parent = block_hashes[-1] if block_hashes else ROOT_HASH
        block_hashes.append(hash_block(parent, token_ids[start - offset: start - offset + block_size]))


class PrefixCache:
    """Reference counts, the content index and the LRU of unreferenced cached pages, over one BlockPool."""

    def __init__(self, block_pool: BlockPool):
        self.block_pool = block_pool
        self._ref_counts = array("i", bytes(4 * block_pool.num_blocks))  # 4 bytes a page, built in C
        self._page_of: dict[bytes, int] = {}  # block hash -> the cached page holding that block
        self._hash_of: dict[int, bytes] = {}  # cached page -> its block hash
        self._unreferenced: OrderedDict[int, None] = OrderedDict()  # cached pages no request holds, LRU first
        self.num_evictions = 0  # cached pages reused for other tokens, since start

    @property
    def num_free_blocks(self) -> int:
        """Pages allocate() can hand out: never-cached free ones plus unreferenced cached ones."""
        return self.block_pool.num_free_blocks + len(self._unreferenced)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._page_of)

    @property
    def num_unreferenced_blocks(self) -> int:
        return len(self._unreferenced)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def lookup(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The cached pages of the longest run of block_hashes, from the first, that are all in the index."""
        pages = []
        for block_hash in block_hashes:
            page = self._page_of.get(block_hash)
            if page is None:
                break
            pages.append(page)
        return pages

    def num_reclaimed_by(self, block_ids: Sequence[int]) -> int:
        """How many of block_ids acquire() would take out of the free count (cached pages no one holds)."""
        return sum(self._ref_counts[b] == 0 for b in block_ids)

    def acquire(self, block_ids: Sequence[int]) -> None:
        """One more reference to each cached page (a request's hit): it cannot be evicted while held."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._unreferenced[block_id]
            self._ref_counts[block_id] += 1

    def allocate(self, num: int) -> list[int]:
        """num pages, each with one reference: free ones first, then evicted unreferenced cached ones."""
        if num > self.num_free_blocks:
            raise RuntimeError(f"PrefixCache.allocate({num}): only {self.num_free_blocks} pages are free or "
                               "evictable; check num_free_blocks before allocating, or preempt a request first")
        block_ids = self.block_pool.allocate(min(num, self.block_pool.num_free_blocks))
        while len(block_ids) < num:
            block_id, _ = self._unreferenced.popitem(last=False)
            del self._page_of[self._hash_of.pop(block_id)]
            self.num_evictions += 1
            block_ids.append(block_id)
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each page; an unreferenced page stays cached if it is in the index, else is freed.

        Pages are released last first, so a sequence's tail is evicted before its head, which more requests share."""
        refs, hash_of, unreferenced, freed = self._ref_counts, self._hash_of, self._unreferenced, []
        for block_id in reversed(block_ids):  # a 1M-token request holds 65k pages: locals, one free() at the end
            count = refs[block_id]
            if count <= 0:
                self.block_pool.free(freed)
                raise ValueError(f"PrefixCache.release: page {block_id} has no reference to drop (double free); "
                                 "a request's block_ids must be cleared when its pages are returned")
            refs[block_id] = count - 1
            if count > 1:
                continue
            if block_id in hash_of:
                unreferenced[block_id] = None
            else:
                freed.append(block_id)
        self.block_pool.free(freed)

    def insert(self, block_hash: bytes, block_id: int) -> None:
        """Enter a full, computed, referenced page under block_hash. If another page already holds that block
        (two requests computed it at once), the index keeps the first and this page stays private."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"PrefixCache.insert: page {block_id} is not held by any request; only a running "
                             "request's full, computed pages enter the index")
        if block_hash not in self._page_of and block_id not in self._hash_of:
            self._page_of[block_hash] = block_id
            self._hash_of[block_id] = block_hash
