"""CacheManager: gives requests MLA pages and a KDA state slot, and takes them back; CPU bookkeeping only.

It writes what it hands out into the request itself (`block_ids`, the block table in order, and
`state_slot`), so the scheduler and the runner read one source of truth. A request needs
ceil((num_computed_tokens + num_new_tokens) / block_size) pages to hold its tokens after a step; its one state
slot is taken on the first allocation and kept until free().
"""

from __future__ import annotations

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.sizing import CachePlan
from deltaserve.cache.state_pool import StatePool
from deltaserve.request import Request


class CacheManager:
    """The MLA page pool and the KDA slot pool, allocated together per request."""

    def __init__(self, num_blocks: int, num_slots: int, block_size: int):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"CacheManager block_size = {block_size!r}: must be a positive integer (tokens a page)")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.state_pool = StatePool(num_slots)

    @classmethod
    def from_plan(cls, plan: CachePlan) -> "CacheManager":
        return cls(plan.num_blocks, plan.num_slots, plan.block_size)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_free_slots(self) -> int:
        return self.state_pool.num_free_slots

    @property
    def usage(self) -> float:
        """Fraction of MLA pages in use, in [0, 1]."""
        return 1.0 - self.block_pool.num_free_blocks / self.block_pool.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Pages that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """New pages req needs so that its computed tokens plus num_new_tokens fit."""
        total = self.blocks_for_tokens(req.num_computed_tokens + num_new_tokens)
        return max(0, total - len(req.block_ids))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        needs_slot = req.state_slot is None
        if needs_slot and self.state_pool.num_free_slots == 0:
            return False
        return self.blocks_needed(req, num_new_tokens) <= self.block_pool.num_free_blocks

    def allocate_slots(self, req: Request, num_new_tokens: int) -> list[int] | None:
        """Give req the pages (and, if it has none, the state slot) for num_new_tokens more tokens.

        Returns the new page ids (appended to req.block_ids), or None, changing nothing, when the pools
        cannot cover it.
        """
        if not self.can_allocate(req, num_new_tokens):
            return None
        if req.state_slot is None:
            req.state_slot = self.state_pool.allocate()
        new_block_ids = self.block_pool.allocate(self.blocks_needed(req, num_new_tokens))
        req.block_ids.extend(new_block_ids)
        return new_block_ids

    def free(self, req: Request) -> None:
        """Return all of req's pages and its slot; req then holds nothing (safe to call on a request with none)."""
        self.block_pool.free(req.block_ids)
        req.block_ids = []
        if req.state_slot is not None:
            self.state_pool.free(req.state_slot)
            req.state_slot = None
