"""SnapshotCache: copies of the KDA state (conv tails + recurrent state) at exact block boundaries.

A KDA state summarises every token before it, so it is reusable only at exactly the position where it was saved.
A snapshot is keyed by the chained hash of the block that ends at its position (prefix_cache.hash_block), and is
usable only while all the pages of its prefix are in the page index (the lookup checks that).

Snapshot slots are their own pool. A slot is free; held (by a running request writing it: a pending save, or its
rolling snapshot); or committed (in the index), and then pinned while a request restores from it in the current
step. Only committed, unpinned slots are evicted, least recently used first. CPU bookkeeping only."""

from __future__ import annotations

from collections import OrderedDict

from deltaserve.cache.state_pool import StatePool


class SnapshotCache:
    """The snapshot slot pool and its index: block hash -> committed slot, with LRU eviction and pins."""

    def __init__(self, num_slots: int):
        self.pool = StatePool(num_slots)
        self._slot_of: dict[bytes, int] = {}  # block hash -> committed slot
        self._hash_of: dict[int, bytes] = {}  # committed slot -> block hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # committed, unpinned slots, LRU first
        self._pins: dict[int, int] = {}  # committed slot -> restores in flight
        self.num_evictions = 0  # committed snapshots dropped to make room, since start

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def num_committed(self) -> int:
        return len(self._slot_of)

    @property
    def num_available(self) -> int:
        """Slots allocate() can hand out: free ones plus committed, unpinned ones."""
        return self.pool.num_free_slots + len(self._evictable)

    def get(self, block_hash: bytes) -> int | None:
        return self._slot_of.get(block_hash)

    def allocate(self) -> int:
        """A slot to write a new snapshot into: a free one, else the least recently used committed one."""
        if self.pool.num_free_slots:
            return self.pool.allocate()
        if not self._evictable:
            raise RuntimeError(f"SnapshotCache.allocate: all {self.num_slots} snapshot slots are held or pinned; "
                               "check num_available first")
        slot, _ = self._evictable.popitem(last=False)
        del self._slot_of[self._hash_of.pop(slot)]
        self.num_evictions += 1
        return slot

    def commit(self, slot: int, block_hash: bytes) -> None:
        """Publish a held slot, now written, as the snapshot after block_hash; a duplicate is freed instead."""
        existing = self._slot_of.get(block_hash)
        if existing is not None:
            self.pool.free(slot)
            self._touch(existing)
            return
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._evictable[slot] = None

    def discard(self, slot: int) -> None:
        """Give back a held slot that was never written (its request left before the step ran)."""
        self.pool.free(slot)

    def pin(self, slot: int) -> None:
        """Keep a committed slot from eviction while a request restores from it in this step."""
        self._evictable.pop(slot, None)
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            del self._pins[slot]
            self._evictable[slot] = None  # most recently used: it was just restored

    def _touch(self, slot: int) -> None:
        if slot in self._evictable:
            self._evictable.move_to_end(slot)
