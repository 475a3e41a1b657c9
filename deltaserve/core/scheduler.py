"""Scheduler: which requests run this step and how many tokens each computes, under a token budget.

Each step has a budget of max_num_batched_tokens tokens. Running requests are served first, in admission order,
each min(tokens it has left, budget left; a prompt's chunk may end sooner, at a branch snapshot below): one token
for a decode, a chunk of an unfinished prompt, so prefill chunks and decodes share a step and a long prompt spans
steps. Then waiting requests are admitted first come, first served while budget, a KDA state slot (max_num_seqs)
and MLA pages remain; a request that waits for pages is never passed over (no starvation), and nothing is admitted
in a step that preempted (it would only thrash).

Preemption (recompute). When a running request cannot get the pages for its tokens, the most recently admitted
running request (the tail of `running`) is preempted: its pages and slot freed, num_computed_tokens back to 0, it
goes to the FRONT of the waiting queue and is later re-sent as a new request of prompt + outputs so far. This
repeats until the request fits or is itself the tail. Victims are later in `running` than the request served, so
not yet scheduled this step. Progress is guaranteed: the oldest running request is never another's victim, and
alone it fits, since add_request rejects a request whose longest sequence needs more pages than the cache holds.

Prefix caching (CacheManager's docstring has the rules). A waiting request is admitted with its longest cached
prefix: its pages (shared, ref counted) and num_computed_tokens = the prefix's tokens; NewRequestData names the
KDA snapshot the runner restores into its slot. A request whose tokens part from a cached sequence where no
snapshot lies (CachedPrefix.branch_blocks: a shared system prompt) has the chunk that reaches there cut to end
there, where a snapshot is saved for the requests after it. A waiting request whose cached prefix a running
request's shared snapshot will lengthen (the same prompt, one it begins with, a branch it shares: n completions, a
burst of one prompt) is passed over until those pages are indexed (with the snapshot, where a slot was free), and
then admitted before those behind it, so those tokens are computed once; it waits at most that request's prefill.
At most MAX_PASSED_OVER requests are passed over a step (each costs a cache lookup). SchedulerOutput.snapshot_saves
asks the runner to copy a request's state once it has computed a snapshot's position: inside the step's chunk (the
KDA layers split their pass there), at its end, or after the lookahead step that reaches it. A preempted request's
full pages stay cached.

Length limits (as vLLM): a prompt of max_model_len tokens or more is rejected; generation finishes with 'length'
at max_model_len tokens (or max_tokens outputs).

A step in flight (asynchronous scheduling, vLLM v1's). schedule() may run while the step before it still computes:
num_computed_tokens counts the tokens of every step scheduled, num_pending_outputs those the steps will sample, not
yet appended. A request whose chunk reaches the end of its tokens and pending ones samples; its next decode's
input is the token the step in flight samples, which the runner takes from the device. A request whose steps in
flight bring it to a length limit is not scheduled again. One whose sampling reads its outputs (penalties, a
grammar) is scheduled ahead too: the runner queues its forward pass at once, its sampling once the step before is
applied. update_from_output applies the steps in order; a request that a stop token ends has its next, already
queued step computed for nothing and skipped, as aborted requests are (its freed pages and slot are written again
only by steps queued after it). A request preempted while its step ran gets that step's tokens when it is applied,
and is admitted again only after (no pending outputs).

Lookahead (decode bursts). When every running request decodes without logprobs, stop strings, penalties or a grammar
(SamplingParams.host_between_tokens), nothing waits, and the pages of all the steps are free, every request gets
num_decode_steps - 1 lookahead tokens, capped by the smallest room left (max_tokens, max_model_len): the runner
decodes them on the device, each token the next one's input; update_from_output appends them as if they came one
step at a time (a stop token or the length limit finishes the request there and drops the tokens after it). With
prefix caching, the rolling snapshot is saved at the last block boundary the step reaches."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from deltaserve.cache.manager import CacheManager
from deltaserve.config import EngineConfig
from deltaserve.request import Request, RequestStatus
from deltaserve.runner_output import RunnerOutput
from deltaserve.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

MAX_PASSED_OVER = 64  # waiting requests a step passes over (they wait for a running prompt) before it stops looking


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
        # per step scheduled and not yet applied, in order, its requests: an update finds the request it was scheduled
        # for, not one that has since been given the same id (the old one finished while its next step ran)
        self._unapplied: deque[dict[str, Request | None]] = deque()
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
        self.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests stopped outside the scheduler (a stop string found by the detokenizer)."""
        if not status.finished:
            raise ValueError(f"finish_requests status = {status}: must be a finished status "
                             "(FINISHED_STOPPED, FINISHED_LENGTH or FINISHED_ABORTED)")
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is not None:
                self._finish(req, status)

    def rewind(self, req: Request, num_outputs: int) -> None:
        """Take req back to its first num_outputs output tokens and compute it again from there: it is preempted
        (its full pages stay cached, so with prefix caching little is recomputed) and what its steps in flight
        sample is dropped (they read the tokens taken back); if one of those tokens had finished it, it goes on.
        The engine's answer to a sampled token its grammar refuses."""
        del req.output_token_ids[num_outputs:]
        del req.block_hashes[req.num_tokens // self.cache.block_size:]
        for step in self._unapplied:
            if step.get(req.req_id) is req:
                step[req.req_id] = None  # update_from_output skips it
        req.num_pending_outputs = 0
        if req.status == RequestStatus.RUNNING:
            self._preempt(req)
        elif req.status.finished:  # by a token taken back: _finish freed it and told the runner; it waits again
            req.status, req.stop_reason, req.num_computed_tokens = RequestStatus.PREEMPTED, None, 0
            self.requests[req.req_id] = req
            self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; see the module docstring for the policy."""
        out = SchedulerOutput()
        budget, preempted = self._schedule_running(out, self.max_num_batched_tokens, self._lookahead())
        if not preempted:
            self._schedule_waiting(out, budget)
        out.finished_req_ids = self._finished_req_ids
        self._finished_req_ids = set()
        if out.num_scheduled_tokens:
            self._unapplied.append({req_id: self.requests[req_id] for req_id in out.num_scheduled_tokens})
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: RunnerOutput) -> list[tuple[Request, list[int]]]:
        """Apply a step (steps are applied in the order they were scheduled): append its sampled tokens, enter what
        it computed in the prefix cache, finish requests that stop.

        Returns (request, new output token ids) for each request the runner sampled for; a request that
        finished this step has a finished status. Requests finished or aborted since schedule() are skipped (a request
        given the same id since is another request)."""
        updates = []
        starts, requests = scheduler_output.start_positions(), self._take_step(scheduler_output)
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            req = requests[req_id]
            if req is None or req.status.finished:  # None: taken back by rewind since
                continue
            lookahead = scheduler_output.num_lookahead_tokens.get(req_id, 0)
            end = starts[req_id] + num_tokens + lookahead  # tokens computed once this step is done
            sampled = runner_output.sampled_token_ids.get(req_id) or []
            self._settle_pending(req, starts[req_id] + num_tokens, lookahead, sampled)
            new_token_ids, status = self._append(req, sampled)
            if req.status == RequestStatus.RUNNING:  # else preempted since: its pages are gone
                # the tokens computed after a stop token (lookahead steps) count as never computed
                self.cache.cache_computed(req, min(end, req.num_tokens - 1) if sampled else end)
            if status is not None:
                self._finish(req, status)
            if sampled:
                updates.append((req, new_token_ids))
        self.cache.end_step()
        return updates

    def _take_step(self, scheduler_output: SchedulerOutput) -> dict[str, Request]:
        """The requests scheduler_output was scheduled for, taken off the steps not yet applied ({} for an empty
        step); RuntimeError unless it is the oldest of them (steps are applied once each, in order), steps that were
        never applied and whose requests have all finished aside."""
        if not scheduler_output.num_scheduled_tokens:
            return {}
        keys = scheduler_output.num_scheduled_tokens.keys()
        while self._unapplied and self._unapplied[0].keys() != keys and \
                all(req is None or req.status.finished for req in self._unapplied[0].values()):
            self._unapplied.popleft()  # a step never applied (it failed) whose requests were all aborted since
        if not self._unapplied or self._unapplied[0].keys() != keys:
            raise RuntimeError("update_from_output got a step that is not the oldest one scheduled and not applied: "
                               "apply each step once, in the order schedule() returned them")
        return self._unapplied.popleft()

    def _schedule_running(self, out: SchedulerOutput, budget: int, lookahead: int) -> tuple[int, bool]:
        """Serve running requests in order; returns the budget left and whether anyone was preempted."""
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            if self._ends_in_flight(req):
                index += 1  # it finishes when its steps in flight are applied
                continue
            num_tokens = self.cache.branch_cut(req, self._num_new_tokens(req, req.num_computed_tokens, budget))
            new_block_ids, preempted_any = self._allocate_or_preempt(req, num_tokens + lookahead)
            preempted = preempted or preempted_any
            if new_block_ids is None:
                break  # req was the tail and preempted itself: no running request is left after it
            out.cached_reqs.append(CachedRequestData(req.req_id, new_block_ids, req.num_computed_tokens))
            self._schedule_tokens(out, req, num_tokens, lookahead)
            budget -= num_tokens
            index += 1
        return budget, preempted

    def _allocate_or_preempt(self, req: Request, num_tokens: int) -> tuple[list[int] | None, bool]:
        """Pages for req's next num_tokens, preempting from the tail of `running` until they fit.

        Returns (new block ids or None if req itself was preempted, whether anyone was preempted)."""
        preempted = False
        while (new_block_ids := self.cache.allocate_slots(req, num_tokens)) is None:
            victim = self.running[-1]
            self._preempt(victim)
            preempted = True
            if victim is req:
                return None, True
        return new_block_ids, preempted

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests first come, first served while budget, slots and pages allow, passing over those
        that wait for a running request's prompt (module docstring, Prefix caching)."""
        shares = self.cache.pending_shares(self.running)
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            if req.num_pending_outputs:
                break  # preempted while its last step ran: it starts again from all its tokens once that is applied
            hit = self.cache.find_cached_prefix(req)
            if self.cache.awaits_prefix(req, hit, shares):
                i += 1
                if i >= MAX_PASSED_OVER:
                    break
                continue
            start = len(hit.block_ids) * self.cache.block_size if hit else 0
            num_tokens = self.cache.branch_cut(req, self._num_new_tokens(req, start, budget), hit)
            if self.cache.allocate_slots(req, num_tokens, hit) is None:
                break  # the first admissible request waits for pages; admitting later ones past it could starve it
            del self.waiting[i]
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
            out.new_reqs.append(NewRequestData(
                req.req_id, req.all_token_ids, req.num_prompt_tokens, req.sampling_params,
                list(req.block_ids), req.state_slot, req.num_computed_tokens,
                hit.snapshot_slot if hit else None, req.min_tokens_stop_ids,
            ))
            self._schedule_tokens(out, req, num_tokens, 0)
            budget -= num_tokens
            self.cache.add_shares(shares, req)

    def _lookahead(self) -> int:
        """Lookahead tokens for every running request this step (module docstring, Lookahead); 0 for none."""
        steps = self.num_decode_steps
        if steps == 1 or self.waiting or not self.running:
            return 0
        decoding = [r for r in self.running if not self._ends_in_flight(r)]
        for req in decoding:
            if req.num_computed_tokens + 1 != req.num_tokens_with_pending or req.sampling_params.host_between_tokens:
                return 0
            steps = min(steps, self._room(req))
        # all the pages or none: a request given its lookahead's pages while another could not have them would hold
        # pages it never uses this step
        if steps <= 1 or sum(self.cache.blocks_needed(r, steps) for r in decoding) > self.cache.num_free_blocks:
            return 0
        return steps - 1

    def _ends_in_flight(self, req: Request) -> bool:
        """Whether req's steps in flight bring it to its length limit (it is not scheduled again)."""
        return req.num_pending_outputs > 0 and self._room(req) <= 0

    def _room(self, req: Request) -> int:
        """Tokens req may still sample beyond those of its steps in flight (max_tokens, max_model_len)."""
        return min(req.sampling_params.max_tokens - len(req.output_token_ids),
                   self.max_model_len - req.num_tokens) - req.num_pending_outputs

    @staticmethod
    def _num_new_tokens(req: Request, start: int, budget: int) -> int:
        """Tokens to compute from `start`: all left, within the budget."""
        return min(req.num_tokens_with_pending - start, budget)

    def _schedule_tokens(self, out: SchedulerOutput, req: Request, num_tokens: int, lookahead: int) -> None:
        """Put req's next num_tokens (plus lookahead decode steps) in `out`, with the snapshot saves they reach; they
        count as computed from now on, and a chunk that ends req's tokens as many pending outputs as it samples."""
        out.num_scheduled_tokens[req.req_id] = num_tokens
        if lookahead:
            out.num_lookahead_tokens[req.req_id] = lookahead
        end = req.num_computed_tokens + num_tokens + lookahead
        out.snapshot_saves.extend(self.cache.plan_snapshot_saves(req, num_tokens, lookahead))
        if req.num_computed_tokens + num_tokens == req.num_tokens_with_pending:
            req.num_pending_outputs += 1 + lookahead
        req.num_computed_tokens = end

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

    def _settle_pending(self, req: Request, chunk_end: int, lookahead: int, sampled: list[int]) -> None:
        """Take the step's sampled tokens off req's pending outputs, checked against what the step owed it: 1 +
        lookahead tokens where its chunk reached the end of its tokens (all earlier steps are applied, so
        req.num_tokens is where this step's chunk began sampling), none before."""
        owed = 1 + lookahead if chunk_end == req.num_tokens else 0
        if len(sampled) != owed:
            raise RuntimeError(
                f"runner returned {len(sampled)} sampled tokens for request {req.req_id!r}, owed {owed}: the runner "
                "samples 1 + lookahead tokens for each request whose scheduled chunk reaches the end of its tokens, "
                "and none for a prompt chunk short of it")
        req.num_pending_outputs -= owed

    def _append(self, req: Request, sampled: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append sampled tokens up to the first that ends req; returns those appended and why it ends (or None)."""
        new_token_ids = []
        for token_id in sampled:
            if len(req.output_token_ids) >= req.sampling_params.max_tokens:
                return new_token_ids, RequestStatus.FINISHED_LENGTH  # max_tokens 0: the prompt only
            req.output_token_ids.append(token_id)
            new_token_ids.append(token_id)
            status = self._stop_status(req, token_id)
            if status is not None:
                return new_token_ids, status
        return new_token_ids, None

    def _stop_status(self, req: Request, token_id: int) -> RequestStatus | None:
        """Why req ends after token_id, or None. A stop token wins over a length limit hit at the same token; no stop
        token ends it among its first min_tokens outputs (the sampler masks them there; this guards the host's side)."""
        params = req.sampling_params
        if len(req.output_token_ids) > params.min_tokens:
            if not params.ignore_eos and token_id in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED  # stop_reason stays None for eos, as in vLLM and OpenAI
            if token_id in req.stop_token_set:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

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
        # all but its last output token, which is never computed
        max_cached = max(prompt_len, min(prompt_len + req.sampling_params.max_tokens, self.max_model_len) - 1)
        if self.cache.blocks_for_tokens(max_cached) > self.cache.num_blocks:
            raise ValueError(
                f"request {req.req_id!r} may cache up to {max_cached} tokens (prompt {prompt_len} + max_tokens "
                f"{req.sampling_params.max_tokens}, capped at max_model_len={self.max_model_len}), "
                f"{self.cache.blocks_for_tokens(max_cached)} pages, but the whole cache holds "
                f"{self.cache.num_blocks} pages ({self.cache.num_blocks * self.cache.block_size} tokens); "
                "lower max_tokens or shorten the prompt, or give the cache more pages (raise cache_bytes or "
                "lower --max-num-seqs)")
