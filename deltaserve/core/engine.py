"""Engine: the step loop  schedule -> run -> update -> detokenize  over one model instance.

add_request() queues; step() runs one scheduler step for every unfinished request at once and returns a
RequestOutput for each request that progressed. Stop strings are found by each request's incremental
detokenizer and finish the request through the scheduler.

With asynchronous scheduling (EngineConfig.async_scheduling) one step stays in flight: step() queues the next step
before waiting for the current one's tokens (core/scheduler.py), so the device computes while the host applies the
current step. A next step with prompt chunks is scheduled then too, but queued only once the current step is
applied: its launch (eager, kernel by kernel, not a CUDA graph) would hold back the current step's tokens, the first
tokens of a batch of prompts, by the host's time to launch it; the device meanwhile waits only for the host to apply
a step. A next step that samples a request whose sampling reads its outputs (penalties, a grammar) has only its
forward pass queued then; its sampling is launched once the current step is applied (PendingOutput.launch).

Structured outputs: a constrained request waits outside the scheduler until its grammar has compiled on the
manager's thread pool, so a slow schema never stalls other steps; the runner masks its logits when it samples
(runner.logits_processor), _apply advances its matcher, and the matcher is released when the request ends."""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deltaserve.cache.manager import CacheManager, CacheOccupancy
from deltaserve.cache.prefix_cache import PrefixCacheStats
from deltaserve.cache.sizing import describe_plan, plan_cache
from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.core.outputs import CompletionOutput, Logprob, RequestOutput, StepTotals
from deltaserve.core.scheduler import Scheduler
from deltaserve.distributed import SINGLE, ParallelConfig, broadcast_object, check_device
from deltaserve.kernels import compile_watch
from deltaserve.kernels.compile_watch import CompileWatch
from deltaserve.kernels.tuning_cache import TuningWatch
from deltaserve.loader.model_loader import DTYPES
from deltaserve.request import Request, RequestStatus, ending_ids
from deltaserve.runner.allocator_watch import AllocatorWatch
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.runner.startup import ProgressBar, phase
from deltaserve.runner.step_sampler import PendingOutput
from deltaserve.runner_output import Logprobs
from deltaserve.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from deltaserve.scheduler_output import SchedulerOutput
from deltaserve.structured import errors as structured_errors
from deltaserve.structured import manager as structured_manager
from deltaserve.structured.manager import StructuredOutputManager
from deltaserve.tokenizer import load_tokenizer
from deltaserve.tokenizer.detokenizer import IncrementalDetokenizer

log = logging.getLogger("deltaserve")


@dataclass
class _Tracked:
    """What the engine keeps per request to build its RequestOutputs."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    cumulative_logprob: float | None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Submitted:
    """A step queued on the runner: its SchedulerOutput, its output to wait for, and the tracked requests it was
    submitted for (by id; None where the engine tracks none)."""

    sched: SchedulerOutput
    pending: PendingOutput
    tracked: dict[str, _Tracked | None]
    submitted_at: float  # time.monotonic() as it was submitted


# fla-core 0.6's l2norm kernel (run inside its chunked KDA) keys its tuning on ceil(rows / 65536), rows = a step's
# tokens x KDA heads: each bucket tunes when a step first falls in it
_L2NORM_BUCKET_ROWS = 65536


# the KDA prefill's recurrent kernel takes a step whose longest prompt has at most this many tokens, fla-core's chunked
# kernel a longer one (kernels.kda.RECURRENT_PREFILL_MAX_LEN; tests/core/test_prefill_warmup.py checks they agree)
MIXED_WARMUP_SHORT_PROMPT = 32


def prefill_warmup_lengths(max_tokens: int, kda_heads: int) -> list[int]:
    """Step token counts that meet every prefill path and length bucket of a step of up to max_tokens tokens: a
    short step (our recurrent kernel, up to 32 tokens) and one ending each l2norm bucket (fla-core's chunked KDA), the
    last max_tokens; and on each side of 32, a count that is a multiple of 16 and one that is not. Triton compiles a
    kernel once for each way its integer arguments fall (1, a multiple of 16, neither: a row count of our norms, say)
    and keeps it on the machine's disk: a server's ragged steps would otherwise compile the variants round counts
    never meet, and the reverse."""
    bucket = max(1, _L2NORM_BUCKET_ROWS // max(1, kda_heads))
    short = min(16, max_tokens)
    lengths = {short, short + 1, *(min(end, max_tokens) for end in range(bucket, max_tokens + bucket, bucket))}
    if max_tokens > 33:  # the chunked path's steps: the longest round and ragged counts under the budget
        lengths |= {max_tokens // 16 * 16, max_tokens - 1 if (max_tokens - 1) % 16 else max_tokens - 2}
    return sorted(n for n in lengths if 1 <= n <= max_tokens)


class Engine:
    def __init__(self, model: str, engine_config: EngineConfig, progress=None, parallel: ParallelConfig = SINGLE):
        """parallel: rank 0 of a tensor-parallel group (whose other ranks run core/tensor_parallel.py's worker
        loop): each step's SchedulerOutput is broadcast to them, and the cache plan once."""
        self.config, self.parallel = engine_config, parallel
        self.mid_step = False  # a step's broadcast sent and its submit not returned (_submit)
        # rank 0 of a group of spawned workers: tensor_parallel's GroupWatch, the context every step runs in (it
        # raises a dead rank's RankError first, and ends the process when a step waits on that rank too long)
        self.group_watch = None
        check_device(engine_config.device)
        if engine_config.tensor_parallel_size != parallel.world_size:
            raise ValueError(f"tensor_parallel_size = {engine_config.tensor_parallel_size} but this engine runs on "
                             f"{parallel.world_size} process(es); start tensor parallel through LLM(...) or the CLI")
        self.model_config = ModelConfig.from_file(model, engine_config.quantization)
        if Path(model).is_file() and engine_config.load_format != "dummy":
            raise ValueError(f"{model} is a file: pass a model folder, or a config.json with load_format 'dummy'")
        self.tokenizer = load_tokenizer(model) if Path(model).is_dir() else None
        if self.tokenizer is not None:
            self.tokenizer.check_model_vocab(self.model_config.vocab_size, model)
        self.max_model_len = self._max_model_len()
        weights = self._load(model, progress)
        budget = ModelRunner.cache_budget(engine_config, weights)
        plan = plan_cache(self.model_config, engine_config, self.max_model_len, budget)
        broadcast_object(plan, parallel)  # every rank allocates the pages and slots this scheduler hands out
        log.info(describe_plan(plan))
        self.cache_plan = plan  # the pages and slots allocated, and their bytes
        self.runner = ModelRunner(weights, self.model_config, plan, DTYPES[engine_config.dtype], engine_config.device,
                                  engine_config.seed, cuda_graphs=parallel.world_size == 1,
                                  graph_max_context=self.max_model_len, num_decode_steps=engine_config.num_decode_steps,
                                  compile_decode=engine_config.compile_decode)
        self.scheduler = Scheduler(engine_config, CacheManager.from_plan(plan), self.max_model_len)
        self.eos_token_ids = tuple(sorted(set(self.model_config.eos_token_ids) | set(
            self.tokenizer.eos_token_ids if self.tokenizer else ())))
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        async_scheduling = engine_config.async_scheduling
        if async_scheduling is None:  # on where it hides something: the device runs apart from the host
            async_scheduling = engine_config.device != "cpu"
        self.async_scheduling = async_scheduling and parallel.world_size == 1
        self._inflight: _Submitted | None = None  # the next step, queued
        self.step_totals = {"decode": StepTotals(), "prefill": StepTotals()}  # read by metrics and benchmarks
        self._last_step_end = 0.0
        device = torch.device(engine_config.device)
        self._allocator_watch = AllocatorWatch(device, hint=(
            f"Lower --gpu-memory-utilization (now {engine_config.gpu_memory_utilization}) or allow expandable segments "
            "in PYTORCH_CUDA_ALLOC_CONF (deltaserve's default where it is unset)")) if device.type == "cuda" else None
        tuning = getattr(self.runner, "tuning_path", None)
        self._tuning_watch = TuningWatch(tuning) if tuning is not None else None
        self._compile_watch = CompileWatch() if tuning is not None and compile_watch.record() else None
        # each counts the steps and looks every few (kernels/step_watch.py)
        self._watches = tuple(w for w in (self._allocator_watch, self._tuning_watch, self._compile_watch)
                              if w is not None)
        self.structured: StructuredOutputManager | None = None  # made at the first constrained request
        # constrained requests whose grammar compiles, with the time after which they are refused
        self._compiling: dict[str, tuple[Request, Future, float]] = {}
        if engine_config.warmup_prefill and device.type == "cuda":
            self.warm_up_prefill()

    def _load(self, model: str, progress=None):
        """The weights, timed as a start-up phase; a bar over the tensors unless the caller draws its own."""
        bar = ProgressBar("loading weights", "tensor") if progress is None else None
        try:
            with phase("weights") as info:
                weights = ModelRunner.load_model(model, self.model_config, self.config, progress or bar, self.parallel)
                size = sum(p.numel() * p.element_size() for p in weights.parameters())
                info["detail"] = f"{size / 2**30:.2f} GiB" + (" (dummy)" if self.config.load_format == "dummy" else "")
        finally:
            if bar is not None:
                bar.close()
        return weights

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None) -> str:
        """Queue one prompt; ValueError (nothing queued) if it can never run."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params of type {type(params).__name__}: pass a SamplingParams")
        params.validate()  # again: its fields may have been set since it was made
        self._check_prompt(prompt_token_ids, params)
        req_id = request_id if request_id is not None else str(next(self._ids))
        req = Request(req_id, list(prompt_token_ids), params, self.eos_token_ids)
        detok = None if self.tokenizer is None else IncrementalDetokenizer(  # before the queue: it checks stop
            self.tokenizer, prompt_token_ids, skip_special_tokens=True, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output, min_tokens=params.min_tokens)
        if params.structured_outputs is None:
            self.scheduler.add_request(req)
        else:
            self._add_constrained(req, params.structured_outputs)
        self._tracked[req_id] = _Tracked(
            req, prompt, detok, [] if params.logprobs is not None else None,
            [None] if params.prompt_logprobs is not None else None,
            0.0 if params.logprobs is not None else None, {"arrival_time": req.arrival_time})
        return req_id

    def abort(self, req_id: str) -> None:
        self.scheduler.abort_request(req_id)
        self._tracked.pop(req_id, None)
        self._compiling.pop(req_id, None)
        if self.structured is not None:
            self.structured.release(req_id)

    def structured_outputs(self) -> StructuredOutputManager:
        """The structured-outputs manager (made now if this is the first use; xgrammar loads on its pool)."""
        if self.structured is None:
            self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
            self.runner.logits_processor = self.structured
        return self.structured

    def _add_constrained(self, req: Request, spec: StructuredOutputsParams) -> None:
        """Admit req once its grammar is compiled (now, if it is cached); ValueError for a constraint refused."""
        if self.parallel.world_size > 1:
            raise ValueError("structured outputs run on one process: the other tensor-parallel ranks sample without "
                             "the grammar's mask; use tensor_parallel_size 1")
        if req.sampling_params.ignore_eos:
            raise ValueError("ignore_eos cannot go with structured outputs: the output ends where its grammar does")
        if req.sampling_params.min_tokens:  # a grammar may allow only EOS, which min_tokens masks
            raise ParamError(f"min_tokens = {req.sampling_params.min_tokens} cannot go with structured outputs: the "
                             "output ends where its grammar does; leave min_tokens at 0", "min_tokens")
        if req.req_id in self._compiling:
            raise ValueError(f"request id {req.req_id!r} is already in the engine; give each request a unique id")
        self.scheduler.check_admissible(req)
        future = self._submit_grammar(spec)
        if future is not None and future.done():
            self._admit(req, future)
        else:
            self._compiling[req.req_id] = (req, future, time.monotonic() + structured_errors.COMPILE_TIMEOUT_S)

    def _submit_grammar(self, spec: StructuredOutputsParams) -> Future | None:
        """spec's compile (cached or queued now); None while the compiles in flight leave no room (the request waits
        outside the scheduler, as for its compile, and _admit_compiled asks again each step)."""
        try:
            return self.structured_outputs().submit(spec)
        except structured_errors.CompilesBusy:
            return None

    def _admit(self, req: Request, future: Future) -> None:
        compiled = future.result()  # a ValueError naming what is wrong when it failed
        self.scheduler.add_request(req)
        self.structured.start(req.req_id, req.sampling_params.structured_outputs, compiled)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Admit the requests whose grammar has compiled; one finished ("abort") output each for those whose grammar
        failed. With nothing else to run, first wait a little for one to compile."""
        if self._compiling and self._inflight is None and not self.scheduler.has_unfinished_requests():
            futures = [future for _, future, _ in self._compiling.values() if future is not None]
            if futures:
                wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)
            else:
                time.sleep(0.01)  # only requests waiting for room: a compile in flight ends on its own
        failed, now = [], time.monotonic()
        for req_id, (req, future, deadline) in list(self._compiling.items()):
            if future is None:  # no room when it came: ask again
                future = self._submit_grammar(req.sampling_params.structured_outputs)
                self._compiling[req_id] = (req, future, deadline)
            if not (future is not None and future.done()) and now <= deadline:
                continue
            del self._compiling[req_id]
            try:
                if future is None or not future.done():
                    raise structured_errors.CompileTimeout()
                self._admit(req, future)
            except ValueError as e:
                log.warning("request %s: its constraint cannot be used, aborted: %s", req_id, e)
                req.status = RequestStatus.FINISHED_ABORTED
                failed.append(self._output(self._tracked[req_id], time.monotonic()))
        return failed

    @property
    def model(self) -> torch.nn.Module:
        """The model the runner runs (this rank's shard), for tools that call it directly (parity)."""
        return self.runner.model

    def eager(self):
        """A context in which every step runs the model's eager forward (ModelRunner.eager: no CUDA graph, no
        compiled decode), so Python hooks inside the model see each step's real rows."""
        return self.runner.eager()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def cache_occupancy(self) -> CacheOccupancy:
        """The cache's pages and state slots now, in all and free."""
        return self.scheduler.cache.occupancy()

    def num_unfinished_output_tokens(self) -> int:
        """Output tokens generated so far by the requests still in the engine."""
        return sum(len(r.output_token_ids) for r in self.scheduler.requests.values())

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Prefix caching's counters (queries, hits, tokens) and pool use, read fresh; None when it is off."""
        return self.scheduler.cache.prefix_cache_stats()

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a step still in flight (all its requests stopped meanwhile: the next step() applies
        it, so the engine is idle, every pin and page back, once this is False)."""
        return self.scheduler.has_unfinished_requests() or bool(self._compiling) or self._inflight is not None

    @property
    def group_error(self) -> BaseException | None:
        """The RankError of a worker that exited while the group ran (group_watch saw it); None while it runs whole,
        and on one process."""
        return None if self.group_watch is None else self.group_watch.error

    def step(self) -> list[RequestOutput]:
        with contextlib.nullcontext() if self.group_watch is None else self.group_watch.waiting():
            failed = self._admit_compiled() if self._compiling else []
            busy = self.scheduler.has_unfinished_requests() or self._inflight is not None
            return failed + self._step() if busy else failed

    def _step(self) -> list[RequestOutput]:
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
        else:
            sched = self.scheduler.schedule()
            if not sched.num_scheduled_tokens and self.scheduler.has_unfinished_requests():
                # nothing is in flight, so the next call would schedule nothing again: a loop
                raise RuntimeError(
                    f"the scheduler scheduled nothing while {self.scheduler.num_running} running and "
                    f"{self.scheduler.num_waiting} waiting requests remain; this is a scheduler bug (a request "
                    "that can never get pages or a slot), not something to retry: abort the requests")
            step = self._submit(sched)
        held = None
        if self.async_scheduling and self.scheduler.has_unfinished_requests():
            ahead = self.scheduler.schedule()
            if any(n > 1 for n in ahead.num_scheduled_tokens.values()):
                held = ahead  # prompt chunks: queued once this step is applied (module docstring)
            else:
                self._keep_in_flight(self._submit(ahead))  # the runner drops the requests it lets go even so
        try:
            outputs = self._apply(step)
        finally:  # the scheduler counts held's tokens as computed: it runs even when applying this step failed
            if held is not None:
                self._keep_in_flight(self._submit(held))
        if self._inflight is not None:  # its sampling, if it waited for this step's tokens (penalties, grammars)
            self._inflight.pending.launch()
        return outputs

    def _keep_in_flight(self, submitted: _Submitted) -> None:
        if submitted.sched.num_scheduled_tokens:
            self._inflight = submitted

    def _submit(self, sched: SchedulerOutput) -> _Submitted:
        # mid_step stays True if an exception (Ctrl-C) ends the step here: the other ranks may then wait inside one
        # of its collectives, and tensor_parallel.stop_engine ends them instead of sending a stop they cannot hear
        self.mid_step = True
        broadcast_object(sched, self.parallel)  # the other ranks run the same step on their shards
        tracked = {req_id: self._tracked.get(req_id) for req_id in sched.num_scheduled_tokens}
        start = time.monotonic()  # before submit: on the CPU the step runs inside it
        submitted = _Submitted(sched, self.runner.submit(sched), tracked, start)
        self.mid_step = False
        return submitted

    def _apply(self, step: _Submitted) -> list[RequestOutput]:
        """Wait for a step's tokens, update the scheduler and build the outputs of the requests that progressed (those
        still tracked as they were when it was submitted: not a request given the same id since)."""
        sched, runner_out = step.sched, step.pending.result()
        self._count_step(step)
        updates = self.scheduler.update_from_output(sched, runner_out)
        starts = sched.start_positions() if runner_out.prompt_logprobs else {}
        for req_id, entries in runner_out.prompt_logprobs.items():
            tracked = step.tracked[req_id]
            if tracked is not None and tracked is self._tracked.get(req_id):
                self._add_prompt_logprobs(tracked, entries, starts[req_id])
        now = time.monotonic()
        outputs = []
        for req, new_ids in updates:
            tracked = self._tracked.get(req.req_id)
            if tracked is None or tracked.request is not req:
                continue
            taken = self._advance_grammar(req, new_ids)
            if taken or not new_ids:  # not when a refused token was taken back
                tracked.metrics.setdefault("first_token_time", now)
            new_ids = taken
            self._add_logprobs(tracked, runner_out.logprobs.get(req.req_id, [])[: len(new_ids)])
            self._detokenize(tracked, new_ids)
            outputs.append(self._output(tracked, now))
        return outputs

    def _count_step(self, step: _Submitted) -> None:
        """Add a step whose tokens have arrived to step_totals."""
        now, sched = time.monotonic(), step.sched
        totals = self.step_totals["prefill" if any(n > 1 for n in sched.num_scheduled_tokens.values()) else "decode"]
        totals.steps += 1
        totals.seconds += now - max(step.submitted_at, self._last_step_end)
        totals.tokens += sched.total_num_scheduled_tokens + sum(sched.num_lookahead_tokens.values())
        self._last_step_end = now
        for watch in self._watches:
            watch.step()

    def shutdown(self) -> None:
        """Tell the other ranks of a tensor-parallel group to stop (a no-op on one process); stop the grammar pool;
        save what kernels tuned since the watch last looked (save_tuning)."""
        try:
            self.save_tuning()
        finally:
            if self.structured is not None:
                self.structured.shutdown()
            if self.parallel.world_size > 1:
                broadcast_object(None, self.parallel)

    def warm_up_prefill(self) -> None:
        """Run one prefill step of each of prefill_warmup_lengths' token counts (random prompts, one token generated
        each; a count past the model's length split over several prompts of one step), then steps mixing decodes
        with a prompt (_warm_up_mixed_steps), so that the prefill kernels compile and tune at every length bucket a
        step of up to max_num_batched_tokens meets, and the kernel variants a server's mixed steps take are built,
        before the engine takes requests; then save what tuned and zero the step counters. The prompts' pages stay
        in the prefix cache until evicted, like any finished request's."""
        cfg, longest = self.config, self.max_model_len - 1  # a prompt's most tokens, with one generated
        # the largest step there can be: the budget, or max_num_seqs prompts of the model's length
        totals = prefill_warmup_lengths(min(cfg.max_num_batched_tokens, cfg.max_num_seqs * longest),
                                        self.model_config.kda_num_heads // self.parallel.world_size)
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        rng = random.Random(0)
        compiles = compile_watch.COUNTS.copy()
        with phase("prefill warm-up") as info:
            for total in totals:
                count = min(cfg.max_num_seqs, -(-total // longest))
                for i in range(count):  # count prompts of one step, their lengths summing to total where they can
                    length = min(longest, total // count + (i < total % count))
                    self.add_request(self._random_prompt(rng, length), params)
                while self.has_unfinished_requests():
                    self.step()
            mixed = self._warm_up_mixed_steps(rng, params)
            info["detail"] = "steps of " + ", ".join(map(str, totals)) + " prompt tokens"
            if mixed:
                info["detail"] += "; decodes beside a prompt (decodes+tokens): " + ", ".join(mixed)
            if self._compile_watch is not None:
                info["detail"] += "; " + compile_watch.COUNTS.since(compiles).describe()
        self.save_tuning()
        for watch in self._watches:  # the serving steps count from 1
            watch.rebase()  # what the warm-up tuned, compiled or retried is the phase's (saved, logged above)
        self.step_totals = {"decode": StepTotals(), "prefill": StepTotals()}

    def _warm_up_mixed_steps(self, rng: random.Random, params: SamplingParams) -> list[str]:
        """Steps that mix decodes with a prefill, as a server's do while prompts arrive: 1, 2, 3, each power of two
        below max_num_seqs and max_num_seqs - 1 decode rows beside a prompt of ragged length on each side of
        MIXED_WARMUP_SHORT_PROMPT (our recurrent KDA kernel's limit, and fla-core's chunked path). The prefill's
        tensors are then slices past the decodes' rows, whose pointers Triton specializes by their alignment, and the
        decodes run eagerly at counts of their own (the MLA decode's merge tiles follow the count's power of two):
        kernel variants the prefill-only steps do not build (a GPU test found 12 built while serving, BENCHMARKS.md
        stop 51; 11 after stop 51's rounds, stop 52). The decode rows are one-token prompts (a step's decode rows are
        its one-token sequences) added with the prompt, so the step mixes them whatever the scheduler does: with
        asynchronous scheduling (a GPU's default), requests that had started decoding finished before a prompt added
        after them was scheduled, and no step of stop 51's rounds mixed. Each then decodes three tokens. None with
        one sequence at a time; prompts within the step budget and the model's length. Returns "decodes+prompt
        tokens" of each mixed round run."""
        cfg, longest = self.config, self.max_model_len - 1
        decoding = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        most = min(cfg.max_num_seqs - 1, cfg.max_num_batched_tokens - 2)  # decode rows beside a prompt of 2 tokens
        rounds = []
        if longest < 4 or most < 1:  # a decoding request's one token and four generated within the model's length
            return rounds
        counts = sorted({c for c in (1, 2, 3, most) if c <= most} | {1 << i for i in range(most.bit_length())})
        for count in counts:
            ragged = 1 + (count - 1) % 7  # 1 to 7 tokens past a multiple of 8: the short prompt stays short
            for length in (MIXED_WARMUP_SHORT_PROMPT - 8 + ragged, MIXED_WARMUP_SHORT_PROMPT + 8 + ragged):
                length = min(length, longest, cfg.max_num_batched_tokens - count)
                for _ in range(count):
                    self.add_request(self._random_prompt(rng, 1), decoding)
                self.add_request(self._random_prompt(rng, length), params)
                while self.has_unfinished_requests():
                    self.step()
                rounds.append(f"{count}+{length}")
        return rounds

    def _random_prompt(self, rng: random.Random, length: int) -> list[int]:
        return [rng.randrange(self.model_config.vocab_size) for _ in range(length)]

    def save_tuning(self) -> None:
        """Save the kernels' autotuning decisions made since the watch last looked to the machine's file (on a GPU),
        so that a process started next (serve's engine process after an offline run in this one) finds them."""
        if self._tuning_watch is not None:
            self._tuning_watch.check()

    def _max_model_len(self) -> int:
        """The engine option, else the smaller of the model's and the tokenizer's limits."""
        limits = [self.model_config.max_position_embeddings]
        if self.tokenizer is not None and self.tokenizer.model_max_length:
            limits.append(self.tokenizer.model_max_length)
        wanted = self.config.max_model_len
        if wanted is not None and wanted > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len = {wanted} exceeds the model's limit "
                             f"({self.model_config.max_position_embeddings} in config.json); pass a smaller value")
        return wanted or min(limits)

    def _check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError(f"prompt token id {bad!r} is out of range: ids must be integers in [0, {vocab})",
                             "prompt")
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
            bad = next((t for t in ids or () if t >= vocab), None)
            if bad is not None:
                raise ParamError(f"{name} names token id {bad}, past this model's vocabulary: ids must be in "
                                 f"[0, {vocab})", name)
        if params.min_tokens and params.allowed_token_ids:  # every id masked: a row of -inf, whose draw is garbage
            if ending_ids(params, self.eos_token_ids).issuperset(params.allowed_token_ids):
                raise ParamError(f"allowed_token_ids = {params.allowed_token_ids!r:.80} are all stop or EOS ids, "
                                 f"which min_tokens = {params.min_tokens} masks: nothing could be sampled; allow "
                                 "another id or leave min_tokens at 0", "allowed_token_ids")
        if params.stop and self.tokenizer is None:
            raise ParamError("stop strings need a tokenizer and this model folder has none; "
                             "use stop_token_ids instead", "stop")
        if params.n != 1:
            raise ParamError(f"SamplingParams.n = {params.n}: an engine request is one sequence; LLM.generate runs "
                             "n requests for it (deltaserve.entrypoints.llm.fan_out), or add n requests", "n")

    def _advance_grammar(self, req: Request, new_ids: list[int]) -> list[int]:
        """Move a constrained request's matcher over its new tokens; returns those it took. A token its grammar
        refuses (xgrammar's mask allowed it) is taken back with any after it, kept out of the mask, and the request
        samples that position again (Scheduler.rewind), also where that token had ended it; where
        StructuredOutputManager.refuse says not to (too many refused there, or none left to sample), the request
        ends as aborted instead. So does a grammar whose mask is too slow to fill (StructuredOutputManager.too_slow).
        It never continues outside its grammar."""
        if self.structured is None:
            return new_ids
        taken = self.structured.accept(req.req_id, new_ids)
        if taken < len(new_ids):
            refused = new_ids[taken]
            num_outputs = len(req.output_token_ids) - len(new_ids) + taken
            if not self.structured.refuse(req.req_id, refused):
                log.error("request %s: its grammar refused the sampled token %d (xgrammar's mask allowed it); "
                          "aborting it", req.req_id, refused)
                self.scheduler.finish_requests([req.req_id], RequestStatus.FINISHED_ABORTED)
                req.status = RequestStatus.FINISHED_ABORTED  # also where that token had ended it
                del req.output_token_ids[num_outputs:]
            else:
                log.warning("request %s: its grammar refused the sampled token %d (xgrammar's mask allowed it); "
                            "sampling output position %d again without it", req.req_id, refused, num_outputs)
                self.scheduler.rewind(req, num_outputs)
            return new_ids[:taken]
        if self.structured.too_slow(req.req_id):
            log.warning("request %s: its grammar's mask took over %g s a token at %d steps in a row, holding up the "
                        "batch; aborting it (an ambiguous grammar: make its alternatives exclusive)", req.req_id,
                        structured_manager.FILL_LIMIT_S, structured_manager.FILL_STRIKES)
            self.scheduler.finish_requests([req.req_id], RequestStatus.FINISHED_ABORTED)
        return new_ids

    def _detokenize(self, tracked: _Tracked, new_ids: list[int]) -> None:
        if tracked.detokenizer is None:
            return
        req = tracked.request
        if req.status == RequestStatus.FINISHED_STOPPED and not req.sampling_params.include_stop_str_in_output:
            new_ids = new_ids[:-1]  # the eos or stop token that ended it is not in the text (vLLM)
        tracked.detokenizer.push(new_ids)
        if tracked.detokenizer.stopped is not None and req.status != RequestStatus.FINISHED_STOPPED:
            req.stop_reason = tracked.detokenizer.stopped
            if req.status.finished:  # a stop string wins over the length limit reached at the same token (vLLM)
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_requests([req.req_id], RequestStatus.FINISHED_STOPPED)
        if req.status.finished:
            tracked.detokenizer.finish()

    def _add_logprobs(self, tracked: _Tracked, entries: list[Logprobs]) -> None:
        for entry in entries:
            tracked.logprobs.append(self._as_dict(entry))
            tracked.cumulative_logprob += entry.logprobs[0]

    def _add_prompt_logprobs(self, tracked: _Tracked, entries: list[Logprobs], start: int) -> None:
        """entries score the prompt tokens from the one after this step's first position (start) on; a recompute
        after a preemption starts again at position 0, so its first entries repeat ones already kept."""
        if tracked.prompt_logprobs is None:
            return
        first_scored = start + 1
        num_repeated = len(tracked.prompt_logprobs) - first_scored
        tracked.prompt_logprobs.extend(self._as_dict(e) for e in entries[num_repeated:])

    def _as_dict(self, entry: Logprobs) -> dict[int, Logprob]:
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer else (lambda t: None)
        return {t: Logprob(lp, rank, decode(t)) for t, lp, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)}

    def _output(self, tracked: _Tracked, now: float) -> RequestOutput:
        req = tracked.request
        finished = req.status.finished
        if finished:
            tracked.metrics["finish_time"] = now
            self._tracked.pop(req.req_id, None)
            if self.structured is not None:
                self.structured.release(req.req_id)
        text = tracked.detokenizer.output_text if tracked.detokenizer else ""
        completion = CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason, req.stop_reason,
                                      list(tracked.logprobs) if tracked.logprobs is not None else None,
                                      tracked.cumulative_logprob)
        return RequestOutput(req.req_id, tracked.prompt, req.prompt_token_ids, [completion], finished,
                             tracked.prompt_logprobs, dict(tracked.metrics), req.num_cached_tokens)

