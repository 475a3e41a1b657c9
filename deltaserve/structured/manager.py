"""StructuredOutputManager: the engine's side of structured outputs.

Compiling happens on a small thread pool, never inside an engine step: submit() returns a Future (cached by the
constraint, so a repeated schema compiles once), and a request waits for it outside the scheduler while the others
step. Once compiled, a request gets a GrammarMatcher; at each step where it samples, the runner calls this object
(its logits processor) with the step's logits, and the rows of constrained requests get their disallowed tokens
set to -inf (kernels.token_bitmask, on the logits' device). The engine advances a matcher with every token the
scheduler accepts and releases it when the request finishes or is aborted."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from deltaserve.kernels.token_bitmask import apply_token_bitmask
from deltaserve.kernels.varlen import to_device
from deltaserve.sampling_params import StructuredOutputsParams
from deltaserve.structured import errors
from deltaserve.structured.backend import GrammarBackend
from deltaserve.structured.schema_check import checked

log = logging.getLogger("deltaserve")
MAX_CACHED_GRAMMARS = 256
COMPILE_THREADS = 2
# A request whose mask took longer than FILL_LIMIT_S at FILL_STRIKES of its steps in a row is ended: its fill holds
# up the sampling of every request in the batch (an ambiguous grammar's can take many decode steps: BENCHMARKS.md).
# Rows are timed alone only after a step whose fill took longer than FILL_LIMIT_S for each row a fill thread had.
FILL_LIMIT_S = 0.05
FILL_STRIKES = 4
# Tokens a request's matcher may refuse at one position of its output, each sampled again without it, before the
# request is ended: each costs a recompute of the request's tail (its full pages stay cached).
MAX_REFUSED_TOKENS = 8


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        if tokenizer is None:
            raise ValueError("structured outputs need a tokenizer (the grammar is over text) and this model folder "
                             "has none")
        self._backend_args = (tokenizer, vocab_size, stop_token_ids)
        self._backend: GrammarBackend | None = None  # built on a pool thread: it imports xgrammar (seconds)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="deltaserve-grammar")
        self._lock = threading.Lock()  # submit() comes from the server's thread, compiles from the pool's
        self._backend_lock = threading.Lock()  # apart: building the backend takes seconds, submit() must not wait
        self._compiled: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._matchers: dict[str, object] = {}
        self._json: set[str] = set()  # requests whose output is JSON: no raw control characters (backend.py)
        self._slow_fills: dict[str, int] = {}  # steps in a row at which a request's mask took over FILL_LIMIT_S
        self._banned: dict[str, set[int]] = {}  # tokens its matcher refused at its current position (refuse)

    def submit(self, spec: StructuredOutputsParams, wait_for_room: bool = False,
               deadline: float | None = None) -> Future:
        """A Future of spec's compiled grammar (its exception a ValueError naming what is wrong); what needs no
        xgrammar (a schema's keywords) is checked here and raised at once. A constraint not cached while
        MAX_COMPILES_IN_FLIGHT others compile raises CompilesBusy, or with wait_for_room waits until one has
        finished (an offline caller's batch of many schemas), CompileTimeout past deadline (time.monotonic()).
        Thread-safe."""
        checked(spec)
        while True:
            with self._lock:
                future = self._compiled.get(spec.key)
                in_flight = [] if future is not None else [f for f in self._compiled.values() if not f.done()]
                if future is None and len(in_flight) < errors.MAX_COMPILES_IN_FLIGHT:
                    future = self._compiled[spec.key] = self._pool.submit(self._compile, spec)
                    self._evict()
                if future is not None:
                    self._compiled.move_to_end(spec.key)
                    return future
            if not wait_for_room:
                raise errors.CompilesBusy()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise errors.CompileTimeout()
            wait(in_flight, timeout=left, return_when=FIRST_COMPLETED)

    def _evict(self) -> None:
        """Drop the least recently used compiled grammars past MAX_CACHED_GRAMMARS; never one still compiling (it
        would go on uncounted by the bound, and be compiled twice). Under self._lock."""
        excess = len(self._compiled) - MAX_CACHED_GRAMMARS
        for key in [key for key, future in self._compiled.items() if future.done()][:max(excess, 0)]:
            del self._compiled[key]

    def _compile(self, spec: StructuredOutputsParams):
        with self._backend_lock:
            if self._backend is None:
                self._backend = GrammarBackend(*self._backend_args)
        return self._backend.compile(spec)

    def start(self, req_id: str, spec: StructuredOutputsParams, compiled) -> None:
        """Give req_id a matcher at the grammar's start (its future has completed)."""
        self._matchers[req_id] = self._backend.matcher(compiled)
        if spec.key[0] in ("json", "json_object"):
            self._json.add(req_id)

    def accept(self, req_id: str, token_ids: list[int]) -> int:
        """Advance req_id's matcher over tokens the scheduler appended; returns how many it took: all, or those
        before the first its grammar refuses (xgrammar's mask allowed it: see refuse). A request without a matcher
        takes anything."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return len(token_ids)
        for i, token in enumerate(token_ids):
            if not matcher.accept_token(token):
                return i
            self._banned.pop(req_id, None)  # a ban holds at one position of the output
        return len(token_ids)

    def refuse(self, req_id: str, token_id: int) -> bool:
        """Keep token_id out of req_id's mask until its matcher takes a token, so that the engine may sample that
        position again (xgrammar 0.2.8's mask allows some tokens its matcher refuses, in bounded repetitions past
        128: BENCHMARKS.md). False when it should not: token_id was kept out already (nothing else was left to
        sample), or more than MAX_REFUSED_TOKENS have been refused there."""
        banned = self._banned.setdefault(req_id, set())
        if token_id in banned:
            return False
        banned.add(token_id)
        return len(banned) <= MAX_REFUSED_TOKENS

    def too_slow(self, req_id: str) -> bool:
        """Whether req_id's mask took longer than FILL_LIMIT_S at FILL_STRIKES of its steps in a row (the engine
        ends it)."""
        return self._slow_fills.get(req_id, 0) >= FILL_STRIKES

    def release(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)
        self._json.discard(req_id)
        self._slow_fills.pop(req_id, None)
        self._banned.pop(req_id, None)

    def __call__(self, req_ids: list[str], logits: torch.Tensor) -> torch.Tensor:
        """The runner's logits processor: logits [B, V] of req_ids (one row each) with the constrained rows masked
        to their grammar's next tokens; logits itself when no row is constrained."""
        rows = [i for i, req_id in enumerate(req_ids) if req_id in self._matchers]
        if not rows:
            return logits
        words = -(-self._backend.vocab_size // 32)
        bitmask = torch.empty(len(rows), words, dtype=torch.int32, pin_memory=logits.device.type == "cuda")
        matchers = [self._matchers[req_ids[i]] for i in rows]
        start = time.perf_counter()
        self._backend.fill(matchers, bitmask)
        rows_a_thread = -(-len(rows) // self._backend.fill_threads)
        if time.perf_counter() - start > FILL_LIMIT_S * rows_a_thread:  # some row may be slow: find which
            self._time_rows([req_ids[i] for i in rows], matchers, bitmask)
        else:  # every row was fast: strikes count slow steps in a row, so a one-off stall is forgiven
            for i in rows:
                self._slow_fills.pop(req_ids[i], None)
        for j, i in enumerate(rows):
            for token in self._banned.get(req_ids[i], ()):
                bitmask[j, token >> 5] &= ~(1 << (token & 31))
        json_rows = [j for j, i in enumerate(rows) if req_ids[i] in self._json]
        bitmask &= self._backend.text_safe_bitmask
        if json_rows:
            bitmask[json_rows] &= self._backend.json_safe_bitmask
        device_rows = to_device(rows, torch.int64, logits.device)
        return apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True), device_rows)

    def _time_rows(self, req_ids: list[str], matchers: list, bitmask: torch.Tensor) -> None:
        """After a slow fill, fill each row again alone (the same bits) to find whose mask is slow."""
        for j, (req_id, matcher) in enumerate(zip(req_ids, matchers)):
            start = time.perf_counter()
            self._backend.fill([matcher], bitmask[j : j + 1])
            if time.perf_counter() - start > FILL_LIMIT_S:
                self._slow_fills[req_id] = self._slow_fills.get(req_id, 0) + 1
            else:
                self._slow_fills.pop(req_id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._backend is not None:  # one being built now lets go of its compile workers when it is collected
            self._backend.close()
