"""ModelRunner: the only holder of device tensors. Turns a SchedulerOutput into one forward pass and samples.

Per step: update the requests (a new one's KDA slot zeroed, or restored from a prefix-cache snapshot), run the model
once over all new tokens (decodes first, then prefill chunks), compute logits only where a token is sampled or
prompt logprobs are asked for, sample, and copy the KDA states the scheduler asked to keep into snapshot slots; then
any lookahead decode steps, each step's tokens the next one's inputs on the device. submit() queues it all without
waiting (but for prompt logprobs); the host waits in PendingOutput.result(), once a step.

The step before may still be in flight (asynchronous scheduling): a decode whose input token that step samples
takes it from the device (the last tokens the runner sampled), so the host never waits between the two."""

from __future__ import annotations

import gc
import itertools
import logging
from contextlib import contextmanager

import torch

from deltaserve.cache.sizing import CachePlan
from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.distributed import SINGLE, ParallelConfig, all_reduce, check_divisible
from deltaserve.forward_batch import ForwardBatch
from deltaserve.kernel_options import KernelOptions
from deltaserve.kernels import cpu_gemv
from deltaserve.kernels.cache_ops import copy_rows
from deltaserve.kernels.sampling import mix64
from deltaserve.kernels.tuning_cache import persist_tuning, restore_tuning
from deltaserve.kernels.varlen import to_device
from deltaserve.layers.linear import Linear
from deltaserve.layers.moe import MoE
from deltaserve.loader.model_loader import DTYPES, build_model, init_dummy_weights, load_model
from deltaserve.runner.caches import allocate_caches
from deltaserve.runner.cuda_graph import DecodeGraphs, graph_width
from deltaserve.runner.host_batch import ROW_COPY_MIN_PAGES, HostBatch, cache_slots
from deltaserve.runner.logprobs import prompt_logprobs
from deltaserve.runner.startup import phase
from deltaserve.runner.step_sampler import PendingOutput, RequestState, StepSampler
from deltaserve.runner_output import RunnerOutput
from deltaserve.scheduler_output import SchedulerOutput

log = logging.getLogger("deltaserve")
ACTIVATION_RESERVE_BYTES = 4 << 30  # left free on a GPU for a step's activations and the CUDA graphs
_ONE_THREAD_MAX_TOKENS = 4  # steps of up to this many tokens run on one thread (more add overhead, not bandwidth)
# compile_decode: decode steps of up to this many requests (bound by per-op costs; larger ones by their matrix
# products, where a graph a batch size would cost compile time for little)
COMPILED_DECODE_MAX_SEQS = _ONE_THREAD_MAX_TOKENS


class ModelRunner:
    def __init__(self, model, model_config: ModelConfig, plan: CachePlan, dtype: torch.dtype, device: str,
                 seed: int = 0, cuda_graphs: bool = True, graph_max_context: int | None = None,
                 num_decode_steps: int = 1, compile_decode: bool = False):
        self.model, self.cfg, self.plan, self.device = model, model_config, plan, torch.device(device)
        if self.device.type == "cuda" and dtype == torch.float32:
            # float32 is the exact regime: no TF32 in matmuls, nor in any cuDNN convolution (PyTorch allows it there
            # by default; the model's own convs are Triton kernels on a GPU); process-wide, as PyTorch offers it
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        # the last page and slot are scratch space for the padding rows of CUDA graphs; never handed out
        with phase("cache allocation"):
            latent_dtype = getattr(torch, plan.latent_dtype) if plan.latent_dtype else dtype
            _check_latent_dtype(latent_dtype, self.device)
            self.caches = allocate_caches(model.cache_specs(), plan.num_blocks + 1, plan.block_size,
                                          plan.num_slots + 1, dtype, self.device, latent_dtype,
                                          plan.num_snapshot_slots)
        # kernels tuned by an earlier run on this GPU (and Triton) skip their tuning
        tuning = restore_tuning(self.device) if self.device.type == "cuda" else None
        self.tuning_path = tuning  # the machine's file of autotuning decisions (GPUs only)
        self.requests: dict[str, RequestState] = {}
        # logits_processor(req_ids, logits [B, V]) -> logits: called where a step samples (structured outputs'
        # token bitmask); lookahead steps never carry a request it would change (SamplingParams.host_between_tokens)
        self.logits_processor = None
        self._last_sampled: tuple[list[str], torch.Tensor] | None = None  # the last step's last tokens, on the device
        self._unlaunched: PendingOutput | None = None  # a step whose sampling waits for the step before (_launch)
        # mixed: every bit of the seed reaches the low 32 bits, all that a CPU generator keeps
        self.generator = torch.Generator(device=self.device).manual_seed(mix64(seed))
        self.cpu_threads = torch.get_num_threads() if self.device.type == "cpu" else None
        self.compiled_decode = None
        self._compiled_sizes: set[int] = set()  # the decode batch sizes compile_decode has run (said once each)
        if compile_decode and self.device.type == "cpu":
            # the CPU's CUDA graphs: a decode step's ~460 small ops in one compiled graph (EngineConfig.compile_decode).
            # One graph a batch size (up to COMPILED_DECODE_MAX_SEQS) and thread count; the block table's width is
            # dynamic. fullgraph: a graph break is a bug (the CPU kernels take graph-safe forms while traced)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                       4 * COMPILED_DECODE_MAX_SEQS)
            self.compiled_decode = torch.compile(model.forward, fullgraph=True, dynamic=False, options={
                "cpp_wrapper": True, "guard_filter_fn": _model_shape_guards})
        self.graphs = None
        # the staging side of the next graph step's inputs (DecodeGraphs.run): steps alternate, since a step stages its
        # inputs while the step before it may be in flight
        self._staging_side = 0
        if cuda_graphs and self.device.type == "cuda" and dtype != torch.float32:  # float32: the exact, eager path
            # graph_max_context: the longest context decoded through a graph (the engine passes the model length;
            # never more than the cache holds), where the static block table stays small
            cache_tokens = plan.num_blocks * plan.block_size
            longest = min(graph_max_context or cache_tokens, cache_tokens)
            width = graph_width(longest, plan.block_size, plan.num_slots)
            self.graphs = DecodeGraphs(model, self.caches, plan.num_slots, width, plan.block_size, plan.num_slots,
                                       plan.num_blocks, self.device, num_stages=num_decode_steps)
            with torch.inference_mode():
                self.graphs.capture()
            persist_tuning(tuning)  # now as well as at exit: a process that is killed keeps these

    @staticmethod
    def load_model(folder: str, model_config: ModelConfig, engine: EngineConfig, progress=None,
                   parallel: ParallelConfig = SINGLE):
        """The model (this rank's shard) on engine.device: its weights from `folder`, or random ones with
        load_format 'dummy'."""
        if engine.threads:
            torch.set_num_threads(engine.threads)
        check_divisible(model_config, parallel)
        dtype = DTYPES[engine.dtype]
        if engine.load_format == "dummy":
            model = build_model(model_config, dtype, engine.device, parallel)
            init_dummy_weights(model, engine.seed, seed_per_parameter=parallel.world_size > 1)
        else:
            model = load_model(folder, model_config, dtype, engine.device, progress, parallel)
        options = kernel_options(engine, parallel)
        model.set_kernel_options(options)
        if engine.device == "cpu" and dtype == torch.float32 and (engine.compile_decode or not options.cpu_gemv):
            _input_major_weights(model)  # for MKL's float32 products; kernels.cpu_gemv reads them output-major
        return model.eval()

    @staticmethod
    def cache_budget(engine: EngineConfig, model: torch.nn.Module) -> int | None:
        """Bytes for the cache on a GPU (gpu_cache_budget, from the card's memory now and this model's weights);
        None on the CPU or with cache_bytes set (plan_cache then sizes from those)."""
        if engine.device == "cpu" or engine.cache_bytes is not None:
            return None
        gc.collect()  # an engine dropped earlier in this process, held only by reference cycles, gives its memory back
        torch.cuda.empty_cache()  # and what PyTorch keeps cached counts as free
        free, total = torch.cuda.mem_get_info(torch.device(engine.device))
        weights = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
        return gpu_cache_budget(total, free, weights, engine.gpu_memory_utilization)

    @contextmanager
    def eager(self):
        """Within it, every step runs the model's eager forward (no CUDA graph, no compiled CPU decode): the same
        computation, where Python code called from inside the model (a routing observer) runs on every step and sees
        only the step's real rows (a graph replays without Python and pads its batch)."""
        graphs, compiled = self.graphs, self.compiled_decode
        self.graphs = self.compiled_decode = None
        try:
            yield
        finally:
            self.graphs, self.compiled_decode = graphs, compiled

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one scheduler step and return its sampled tokens (waits for the device)."""
        return self.submit(sched).result()

    @torch.inference_mode()
    def submit(self, sched: SchedulerOutput) -> PendingOutput:
        """Queue one scheduler step; its PendingOutput's result() waits for its sampled tokens (a step with prompt
        logprobs has waited for those already). The step before it may still be in flight (module docstring)."""
        if self._unlaunched is not None:  # the step before's sampling comes first: this step may read its tokens
            self._unlaunched.launch()
        self._update_requests(sched)
        last, self._last_sampled = self._last_sampled, None  # only the step right after may read them
        order = sorted(sched.num_scheduled_tokens, key=lambda r: sched.num_scheduled_tokens[r] != 1)
        if not order:
            return PendingOutput(RunnerOutput([], {}))
        num_steps = 1 + self._lookahead(sched, order)
        saves, splits = self._snapshot_saves(sched, order, num_steps)
        host, missing = self._host_batch(order, sched.num_scheduled_tokens, splits)
        if self.cpu_threads is not None:
            # a step of a few tokens is bound by memory bandwidth, which one core already saturates here, and
            # per-op overhead, which more threads only raise (and a busy machine multiplies): one thread for those
            few = len(host.input_ids) <= _ONE_THREAD_MAX_TOKENS
            torch.set_num_threads(1 if few else self.cpu_threads)
        out = RunnerOutput(req_ids=list(order), sampled_token_ids={r: [] for r in order})
        side, self._staging_side = self._staging_side, 1 - self._staging_side
        input_ids, tokens, sampling, sampler = self._missing_inputs(host, missing, last), [], [], None
        for step in range(num_steps):
            step_host = host if step == 0 else host.advanced(step, self.plan.block_size)
            logits_at = self._run(step_host, input_ids, step, side)
            if step == 0:
                sampling = self._advance(order, host.query_lens, logits_at, out)
                if sampling and not self._waits_for_outputs(sampling):
                    sampler = self._step_sampler(sampling)
                elif num_steps > 1:
                    raise ValueError("lookahead steps for a request whose sampling waits for the step before "
                                     "(penalties, a grammar): the scheduler gives such a step no lookahead")
            if sampler is not None:
                input_ids = sampler.sample(logits_at, step)
                tokens.append(input_ids)
            if saves:
                self._copy_states(saves[step], to_snapshots=True)
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)  # the process's setting, as the caller left it
        if not sampling:  # result() still waits for the step: a graph's staging block is refilled only after
            return PendingOutput(out, copied=self._step_done())
        if sampler is None:
            self._unlaunched = PendingOutput(launch=lambda: self._launch(sampling, logits_at, out))
            return self._unlaunched
        return self._pending(sampler, tokens, out)

    def _pending(self, sampler: StepSampler, tokens: list[torch.Tensor], out: RunnerOutput) -> PendingOutput:
        """The step's output, its last tokens kept on the device for the step after (_missing_inputs)."""
        self._last_sampled = [s.req_id for s in sampler.states], tokens[-1]
        return sampler.pending(tokens, out, self._to_host)

    @staticmethod
    def _waits_for_outputs(sampling: list[tuple[RequestState, int]]) -> bool:
        """Whether a request that samples here reads its outputs on the host (penalties, a grammar's mask) while the
        step before, whose token is this step's input, is still in flight: its sampling then waits for that step
        to be applied (PendingOutput.launch), as vLLM defers its grammar's bitmask."""
        return any(state.sampling_params.samples_from_outputs and state.num_computed_tokens > len(state.token_ids)
                   for state, _ in sampling)

    @torch.inference_mode()
    def _launch(self, sampling: list[tuple[RequestState, int]], logits_at, out: RunnerOutput) -> PendingOutput:
        """Sample a step whose sampling waited for the step before to be applied (its tokens are now in the
        requests' token lists, and the grammars have accepted them); logits_at still reads this step's logits (a
        graph's buffer is rewritten only by a later step, queued after this)."""
        self._unlaunched = None
        sampler = self._step_sampler(sampling)
        tokens = [sampler.sample(logits_at, 0)]
        return self._pending(sampler, tokens, out)

    @staticmethod
    def _lookahead(sched: SchedulerOutput, order: list[str]) -> int:
        """The step's lookahead decode steps: the same count for every request, all decodes (the scheduler's rule)."""
        if not sched.num_lookahead_tokens:
            return 0
        counts = set(sched.num_lookahead_tokens.values())
        if len(counts) > 1 or len(sched.num_lookahead_tokens) != len(order) or \
                sched.total_num_scheduled_tokens != len(order):
            raise ValueError(f"lookahead tokens {sched.num_lookahead_tokens} for scheduled tokens "
                             f"{sched.num_scheduled_tokens}: lookahead needs every request of the step to decode one "
                             "token with the same lookahead")
        return counts.pop()

    def _snapshot_saves(self, sched: SchedulerOutput, order: list[str], num_steps: int
                        ) -> tuple[list[list[tuple[int, int]]], list[tuple[int, int, int]]]:
        """Where the step makes its snapshot saves (a save's position is where its request's computed tokens then
        stand): per step of this one (its lookahead steps after it), the (state slot, snapshot slot) copies after it
        ([] when no step ends at a save); and the saves inside a prefill chunk, as (the sequence's row in `order`,
        tokens of its chunk before the save, snapshot slot), made by the KDA layers (forward_batch.SnapshotSplit)."""
        if not sched.snapshot_saves:
            return [], []
        saves, splits = [[] for _ in range(num_steps)], []
        rows = {self.requests[r].state_slot: row for row, r in enumerate(order)}
        for save in sched.snapshot_saves:
            slot, snapshot, position = save
            row = rows.get(slot)
            if row is not None:
                start = self.requests[order[row]].num_computed_tokens
                end = start + sched.num_scheduled_tokens[order[row]]
                if start < position < end and all(split[0] != row for split in splits):
                    splits.append((row, position - start, snapshot))
                    continue
                if 0 <= position - end < num_steps:
                    saves[position - end].append((slot, snapshot))
                    continue
            starts = {self.requests[r].state_slot: self.requests[r].num_computed_tokens for r in order}
            chunks = {slot: (a, a + sched.num_scheduled_tokens[r]) for (slot, a), r in zip(starts.items(), order)}
            raise ValueError(f"snapshot save {save} names a state slot or position no step of this one reaches "
                             f"(chunks by state slot {chunks}, {num_steps - 1} lookahead steps; at most one save "
                             "inside a chunk)")
        return saves, splits

    def _run(self, host: HostBatch, input_ids: torch.Tensor | None, stage: int, side: int):
        """One forward pass over host's tokens (input_ids on the device when given, else host.input_ids); returns
        logits_at(rows) -> logits [len(rows), V] float32 at those token rows."""
        if self.graphs is not None and self.graphs.can_run(host):
            logits = self.graphs.run(host, input_ids=input_ids, stage=stage, side=side)
            return lambda rows: _rows(logits, rows)
        host_ids, batch = host.to_device(self.device)
        hidden = self._forward(host_ids if input_ids is None else input_ids, batch)
        return lambda rows: self.model.compute_logits(_rows(hidden, rows))

    def _missing_inputs(self, host: HostBatch, missing: list[tuple[int, str]],
                        last_sampled: tuple[list[str], torch.Tensor] | None) -> torch.Tensor | None:
        """The step's input ids on the device where some are the step in flight's samples (missing: (row, req_id)),
        taken from the last tokens that step sampled (last_sampled: its requests and [S] tokens); None when the host
        has them all."""
        if not missing:
            return None
        if last_sampled is None:
            raise ValueError(f"requests {[r for _, r in missing]} decode a token the step before did not sample")
        order, last = last_sampled
        if len(missing) == len(host.input_ids) == len(order) and all(
                row == i and req_id == order[i] for i, (row, req_id) in enumerate(missing)):
            return last  # every input is the step before's token, in its order: a decode step scheduled ahead
        index = {req_id: i for i, req_id in enumerate(order)}
        if any(req_id not in index for _, req_id in missing):
            raise ValueError(f"requests {[r for _, r in missing if r not in index]} decode a token that the step "
                             f"before (of {order}) did not sample")
        rows, sources = [row for row, _ in missing], [index[req_id] for _, req_id in missing]
        input_ids = to_device(host.input_ids, torch.int64, self.device)
        input_ids[to_device(rows, torch.int64, self.device)] = last[to_device(sources, torch.int64, self.device)]
        return input_ids

    def _forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The model's forward, through the compiled graph for a CPU decode step of a few requests (compile_decode)."""
        if self.compiled_decode is not None and batch.num_decodes == batch.num_seqs <= COMPILED_DECODE_MAX_SEQS:
            if batch.block_tables.shape[1] > 1:  # one graph for every width (dynamo specialises a size of 1)
                torch._dynamo.mark_dynamic(batch.block_tables, 1)
            if batch.num_seqs not in self._compiled_sizes:  # else tens of seconds pass with nothing said
                self._compiled_sizes.add(batch.num_seqs)
                log.info("compile_decode: compiling the decode step of %d request(s) (tens of seconds the first "
                         "time; torch.compile's disk cache makes a later process's quicker)", batch.num_seqs)
            try:
                return self.compiled_decode(input_ids, batch, self.caches)
            except torch._dynamo.exc.BackendCompilerFailed as e:  # before the graph ran: nothing was written
                # inductor could not build the graph (e.g. no working C++ compiler): the engine goes on eagerly
                log.warning("compile_decode: compiling the decode step failed, running eagerly from now on (%s)",
                            str(e).strip().splitlines()[0][:300])
                self.compiled_decode = None
        return self.model(input_ids, batch, self.caches)

    def _update_requests(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        restores = []
        for new in sched.new_reqs:
            self.requests[new.req_id] = RequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params, list(new.block_ids),
                new.state_slot, new.num_computed_tokens, new.min_tokens_stop_ids)
            if new.restore_snapshot_slot is not None:
                restores.append((new.restore_snapshot_slot, new.state_slot))
            elif new.num_computed_tokens == 0:
                for stack in self.caches.stacks.values():
                    stack[:, new.state_slot].zero_()
        self._copy_states(restores, to_snapshots=False)
        for cached in sched.cached_reqs:
            state = self.requests[cached.req_id]
            state.add_pages(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _copy_states(self, pairs: list[tuple[int, int]], to_snapshots: bool) -> None:
        """Copy whole KDA states (conv tails and recurrent state of every layer): pairs of (state slot, snapshot
        slot) into the snapshots, or pairs of (snapshot slot, state slot) into the state slots. One op a state name
        (kernels.cache_ops.copy_rows), whatever the layer count, and no wait for the device, so a save inside
        lookahead steps does not stall their queue."""
        if not pairs:
            return
        src = to_device([a for a, _ in pairs], torch.int64, self.device)
        dst = to_device([b for _, b in pairs], torch.int64, self.device)
        for name, snapshot in self.caches.snapshots.items():
            state = self.caches.stacks[name]
            copy_rows(*((state, snapshot) if to_snapshots else (snapshot, state)), src, dst)

    def _host_batch(self, order: list[str], num_tokens: dict[str, int], splits: list[tuple[int, int, int]]
                    ) -> tuple[HostBatch, list[tuple[int, str]]]:
        """The step's inputs (splits: its snapshot saves inside a chunk, from _snapshot_saves), and (row, req_id) of
        each input id the host does not have yet (0 in the batch): the last token of a request whose step in flight
        samples it."""
        ids, positions, slots, query_lens, starts, missing = [], [], [], [], [], []
        bs = self.plan.block_size
        for req_id in order:
            state, n = self.requests[req_id], num_tokens[req_id]
            start = state.num_computed_tokens
            known = state.token_ids[start: start + n]
            if len(known) < n:
                if len(known) != n - 1:
                    raise ValueError(f"request {req_id!r} computes tokens {start}..{start + n - 1} but the runner "
                                     f"has {len(state.token_ids)}: only its last token may be the step in flight's")
                missing.append((len(ids) + n - 1, req_id))
                known = known + [0]
            ids.extend(known)
            positions.extend(range(start, start + n))
            slots.extend(cache_slots(state.block_ids, start, n, bs))
            query_lens.append(n)
            starts.append(start)
        states = [self.requests[r] for r in order]
        tables = [s.block_ids for s in states]
        wide = max(map(len, tables), default=0) >= ROW_COPY_MIN_PAGES  # else the lists are converted (block_table)
        return HostBatch(ids, positions, slots, query_lens, starts, [s.state_slot for s in states], tables, splits,
                         [s.page_row for s in states] if wide else None), missing

    def _step_done(self) -> torch.cuda.Event | None:
        """An event that completes with the work queued so far (None on the CPU, where it has run already)."""
        if self.device.type == "cpu":
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done

    def _to_host(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """x copied to host memory, queued now: (the copy, an event that completes with it; None on the CPU). A
        step queued after this one does not delay it, as x.tolist() later would (it queues behind)."""
        if self.device.type == "cpu":
            return x, None
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)  # on x's device's current stream
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(x.device))  # that stream: the current device may be another card
        return host, copied

    def _advance(self, order: list[str], query_lens: list[int], logits_at,
                 out: RunnerOutput) -> list[tuple[RequestState, int]]:
        """Advance the requests' computed tokens by the step's, score prompt logprobs, and return the requests whose
        chunk reaches the end of their tokens, with the step's row of each one's last token."""
        sampling = []  # (state, row of its last token)
        for req_id, end, n in zip(order, itertools.accumulate(query_lens), query_lens):
            state = self.requests[req_id]
            state.num_computed_tokens += n
            if state.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs(state, end - n, n, logits_at, out)
            if state.num_computed_tokens >= len(state.token_ids):
                sampling.append((state, end - 1))
        return sampling

    def _step_sampler(self, sampling: list[tuple[RequestState, int]]) -> StepSampler:
        return StepSampler([s for s, _ in sampling], [row for _, row in sampling], self.cfg.vocab_size, self.generator,
                           self.logits_processor)

    def _prompt_logprobs(self, state: RequestState, first_row: int, n: int, logits_at, out: RunnerOutput) -> None:
        """Logprobs of the prompt tokens this chunk predicts (position p predicts token p + 1)."""
        start = state.num_computed_tokens - n
        last = min(state.num_computed_tokens, state.num_prompt_tokens - 1)  # the last prompt position to score
        if last <= start:
            return
        logits = logits_at(list(range(first_row, first_row + last - start)))
        targets = state.token_ids[start + 1: last + 1]
        out.prompt_logprobs[state.req_id] = prompt_logprobs(logits, targets, state.sampling_params.prompt_logprobs)


# of the guards dynamo puts on the model's modules, those that tell one model's shape from another's (layer counts,
# config constants, parameter shapes and dtypes): compiled graphs are cached per code object, so a second engine in
# the process, on another model, must not match the first's. The rest check that nothing changed the modules.
_MODEL_SHAPE_GUARDS = ("SEQUENCE_LENGTH", "CONSTANT_MATCH", "EQUALS_MATCH", "TENSOR_MATCH")


def _check_latent_dtype(latent_dtype: torch.dtype, device: torch.device) -> None:
    """A float8 latent cache on a GPU needs float8 loads in Triton: compute capability 8.9 (Ada, Hopper) or later."""
    if latent_dtype == torch.float8_e4m3fn and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"kv_cache_dtype 'fp8' needs a GPU of compute capability 8.9 or later (Ada, Hopper); "
                             f"{torch.cuda.get_device_name(device)} is {major}.{minor}: use kv_cache_dtype 'auto'")


def _model_shape_guards(entries) -> list[bool]:
    """compile_decode's guard_filter_fn: every guard on the inputs; on the model's modules, the shape-telling ones."""
    return [not e.orig_guard.source.is_unspecialized_nn_module() or e.guard_type in _MODEL_SHAPE_GUARDS
            for e in entries]


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for increasing rows: x itself when they are all its rows (a step of decodes), which spares a gather."""
    return x if len(rows) == x.shape[0] else x[rows]


def gpu_cache_budget(total: int, free: int, weights: int, utilization: float) -> int:
    """Cache bytes: `utilization` of the card (total bytes) less this model's weights and ACTIVATION_RESERVE_BYTES,
    and never more than is free now (after the weights) less the reserve: another engine in this process, or
    another process, keeps what it holds. May be negative; plan_cache then says what to change."""
    return min(int(total * utilization) - weights, free) - ACTIVATION_RESERVE_BYTES


def kernel_options(engine: EngineConfig, parallel: ParallelConfig = SINGLE) -> KernelOptions:
    """The engine's kernel choices for its model's layers: cpu_gemv where asked for, on the CPU, and built here (and,
    with tensor parallel, on every rank: the replicated router's logits must round alike on all of them, or a
    near-tie in its top-k would route a token differently on one rank), over this process's CPU threads."""
    use_gemv = engine.cpu_gemv and engine.device == "cpu" and cpu_gemv.available()
    if engine.device == "cpu" and parallel.world_size > 1:
        if int(all_reduce(torch.tensor([int(use_gemv)]), parallel)) < parallel.world_size:
            if use_gemv:
                log.warning("cpu_gemv is off on this rank: another rank could not build it")
            use_gemv = False
    return KernelOptions(cpu_gemv=use_gemv, cpu_threads=torch.get_num_threads(), norm_gemv=engine.norm_gemv,
                         pdl=engine.pdl)


def _input_major_weights(model: torch.nn.Module) -> None:
    """For float32 on the CPU where kernels.cpu_gemv is off (or compile_decode: its graph calls MKL), store the
    projection and expert weights input-major ([in, out] in memory; the logical shape and values unchanged): MKL's
    matrix-vector products then stream whole rows. Not for half precision, which decodes faster output-major.
    Skipped: kv_b_proj (MLA decode views it per head), an lm_head tied to the embedding (looked up by row), FP8."""
    params = [m.weight for name, m in model.named_modules() if isinstance(m, Linear) and not name.endswith("kv_b_proj")]
    params += [w for m in model.modules() if isinstance(m, MoE) for w in (m.w13, m.w2)]
    for param in params:
        if param is not model.embed_tokens.weight and param.dtype in (torch.float32, torch.bfloat16, torch.float16):
            param.data = param.data.transpose(-1, -2).contiguous().transpose(-1, -2)
