"""BlockPool: the fixed set of MLA cache pages, handed out by id; CPU bookkeeping only.

A page (block) holds `block_size` tokens of MLA latents for every MLA layer; the runner owns the tensors and
indexes them by the ids handed out here. Ids are 0..num_blocks-1. Freeing a page the pool did not hand out,
or freeing one twice, is a bookkeeping bug and raises at once rather than corrupting another request's cache."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Free list of MLA pages; allocate(n) hands out n distinct ids, free(ids) takes them back."""

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"BlockPool num_blocks = {num_blocks!r}: must be a positive integer; "
                             "size the cache with deltaserve.cache.sizing.plan_cache")
        self.num_blocks = num_blocks
        # the free list is ids _next_fresh.. (never handed out, in order) followed by _freed (returned, oldest
        # first): a deque of every id, without building one (a small model's GPU cache has tens of millions of pages)
        self._next_fresh = 0
        self._freed: deque[int] = deque()
        self._is_free = bytearray(b"\x01") * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._next_fresh + len(self._freed)

    def allocate(self, num: int) -> list[int]:
        """Take `num` free pages; raises if fewer are free (callers check num_free_blocks first)."""
        if not isinstance(num, int) or num < 0:
            raise ValueError(f"BlockPool.allocate({num!r}): the page count must be an integer >= 0")
        if num > self.num_free_blocks:
            raise RuntimeError(f"BlockPool.allocate({num}): {self.num_free_blocks} of {self.num_blocks} pages are "
                               "free; check num_free_blocks before allocating, or preempt a request first")
        fresh = min(num, self.num_blocks - self._next_fresh)
        ids = list(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        ids += [self._freed.popleft() for _ in range(num - fresh)]
        for block_id in ids:
            self._is_free[block_id] = False
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Return pages to the pool; every id must be one this pool handed out and not yet freed."""
        for block_id in block_ids:
            if not (isinstance(block_id, int) and 0 <= block_id < self.num_blocks):
                raise ValueError(f"BlockPool.free: block id {block_id!r} is not in [0, {self.num_blocks}); "
                                 "free only ids that this pool's allocate() returned")
            if self._is_free[block_id]:
                raise ValueError(f"BlockPool.free: block {block_id} is already free (double free); "
                                 "a request's block_ids must be cleared when its pages are returned")
            self._is_free[block_id] = True
            self._freed.append(block_id)
