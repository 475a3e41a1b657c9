"""CacheManager: gives requests MLA pages and a KDA state slot, and takes them back; CPU bookkeeping only.

It writes what it hands out into the request itself (`block_ids`, the block table in order, and `state_slot`), so
the scheduler and the runner read one source of truth. A request needs ceil((num_computed_tokens + num_new_tokens)
/ block_size) pages after a step; its state slot is taken on the first allocation and kept until free().

With prefix caching (num_snapshot_slots > 0) pages are shared by reference count through a PrefixCache, and copies
of the KDA state are kept in a SnapshotCache at up to three positions of each request:
- the last block boundary before its prompt's last token, published as soon as it is saved, for the next turn of
  a chat and for repeats of the prompt (a hit leaves at least one token to compute, so a snapshot at the very end
  of a whole-block prompt could serve no repeat of it);
- the last full block boundary its computed tokens have reached: a rolling snapshot held privately (one slot,
  overwritten at each boundary), published when the request finishes, is preempted or aborted;
- where its prompt parts from a cached sequence that has no snapshot there, BRANCH_MIN_TOKENS or more past its hit
  (CachedPrefix.branch_blocks: requests that share a system prompt and then differ), published as soon as it is
  saved: the chunk that reaches it is cut to end there (branch_cut), one step more for that request.
plan_snapshot_saves names the slot and the position after which the runner copies the state, which may lie inside
a step's chunk: the runner's KDA layers then split their pass there (forward_batch.SnapshotSplit), so that a chunk is
never cut short for a snapshot. Pages and snapshots enter the indexes only once the step that computed them is
applied (cache_computed), so two requests admitted in the same step never share a page still being written. A
cached prefix (find_cached_prefix) is the longest run of whole blocks with both its pages and the snapshot at its
end, short of the last token, so that the step has logits to sample from.

The scheduler plans a step while the one before may still run, so a request can have two saves not yet made
(`_writes`, in step order). A request that leaves before its saves are applied loses them, and with them the
rolling snapshot whose slot one of them was overwriting."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.prefix_cache import PrefixCache, PrefixCacheStats, extend_block_hashes
from deltaserve.cache.sizing import CachePlan
from deltaserve.cache.snapshot_cache import SnapshotCache
from deltaserve.cache.state_pool import StatePool
from deltaserve.request import Request

# the fewest tokens a branch snapshot must save a later request (past what it finds cached) to be worth the step its
# cut costs the request that saves it: a one-step prefill of this many tokens costs about one decode step's weights
BRANCH_MIN_TOKENS = 256


@dataclass
class CachedPrefix:
    """A request's cached prefix: the pages of its first len(block_ids) blocks and the KDA snapshot at their end."""

    block_ids: list[int] = field(default_factory=list)
    snapshot_slot: int | None = None
    # where the request's tokens part from a cached sequence's with no snapshot there (a shared system prompt): the
    # blocks from the start whose pages are cached, BRANCH_MIN_TOKENS or more past block_ids. The chunk that reaches
    # it ends there and saves a shared snapshot, which later requests that begin the same way restore. 0: none (or no
    # snapshot slot to save it in)
    branch_blocks: int = 0


@dataclass(frozen=True)
class CacheOccupancy:
    """The pools now: MLA pages and KDA state slots, in all and free (CacheManager's counts), for metrics."""

    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_slots: int
    num_free_slots: int
    usage: float  # fraction of pages held by requests


@dataclass
class _Lookups:
    num_queries: int = 0
    num_hits: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0


@dataclass
class _SnapshotWrite:
    slot: int
    position: int  # tokens before the saved state
    shared: bool  # the prompt-end or a branch snapshot (published after the step) vs the request's rolling one


class CacheManager:
    """The MLA page pool and the KDA slot pool, allocated together per request."""

    def __init__(self, num_blocks: int, num_slots: int, block_size: int, num_snapshot_slots: int = 0):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"CacheManager block_size = {block_size!r}: must be a positive integer (tokens a page)")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.state_pool = StatePool(num_slots)
        caching = num_snapshot_slots > 0
        self.prefix_cache = PrefixCache(self.block_pool) if caching else None
        self.snapshots = SnapshotCache(num_snapshot_slots) if caching else None
        self._writes: dict[str, list[_SnapshotWrite]] = {}  # snapshot saves scheduled and not yet applied, by request
        self._rolling: dict[str, _SnapshotWrite] = {}  # running requests' private snapshots at their last boundary
        self._branches: dict[str, int] = {}  # admitted requests' branch positions, until their save is planned
        self._pinned: list[int] = []  # snapshot slots restored from in this step
        self._lookups = _Lookups()

    @classmethod
    def from_plan(cls, plan: CachePlan) -> "CacheManager":
        return cls(plan.num_blocks, plan.num_slots, plan.block_size, plan.num_snapshot_slots)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Pages a request can get: free ones and, with prefix caching, cached pages no request holds."""
        return self.prefix_cache.num_free_blocks if self.prefix_cache else self.block_pool.num_free_blocks

    @property
    def num_free_slots(self) -> int:
        return self.state_pool.num_free_slots

    @property
    def usage(self) -> float:
        """Fraction of MLA pages held by requests, in [0, 1] (cached pages no request holds count as free)."""
        return 1.0 - self.num_free_blocks / self.block_pool.num_blocks

    def occupancy(self) -> CacheOccupancy:
        return CacheOccupancy(self.num_blocks, self.num_free_blocks, self.block_size, self.state_pool.num_slots,
                              self.num_free_slots, self.usage)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Pages that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """New pages req needs so that its computed tokens plus num_new_tokens fit."""
        total = self.blocks_for_tokens(req.num_computed_tokens + num_new_tokens)
        return max(0, total - len(req.block_ids))

    def can_allocate(self, req: Request, num_new_tokens: int, hit: CachedPrefix | None = None) -> bool:
        """Whether allocate_slots(req, num_new_tokens, hit) would succeed; num_new_tokens counts from the hit."""
        if req.state_slot is None and self.state_pool.num_free_slots == 0:
            return False
        if hit is None or not hit.block_ids:
            return self.blocks_needed(req, num_new_tokens) <= self.num_free_blocks
        num_hit = len(hit.block_ids)
        needed = self.blocks_for_tokens(num_hit * self.block_size + num_new_tokens) - num_hit
        return needed <= self.num_free_blocks - self.prefix_cache.num_reclaimed_by(hit.block_ids)

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: CachedPrefix | None = None) -> list[int] | None:
        """Give req the pages (and, if it has none, the state slot) for num_new_tokens more tokens.

        hit (a waiting request's find_cached_prefix) first gives req its cached pages, one more reference each,
        and sets num_computed_tokens to their tokens; num_new_tokens then count from there. Returns the new page
        ids (appended to req.block_ids), or None, changing nothing, when the pools cannot cover it."""
        if not self.can_allocate(req, num_new_tokens, hit):
            return None
        if hit is not None:
            self._take_hit(req, hit)
            if hit.branch_blocks:
                self._branches[req.req_id] = hit.branch_blocks * self.block_size
        if req.state_slot is None:
            req.state_slot = self.state_pool.allocate()
        new_block_ids = (self.prefix_cache or self.block_pool).allocate(self.blocks_needed(req, num_new_tokens))
        req.block_ids.extend(new_block_ids)
        return new_block_ids

    def free(self, req: Request) -> None:
        """Return all of req's pages and its slot; req then holds nothing (safe to call on a request with none).
        With prefix caching its full, indexed pages stay cached unreferenced, and its rolling snapshot is published."""
        if self.prefix_cache is None:
            self.block_pool.free(req.block_ids)
        else:
            self._branches.pop(req.req_id, None)
            self._publish_rolling(req)
            self.prefix_cache.release(req.block_ids)
            req.num_indexed_blocks = 0
        req.block_ids = []
        if req.state_slot is not None:
            self.state_pool.free(req.state_slot)
            req.state_slot = None

    def find_cached_prefix(self, req: Request) -> CachedPrefix | None:
        """req's longest cached prefix in whole blocks with both its pages and the KDA snapshot at its end, short of
        req's last token; None without prefix caching, or when req asks for prompt logprobs (a hit would skip the
        positions they score)."""
        if self.prefix_cache is None or req.sampling_params.prompt_logprobs is not None:
            return None
        block_hashes = self._block_hashes(req)[: (req.num_tokens - 1) // self.block_size]
        block_ids = self.prefix_cache.lookup(block_hashes)
        num_blocks, slot = len(block_ids), None
        while num_blocks and (slot := self.snapshots.get(block_hashes[num_blocks - 1])) is None:
            num_blocks -= 1
        # a branch: cached pages well past the snapshot, short of the prompt's own snapshot (which serves there)
        branch = (len(block_ids) - num_blocks) * self.block_size >= BRANCH_MIN_TOKENS \
            and len(block_ids) * self.block_size < self._prompt_end(req) and self.snapshots.num_available > 0
        return CachedPrefix(block_ids[:num_blocks], slot, len(block_ids) if branch else 0)

    def branch_cut(self, req: Request, num_tokens: int, hit: CachedPrefix | None = None) -> int:
        """num_tokens for req's next chunk, cut to end at its branch (CachedPrefix.branch_blocks) until one reaches
        it: the chunk that saves a snapshot there ends there (a step's budget may end an earlier one short of it).
        hit: a waiting request's, whose chunk starts after it (allocate_slots takes the hit and the branch)."""
        if hit is not None:
            start, branch = len(hit.block_ids) * self.block_size, hit.branch_blocks * self.block_size or None
        else:
            start, branch = req.num_computed_tokens, self._branches.get(req.req_id)
        return num_tokens if branch is None else min(num_tokens, branch - start)

    def pending_shares(self, running: list[Request]) -> dict[int, set[bytes]]:
        """The shared snapshots (with their pages) that running requests may still publish, as {blocks before it:
        {hash of its last block}}: at their prompt's end unless their pages there are indexed, and at a branch.
        Empty without prefix caching. add_shares extends it with a request admitted after."""
        shares: dict[int, set[bytes]] = {}
        for req in running:
            self.add_shares(shares, req)
        return shares

    def add_shares(self, shares: dict[int, set[bytes]], req: Request) -> None:
        if self.prefix_cache is None:
            return
        positions = {w.position for w in self._writes.get(req.req_id, ()) if w.shared}
        prompt_end = self._prompt_end(req)
        if req.num_indexed_blocks < prompt_end // self.block_size:
            positions.add(prompt_end)
        for position in positions:
            num_blocks = position // self.block_size
            shares.setdefault(num_blocks, set()).add(self._block_hashes(req)[num_blocks - 1])

    def awaits_prefix(self, req: Request, hit: CachedPrefix | None, shares: dict[int, set[bytes]]) -> bool:
        """Whether req would find a longer cached prefix than `hit` once a running request publishes one of `shares`
        (pending_shares): the tokens before it are req's too, and more than hit's. Admitting req now would compute
        them twice (n completions of one prompt, a burst of requests that repeat one prompt or begin with one
        system prompt). Such a share may end up with pages and no snapshot (no slot was free): req then waited for
        nothing, at most until that request's prefill reaches there."""
        if hit is None or not shares:
            return False  # no prefix caching, or req asks for prompt logprobs
        block_hashes = self._block_hashes(req)[: (req.num_tokens - 1) // self.block_size]
        # chained hashes: one equal hash means equal blocks up to it
        return any(len(hit.block_ids) < n <= len(block_hashes) and block_hashes[n - 1] in hashes
                   for n, hashes in shares.items())

    def plan_snapshot_saves(self, req: Request, num_tokens: int, lookahead: int = 0) -> list[tuple[int, int, int]]:
        """The snapshot saves of req's step, computing num_tokens from req.num_computed_tokens and then `lookahead`
        decode steps: (state slot, snapshot slot, position) each, in position order, for the runner to copy req's
        KDA state once it has computed `position` tokens: inside the chunk (the KDA layers split their pass there),
        at its end, or after one of the lookahead steps. The shared one wherever the chunk passes the prompt's
        last block boundary before its last token; the rolling one where the chunk or its lookahead reaches the
        last full block boundary of req's tokens (those of its steps in flight and lookahead included), unless the
        shared one is saved inside the same chunk (the runner splits a chunk once: a recompute of prompt and
        outputs then keeps the shared one, and its rolling one waits for the next boundary its decode reaches). A
        chunk cut at req's branch (branch_cut) saves the branch snapshot at its end, and nothing else."""
        if self.prefix_cache is None:
            return []
        saves = []
        start, chunk_end = req.num_computed_tokens, req.num_computed_tokens + num_tokens
        branch = self._branches.get(req.req_id)  # a chunk ends there (branch_cut)
        if branch is not None and chunk_end >= branch:
            del self._branches[req.req_id]
            if start < branch == chunk_end and self._unpublished(req, branch):
                return [self._plan_write(req, self.snapshots.allocate(), branch, True)]
        shared = self._prompt_end(req)
        shared_inside = False
        if start < shared <= chunk_end and self._wants_snapshot(req, shared):
            saves.append(self._plan_write(req, self.snapshots.allocate(), shared, True))
            shared_inside = shared < chunk_end
        position = (chunk_end + lookahead) // self.block_size * self.block_size
        if start < position != shared and position >= self._last_boundary(req) \
                and not (position < chunk_end and shared_inside) and self._wants_snapshot(req, position):
            slot = self._rolling_slot(req.req_id)
            saves.append(self._plan_write(req, self.snapshots.allocate() if slot is None else slot, position, False))
        return saves

    def _plan_write(self, req: Request, slot: int, position: int, shared: bool) -> tuple[int, int, int]:
        self._writes.setdefault(req.req_id, []).append(_SnapshotWrite(slot, position, shared))
        return req.state_slot, slot, position

    def cache_computed(self, req: Request, num_computed: int) -> None:
        """Once a step is applied: enter req's newly full pages up to num_computed tokens (those the step computed,
        less any after a stop token) in the page index, and publish the snapshots saved up to there."""
        if self.prefix_cache is None:
            return
        num_full = num_computed // self.block_size
        if num_full > req.num_indexed_blocks:
            block_hashes = self._block_hashes(req)
            for i in range(req.num_indexed_blocks, num_full):
                self.prefix_cache.insert(block_hashes[i], req.block_ids[i])
            req.num_indexed_blocks = num_full
        writes = self._writes.get(req.req_id, [])
        while writes and writes[0].position <= num_computed:
            write = writes.pop(0)
            if write.shared:
                self.snapshots.commit(write.slot, self._block_hashes(req)[write.position // self.block_size - 1])
            else:
                self._rolling[req.req_id] = write
        if not writes:
            self._writes.pop(req.req_id, None)

    def end_step(self) -> None:
        """After a step is applied: unpin the snapshots restored from (the runner has queued their copies)."""
        if self.snapshots is None:
            return
        for slot in self._pinned:
            self.snapshots.unpin(slot)
        self._pinned.clear()

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Hit counters and pool use of the prefix cache; None when it is off."""
        if self.prefix_cache is None:
            return None
        pages, snapshots = self.prefix_cache, self.snapshots
        return PrefixCacheStats(**asdict(self._lookups), num_blocks=self.num_blocks,
                                num_cached_blocks=pages.num_cached_blocks,
                                num_unreferenced_blocks=pages.num_unreferenced_blocks,
                                num_block_evictions=pages.num_evictions, num_snapshot_slots=snapshots.num_slots,
                                num_snapshots=snapshots.num_committed, num_snapshot_evictions=snapshots.num_evictions)

    def _take_hit(self, req: Request, hit: CachedPrefix) -> None:
        """Count the lookup, give req the hit's pages and pin the snapshot the runner restores from."""
        num_hit_tokens = len(hit.block_ids) * self.block_size
        self._lookups.num_queries += 1
        self._lookups.num_query_tokens += req.num_tokens
        if not hit.block_ids:
            return
        self._lookups.num_hits += 1
        self._lookups.num_hit_tokens += num_hit_tokens
        self.prefix_cache.acquire(hit.block_ids)
        req.block_ids = list(hit.block_ids)
        req.num_computed_tokens = num_hit_tokens
        req.num_indexed_blocks = len(hit.block_ids)
        self.snapshots.pin(hit.snapshot_slot)
        self._pinned.append(hit.snapshot_slot)

    def _block_hashes(self, req: Request) -> list[bytes]:
        if len(req.block_hashes) < req.num_tokens // self.block_size:
            covered = len(req.block_hashes) * self.block_size  # only the tokens after: a long prompt is not copied
            extend_block_hashes(req.block_hashes, req.token_ids_from(covered), self.block_size, covered)
        return req.block_hashes

    def _prompt_end(self, req: Request) -> int:
        """The shared snapshot's position: the last block boundary before the prompt's last token."""
        return (req.num_prompt_tokens - 1) // self.block_size * self.block_size

    def _last_boundary(self, req: Request) -> int:
        return req.num_tokens_with_pending // self.block_size * self.block_size

    def _rolling_slot(self, req_id: str) -> int | None:
        """The slot req_id's rolling snapshot lives in: that of its last rolling save planned, else of the one kept."""
        planned = [w for w in self._writes.get(req_id, []) if not w.shared]
        held = planned[-1] if planned else self._rolling.get(req_id)
        return held.slot if held else None

    def _wants_snapshot(self, req: Request, position: int) -> bool:
        """Whether a save at position is needed (none there yet, for the shared one) and has a slot to go to."""
        if position == self._prompt_end(req):
            return self._unpublished(req, position)
        return self._rolling_slot(req.req_id) is not None or self.snapshots.num_available > 0

    def _unpublished(self, req: Request, position: int) -> bool:
        """Whether no snapshot is published at req's block boundary `position` and a slot is free to save one."""
        published = self.snapshots.get(self._block_hashes(req)[position // self.block_size - 1])
        return published is None and self.snapshots.num_available > 0

    def _publish_rolling(self, req: Request) -> None:
        """req leaves: its saves not made yet are dropped (their slots hold nothing usable), and its rolling snapshot
        is published unless one of them was overwriting it."""
        writes = self._writes.pop(req.req_id, [])
        rolling = self._rolling.pop(req.req_id, None)
        slots = {write.slot for write in writes}
        for slot in slots:
            self.snapshots.discard(slot)
        if rolling is not None and rolling.slot not in slots:
            self.snapshots.commit(rolling.slot, self._block_hashes(req)[rolling.position // self.block_size - 1])
