"""Scheduler: which requests run this step and how many tokens each computes, under a token budget.

Each step has a budget of max_num_batched_tokens tokens. Running requests are served first, in admission
order: each gets min(tokens it has left to compute, budget left), that is one token for a decode and a
chunk for an unfinished prompt, so prefill chunks and decodes share one step and a long prompt is split
across steps. Then waiting requests are admitted first come, first served while budget, a KDA state slot
(max_num_seqs) and MLA pages remain; the head of the queue is never skipped, so no request starves behind
later ones, and no waiting request is admitted in a step that preempted (it would only thrash).

Preemption (recompute). When a running request cannot get the pages for its tokens, the most recently
admitted running request (the tail of `running`) is preempted: its pages and slot are freed, its
num_computed_tokens goes back to 0, it goes to the FRONT of the waiting queue, and later it is re-sent to
the runner as a new request whose tokens are prompt + outputs so far. This repeats until the request fits
or is itself the tail and is preempted. Victims are always later in `running` than the request being
served, so they have not been scheduled in this step. Progress is guaranteed: the oldest running request
is never a victim of another, and alone it fits, because add_request rejects any request whose longest
possible sequence needs more pages than the cache holds; a preempted request is first in line once pages
free up.

Prefix caching (CacheManager's docstring has the rules). A waiting request is admitted with its longest cached
prefix: its pages (shared, ref counted) and num_computed_tokens = the prefix's tokens; NewRequestData names the
KDA snapshot the runner restores into its slot. A chunk that would pass one of a request's snapshot positions is
cut to end there, and SchedulerOutput.snapshot_saves asks the runner to copy the state after that step. A
preempted request's full pages stay cached, so its recompute usually starts from a cached prefix.

Length limits (as vLLM): a prompt of max_model_len tokens or more is rejected; generation is capped by
finishing with 'length' when the request reaches max_model_len tokens (or max_tokens outputs).

Decode bursts. When every running request decodes (one token left to compute) without penalties, logprobs, stop
strings or a grammar (SamplingParams.host_between_tokens), and nothing waits, the step may be a burst of up to
num_decode_steps decode steps: each request gets the pages for all of them now, the runner feeds each step's token
to the next on the device and returns them all after one sync, and update_from_output appends them as if they came
one step at a time (a stop token or the length limit finishes the request there; the tokens computed after it are
dropped with its cache). A burst never runs past a request's max_tokens or max_model_len; a burst whose pages cannot
all be had is one step. With prefix caching, a request's rolling snapshot is saved inside the burst, after the step
where single steps would have saved it last (CacheManager.plan_burst_snapshot_save), and the burst's full blocks
enter the page index once its tokens are appended.

Chained bursts (asynchronous scheduling). While a burst, or a step in which every request samples (decodes and the
last chunks of prompts), runs on the device, schedule_chained plans the burst after it before its tokens are known,
as if none of them stopped its request: the same requests, pages for the tokens after both, each step's input the
step before's token on the device. The host then reads and applies the first step's tokens while the device
computes the burst. A request that a stop token ends in the first step is still computed by the burst; its
update skips it, as it skips aborted requests, and its pages and slot, freed meanwhile, are written again only by
work queued after that burst. The chain breaks (the next step is scheduled
as usual, after the sync) whenever a request waits or the burst conditions would not hold after the first step; a
request that ends by length in the step in flight is left out of the chain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from deltaserve.cache.manager import CacheManager
from deltaserve.config import EngineConfig
from deltaserve.request import Request, RequestStatus
from deltaserve.runner_output import RunnerOutput
from deltaserve.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


class Scheduler:
    """Token-budget scheduler over one CacheManager; no tensors, no model."""

    def __init__(self, engine_config: EngineConfig, cache_manager: CacheManager, max_model_len: int):
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"Scheduler max_model_len = {max_model_len!r}: must be an integer >= 2 "
                             "(a prompt token plus one generated token)")
        self.max_num_seqs = engine_config.max_num_seqs
        self.max_num_batched_tokens = engine_config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_decode_steps = engine_config.num_decode_steps
        self.cache = cache_manager
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the tail is the preemption victim
        self._finished_req_ids: set[str] = set()  # ones the runner holds, to drop at the next step
        self.num_preemptions = 0  # since start, for logs and tests

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, req: Request) -> None:
        """Queue req, or raise ValueError if it can never run (empty, too long, larger than the cache)."""
        self.check_admissible(req)
        req.status = RequestStatus.WAITING
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort_request(self, req_id: str) -> None:
        """Finish req_id as aborted and free its cache; unknown or already finished ids are ignored."""
        req = self.requests.get(req_id)
        if req is not None:
            self._finish(req, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests stopped outside the scheduler (a stop string found by the detokenizer)."""
        if not status.finished:
            raise ValueError(f"finish_requests status = {status}: must be a finished status "
                             "(FINISHED_STOPPED, FINISHED_LENGTH or FINISHED_ABORTED)")
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is not None:
                self._finish(req, status)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; see the module docstring for the policy."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget, preempted = self._schedule_running(out, budget)
        if not preempted:
            self._schedule_waiting(out, budget)
            out.num_decode_steps = self._decode_burst(out)
        out.finished_req_ids = self._finished_req_ids
        self._finished_req_ids = set()
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: RunnerOutput) -> list[tuple[Request, list[int]]]:
        """Advance computed tokens, append sampled ones, finish requests that stop.

        Returns (request, new output token ids) for each request the runner sampled for; a request that
        finished this step has a finished status. Requests aborted since schedule() are skipped.
        """
        updates = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            if scheduler_output.num_decode_steps > 1 or scheduler_output.chained:
                sampled = runner_output.sampled_token_ids[req_id]
                updates.append((req, self._append_burst(req, num_tokens * scheduler_output.num_decode_steps, sampled)))
                continue
            req.num_computed_tokens += num_tokens
            self.cache.cache_computed(req)  # before a finish can release its pages
            sampled = runner_output.sampled_token_ids.get(req_id) or []
            if not sampled:
                self._check_still_prefilling(req)
                continue
            updates.append((req, self._append_tokens(req, sampled)))
        self.cache.end_step()
        return updates

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Serve running requests in order; returns the budget left and whether anyone was preempted."""
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            num_tokens = self._num_new_tokens(req, req.num_computed_tokens, budget)
            new_block_ids, preempted_any = self._allocate_or_preempt(req, num_tokens)
            preempted = preempted or preempted_any
            if new_block_ids is None:
                break  # req was the tail and preempted itself: no running request is left after it
            out.cached_reqs.append(CachedRequestData(req.req_id, new_block_ids, req.num_computed_tokens))
            self._schedule_tokens(out, req, num_tokens)
            budget -= num_tokens
            index += 1
        return budget, preempted

    def _allocate_or_preempt(self, req: Request, num_tokens: int) -> tuple[list[int] | None, bool]:
        """Pages for req's next num_tokens, preempting from the tail of `running` until they fit.

        Returns (new block ids or None if req itself was preempted, whether anyone was preempted).
        """
        preempted = False
        while (new_block_ids := self.cache.allocate_slots(req, num_tokens)) is None:
            victim = self.running[-1]
            self._preempt(victim)
            preempted = True
            if victim is req:
                return None, True
        return new_block_ids, preempted

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests first come, first served while budget, slots and pages allow."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self.cache.find_cached_prefix(req)
            start = len(hit.block_ids) * self.cache.block_size if hit else 0
            num_tokens = self._num_new_tokens(req, start, budget)
            if self.cache.allocate_slots(req, num_tokens, hit) is None:
                break  # the head waits for pages; admitting later ones past it could starve it
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
            out.new_reqs.append(NewRequestData(
                req.req_id, req.all_token_ids, req.num_prompt_tokens, req.sampling_params,
                list(req.block_ids), req.state_slot, req.num_computed_tokens,
                hit.snapshot_slot if hit else None,
            ))
            self._schedule_tokens(out, req, num_tokens)
            budget -= num_tokens

    def _decode_burst(self, out: SchedulerOutput) -> int:
        """Decode steps for this scheduler step (module docstring, Decode bursts); their pages allocated here."""
        steps = self.num_decode_steps
        if steps == 1 or self.waiting or out.new_reqs:
            return 1
        for req in self.running:
            params = req.sampling_params
            if (out.num_scheduled_tokens.get(req.req_id) != 1 or req.num_computed_tokens + 1 != req.num_tokens
                    or params.host_between_tokens):
                return 1
            steps = min(steps, params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens)
        if steps <= 1:
            return 1
        new_pages = {data.req_id: data.new_block_ids for data in out.cached_reqs}
        for req in self.running:
            block_ids = self.cache.allocate_slots(req, steps)
            if block_ids is None:
                return 1  # pages taken for the others stay theirs (sent to the runner below), used by later steps
            new_pages[req.req_id].extend(block_ids)
        # snapshot saves: the first step's (planned by _schedule_tokens) give way to the burst's own
        out.snapshot_saves.clear()
        for req in self.running:
            save = self.cache.plan_burst_snapshot_save(req, steps)
            if save is not None:
                out.snapshot_saves.append(save[:2])
                out.snapshot_save_steps.append(save[2])
        return steps

    def schedule_chained(self, inflight: SchedulerOutput) -> SchedulerOutput | None:
        """The decode burst that follows `inflight`, a step whose sampled tokens are not applied yet (a burst, or a
        step in which every request samples: decodes and prompts' last chunks), for its requests that go on past it
        (module docstring, Chained bursts); None when it cannot be chained."""
        if self.waiting or not self.running or any(r.req_id not in inflight.num_scheduled_tokens for r in self.running):
            return None
        produced = inflight.num_decode_steps  # tokens each request samples in the step in flight
        computed = {}  # tokens each request computes in the step in flight
        steps, chain = self.num_decode_steps, []
        for req in self.running:
            params, num_tokens = req.sampling_params, inflight.num_scheduled_tokens[req.req_id]
            if req.num_computed_tokens + num_tokens != req.num_tokens or params.host_between_tokens:
                return None  # a prompt chunk short of its end samples nothing; the others never burst
            room = min(params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens) - produced
            if room < 1:
                continue  # it ends by length in the step in flight: the others go on without it
            computed[req.req_id] = num_tokens + produced - 1
            steps = min(steps, room)
            chain.append(req)
        # all the pages or none: pages taken for some requests of a chain that is then dropped would never reach the
        # runner (every request holds its state slot already, so pages are all allocate_slots can lack)
        if not chain or sum(self.cache.blocks_needed(r, computed[r.req_id] + steps) for r in chain) > \
                self.cache.num_free_blocks:
            return None
        out = SchedulerOutput(chained=True, num_decode_steps=steps)
        for req in chain:
            block_ids = self.cache.allocate_slots(req, computed[req.req_id] + steps)
            assert block_ids is not None, "counted free above"
            out.cached_reqs.append(CachedRequestData(req.req_id, block_ids,
                                                     req.num_computed_tokens + computed[req.req_id]))
            out.num_scheduled_tokens[req.req_id] = 1
        for req in chain:
            save = self.cache.plan_chained_snapshot_save(req, computed[req.req_id], steps)
            if save is not None:
                out.snapshot_saves.append(save[:2])
                out.snapshot_save_steps.append(save[2])
        out.finished_req_ids = self._finished_req_ids
        self._finished_req_ids = set()
        return out

    def _num_new_tokens(self, req: Request, start: int, budget: int) -> int:
        """Tokens to compute from `start`: all left, within the budget, cut to end at a snapshot position."""
        return self.cache.cut_at_snapshot(req, start, min(req.num_tokens - start, budget))

    def _schedule_tokens(self, out: SchedulerOutput, req: Request, num_tokens: int) -> None:
        out.num_scheduled_tokens[req.req_id] = num_tokens
        save = self.cache.plan_snapshot_save(req, num_tokens)
        if save is not None:
            out.snapshot_saves.append(save)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._finished_req_ids.add(req.req_id)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._finished_req_ids.add(req.req_id)
        else:
            self.waiting.remove(req)
        self.cache.free(req)
        req.status = status
        del self.requests[req.req_id]

    def _append_burst(self, req: Request, num_computed: int, sampled: list[int]) -> list[int]:
        """A decode burst's tokens for req: appended up to the first that ends it, then its new full blocks indexed
        (the tokens are known only now), then the finish. The tokens the burst computed past a stop count as never
        computed."""
        new_token_ids, status = [], None
        for token_id in sampled:
            req.output_token_ids.append(token_id)
            new_token_ids.append(token_id)
            status = self._stop_status(req, token_id)
            if status is not None:
                break
        req.num_computed_tokens = min(req.num_computed_tokens + num_computed, req.num_tokens - 1)
        self.cache.cache_computed(req)
        if status is not None:
            self._finish(req, status)
        return new_token_ids

    def _append_tokens(self, req: Request, sampled: list[int]) -> list[int]:
        """Append sampled tokens until one ends the request; returns those appended."""
        new_token_ids = []
        for token_id in sampled:
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                self._finish(req, RequestStatus.FINISHED_LENGTH)  # max_tokens 0: the prompt only
                break
            req.output_token_ids.append(token_id)
            new_token_ids.append(token_id)
            status = self._stop_status(req, token_id)
            if status is not None:
                self._finish(req, status)
                break
        return new_token_ids

    def _stop_status(self, req: Request, token_id: int) -> RequestStatus | None:
        """Why req ends after token_id, or None. A stop token wins over a length limit hit at the same token."""
        params = req.sampling_params
        if not params.ignore_eos and token_id in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED  # stop_reason stays None for eos, as in vLLM and OpenAI
        if token_id in params.stop_token_ids:
            req.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _check_still_prefilling(self, req: Request) -> None:
        if req.num_computed_tokens >= req.num_tokens:
            raise RuntimeError(
                f"runner returned no sampled token for request {req.req_id!r} although all its "
                f"{req.num_tokens} tokens are computed; the runner must sample one token per request whose "
                "last scheduled chunk reaches the end of its tokens")

    def check_admissible(self, req: Request) -> None:
        """ValueError if req can never run: a duplicate id, an empty prompt, too long, larger than the cache."""
        prompt_len = req.num_prompt_tokens
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in the engine; give each request a unique id")
        if prompt_len == 0:
            raise ValueError(f"request {req.req_id!r} has an empty prompt; pass at least one token "
                             "(e.g. the bos token)")
        if prompt_len >= self.max_model_len:
            raise ValueError(f"request {req.req_id!r}: prompt of {prompt_len} tokens must be shorter than "
                             f"max_model_len={self.max_model_len} to leave room for one generated token; "
                             "shorten the prompt or raise --max-model-len")
        max_cached = self._max_cached_tokens(req)
        if self.cache.blocks_for_tokens(max_cached) > self.cache.num_blocks:
            raise ValueError(
                f"request {req.req_id!r} may cache up to {max_cached} tokens (prompt {prompt_len} + max_tokens "
                f"{req.sampling_params.max_tokens}, capped at max_model_len={self.max_model_len}), "
                f"{self.cache.blocks_for_tokens(max_cached)} pages, but the whole cache holds "
                f"{self.cache.num_blocks} pages ({self.cache.num_blocks * self.cache.block_size} tokens); "
                "lower max_tokens or shorten the prompt, or give the cache more pages (raise cache_bytes or "
                "lower --max-num-seqs)")

    def _max_cached_tokens(self, req: Request) -> int:
        """Most tokens req can hold in the cache: all but its last output token, which is never computed."""
        max_len = min(req.num_prompt_tokens + req.sampling_params.max_tokens, self.max_model_len)
        return max(req.num_prompt_tokens, max_len - 1)
