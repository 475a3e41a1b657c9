"""The engine driven from asyncio, for the HTTP server: EngineClient.

The engine runs its core loop (core/engine_process.py) in a process of its own (EngineProcess: serve's default, so
that a step's host work never waits for the handlers on one GIL) or in a thread of the server's process
(EngineThread, over an engine built here). Either way the server talks to it over two pipes. Handlers add requests
(all or none, under a bound) and iterate a RequestStream of their outputs. A writer thread sends the adds, aborts and
compiles, so that the event loop never blocks on a full pipe while the core is in a step; a reader thread hands each
message of the core to the event loop, which answers the adds and routes each step's outputs (sent as what they
added) to the streams. The core applies adds and aborts between steps: an abort frees its pages and slot at a step
boundary, never in the middle of a step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from deltaserve.cache.manager import CacheOccupancy
from deltaserve.core.outputs import CompletionOutput, RequestOutput, StepTotals
from deltaserve.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from deltaserve.structured import errors
from deltaserve.structured.schema_check import checked

if TYPE_CHECKING:  # the server's process of an engine process imports no torch before it starts the engine
    from deltaserve.core.engine import Engine
    from deltaserve.core.engine_process import Delta

log = logging.getLogger("deltaserve")


class QueueFullError(Exception):
    """More requests than the engine runs plus the bounded queue; the client should retry later."""


class EngineStoppedError(Exception):
    """The engine loop has stopped (shutdown, or a failure it could not recover from)."""


@dataclass
class EngineInput:
    """One engine request: a prompt's token ids and how to sample it (one per prompt and choice)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges, read between steps: requests running and waiting, the cache's pools, and its steps so
    far by kind (Engine.step_totals)."""

    num_running: int
    num_waiting: int
    cache: CacheOccupancy
    steps: dict[str, StepTotals] = field(default_factory=dict)

    @classmethod
    def of(cls, engine: Engine) -> EngineStats:
        steps = {kind: replace(totals) for kind, totals in engine.step_totals.items()}
        return cls(engine.num_running, engine.num_waiting, engine.cache_occupancy(), steps)


@dataclass(frozen=True)
class EngineInfo:
    """What the server reads of the engine once, before any request: the tokenizer (None when the model folder has
    none), the context limit, the cache's size in tokens, the requests run at once, and the gauges at start."""

    tokenizer: object | None
    max_model_len: int
    cache_tokens: int
    max_num_seqs: int
    stats: EngineStats

    @classmethod
    def of(cls, engine: Engine) -> EngineInfo:
        stats = EngineStats.of(engine)
        return cls(engine.tokenizer, engine.max_model_len, stats.cache.num_blocks * stats.cache.block_size,
                   engine.config.max_num_seqs, stats)


class EngineObserver:
    """Hooks the loop calls (on the event loop, between steps) so that metrics need no lock; no-ops here."""

    def on_step(self, stats: EngineStats) -> None:
        """After every step and every batch of adds/aborts: the gauges (running, waiting, cache)."""

    def on_output(self, output: RequestOutput, num_new_tokens: int, first: bool) -> None:
        """A request progressed; first: its first output token(s)."""

    def on_abort(self, num_requests: int) -> None:
        """Requests aborted before they finished (client gone)."""


_ABORTED = object()  # queued into a stream when its consumer aborted it: no more outputs will come


class RequestStream:
    """The outputs of one HTTP request's engine requests (one per prompt and choice), in arrival order.

    Iterating yields (index into the inputs, cumulative RequestOutput) until every request has finished, the
    latest output of each request only when several wait (the consumer lagged); abort() ends the iteration and
    stops the unfinished requests. Both are for the event loop's thread."""

    def __init__(self, owner: EngineClient, req_ids: list[str]):
        self._owner = owner
        self.req_ids = req_ids
        self.unfinished = set(req_ids)
        self.num_tokens = dict.fromkeys(req_ids, 0)  # output tokens seen so far, for deltas and metrics
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        index = {req_id: i for i, req_id in enumerate(self.req_ids)}
        while self.unfinished:
            for item in await self._next_items():
                if item is _ABORTED:
                    return
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self.unfinished.discard(item.request_id)
                yield index[item.request_id], item

    async def _next_items(self) -> list:
        """What the queue holds (waiting for one item if empty), each request's outputs folded into its latest:
        outputs are cumulative, so a consumer that fell a step behind sends one chunk for both steps, not two."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        latest = {item.request_id: i for i, item in enumerate(items) if isinstance(item, RequestOutput)}
        return [item for i, item in enumerate(items) if not isinstance(item, RequestOutput)
                or latest[item.request_id] == i]

    def abort(self) -> None:
        """Stop every unfinished request of this stream (idempotent); their cache is freed at the next step."""
        if self.unfinished:
            self._owner._abort(list(self.unfinished))
            self.unfinished.clear()
        self._queue.put_nowait(_ABORTED)

    def _put(self, item) -> None:
        self._queue.put_nowait(item)


@dataclass
class PendingAdd:
    stream: RequestStream
    inputs: list[EngineInput]
    added: asyncio.Future


class EngineHandle(Protocol):
    """Where the core loop runs (EngineProcess, EngineThread): its pipes, what the server reads of the engine
    (info: it may wait for the engine to be built), whether it runs, and its stop."""

    to_child: object
    from_child: object

    @property
    def info(self) -> EngineInfo: ...

    def is_alive(self) -> bool: ...

    def close(self) -> None: ...


def rebuild_error(kind: str, message: str, param: str | None) -> BaseException:
    """An error the core sent as (kind, message, param) (engine_process.error_message), as the server maps it:
    structured outputs' own ValueErrors keep their class (a 400 naming the field, or a 429), other ValueErrors are
    ValueErrors (a 400; a ParamError when a field is named), anything else a RuntimeError."""
    if kind == "GrammarError":
        return errors.GrammarError(message, param)
    if kind in ("StructuredOutputsUnavailable", "CompilesBusy"):
        error = getattr(errors, kind).__new__(getattr(errors, kind))
        ValueError.__init__(error, message)
        return error
    if kind == "ValueError":
        return ValueError(message) if param is None else ParamError(message, param)
    return RuntimeError(message)


@dataclass
class _Assembly:
    """A request's output so far, rebuilt from the core's deltas."""

    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    prompt_logprobs: list | None = None

    def apply(self, d: Delta) -> RequestOutput:
        self.token_ids[d.token_start:] = d.token_ids
        self.text = self.text[:d.text_start] + d.text
        if d.logprobs is not None:  # None: not asked for
            self.logprobs = self.logprobs or []
            self.logprobs[d.logprobs_start:] = d.logprobs
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = self.prompt_logprobs or []
            self.prompt_logprobs[d.prompt_logprobs_start:] = d.prompt_logprobs
        completion = CompletionOutput(0, self.text, list(self.token_ids), d.finish_reason, d.stop_reason,
                                      None if self.logprobs is None else list(self.logprobs), d.cumulative_logprob)
        return RequestOutput(d.req_id, self.prompt, self.prompt_token_ids, [completion], d.finished,
                             None if self.prompt_logprobs is None else list(self.prompt_logprobs), d.metrics,
                             d.num_cached_tokens)


class EngineClient:
    """The server's side of an engine's core loop; see the module docstring."""

    def __init__(self, handle: EngineHandle, max_queue: int, observer: EngineObserver | None = None):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue = {max_queue!r}: must be an integer >= 0 (requests that may wait)")
        self.handle = handle
        self.info = handle.info
        self.capacity = self.info.max_num_seqs + max_queue  # engine requests accepted at once
        self.observer = observer or EngineObserver()
        self.num_reserved = 0  # engine requests accepted and not yet finished or aborted
        self._streams: dict[str, RequestStream] = {}
        self._stopped = False
        self._keys = iter(range(1 << 62))
        self._adds: dict[int, PendingAdd] = {}  # sent, not yet answered
        self._compiles: dict[int, asyncio.Future] = {}
        self._assemblies: dict[str, _Assembly] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._stopped and self.handle.is_alive()

    def start(self) -> None:
        """Start routing (on the running event loop)."""
        self._loop = asyncio.get_running_loop()
        self._threads = [threading.Thread(target=target, name=name, daemon=True) for target, name in
                         ((self._write, "deltaserve-engine-writer"), (self._read, "deltaserve-engine-reader"))]
        for thread in self._threads:
            thread.start()

    async def shutdown(self) -> None:
        """Stop the engine's loop (after the server drained its requests), fail what is left."""
        self._stopped = True
        self._outbox.put(("shutdown",))
        self._outbox.put(None)  # the writer's last message: only it writes to the pipe

        def stop():  # the writer sends what it holds, the core stops, then the reader reads its last words
            if self._threads:
                self._threads[0].join(timeout=30)
            self.handle.close()
            if self._threads:
                self._threads[1].join(timeout=30)

        await asyncio.get_running_loop().run_in_executor(None, stop)
        self._fail_all(EngineStoppedError("the server is shutting down"))

    async def add(self, inputs: list[EngineInput], request_id: str) -> RequestStream:
        """Queue inputs as engine requests `{request_id}-{i}`, all or none.

        Raises QueueFullError when they do not fit the bound, ValueError (nothing queued) when the engine
        rejects any of them, EngineStoppedError when the loop is not running."""
        if self._stopped or not self.is_running:
            raise EngineStoppedError("the engine is not running (the server is shutting down or failed)")
        if self.num_reserved + len(inputs) > self.capacity:
            raise QueueFullError(f"the server is at capacity ({self.num_reserved} requests in flight, limit "
                                 f"{self.capacity}); retry later")
        stream = RequestStream(self, [f"{request_id}-{i}" for i in range(len(inputs))])
        pending = PendingAdd(stream, inputs, asyncio.get_running_loop().create_future())
        self.num_reserved += len(inputs)
        key = next(self._keys)
        self._adds[key] = pending
        self._outbox.put(("add", key, list(zip(stream.req_ids, inputs))))
        try:
            await pending.added  # a cancelled wait cancels the future: the answer to the add then aborts it
        except asyncio.CancelledError:
            if pending.added.done() and not pending.added.cancelled() and pending.added.exception() is None:
                stream.abort()  # queued just before the cancellation reached us
            raise
        return stream

    def compile(self, spec: StructuredOutputsParams) -> asyncio.Future:
        """A future of spec's grammar compiled on the engine's pool (cached there), or the ValueError that refuses
        it (structured/errors.py; raised here for what needs no xgrammar, a schema's keywords and depth)."""
        if self._stopped or not self.is_running:
            raise EngineStoppedError("the engine is not running (the server is shutting down or failed)")
        checked(spec)
        key = next(self._keys)
        self._compiles[key] = future = asyncio.get_running_loop().create_future()
        self._outbox.put(("compile", key, spec))
        return future

    def _abort(self, req_ids: list[str]) -> None:
        aborted = [req_id for req_id in req_ids if self._streams.pop(req_id, None) is not None]
        for req_id in aborted:
            self._assemblies.pop(req_id, None)
        self.num_reserved -= len(aborted)
        if aborted:
            self.observer.on_abort(len(aborted))
        self._outbox.put(("abort", req_ids))

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.handle.to_child.send(message)
            except (BrokenPipeError, OSError):
                return  # the reader sees the core gone
            except Exception as e:  # a message that does not pickle (a schema nested too deep): it alone fails
                log.warning("a %s message could not be sent to the engine: %s: %s", message[0], type(e).__name__, e)
                if message[0] in ("add", "compile"):
                    error = ValueError(f"the request cannot be sent to the engine: {type(e).__name__}: {e}")
                    with contextlib.suppress(RuntimeError):  # the event loop is closed
                        self._loop.call_soon_threadsafe(self._on_answer, message[0], message[1], error)

    def _read(self) -> None:
        try:
            while True:
                message = self.handle.from_child.recv()
                self._loop.call_soon_threadsafe(self._on_message, message)
            # EOF: the core's loop ended; OSError: its pipe was closed here; RuntimeError: the event loop is closed
        except (EOFError, OSError, RuntimeError):
            pass
        if not self._stopped:
            self.handle.close(timeout=5)  # reaped: its exit code for the log
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._on_core_gone)

    def _on_message(self, message: tuple) -> None:
        if message[0] == "answers":
            for kind, key, error in message[1]:
                self._on_answer(kind, key, None if error is None else rebuild_error(*error))
        elif message[0] == "step":
            self._dispatch([self._assemblies[d.req_id].apply(d) for d in message[1] if d.req_id in self._assemblies])
        else:  # "failed": the core aborted every request it held; adds not yet answered took no part
            log.error("engine step failed; every request it held is aborted: %s", message[1])
            self._fail_streams(RuntimeError(f"engine step failed: {message[1]}"))
        self.observer.on_step(message[-1])

    def _on_answer(self, kind: str, key: int, error: BaseException | None) -> None:
        if kind == "compile":
            future = self._compiles.pop(key, None)
            if future is None or future.done():  # failed with the engine, or its handler gave up waiting
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
            return
        pending = self._adds.pop(key, None)
        if pending is None:  # failed with the engine already
            return
        if error is not None or pending.added.cancelled():  # refused, or the client left while its add was on its way
            self.num_reserved -= len(pending.stream.req_ids)
            if error is None:
                self._outbox.put(("abort", pending.stream.req_ids))
            elif not pending.added.done():
                pending.added.set_exception(error)
            return
        self._streams.update(dict.fromkeys(pending.stream.req_ids, pending.stream))
        for req_id, item in zip(pending.stream.req_ids, pending.inputs):
            self._assemblies[req_id] = _Assembly(item.prompt, item.prompt_token_ids)
        pending.added.set_result(None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams[output.request_id]
            num_tokens = len(output.outputs[0].token_ids)
            seen = stream.num_tokens[output.request_id]
            stream.num_tokens[output.request_id] = num_tokens
            self.observer.on_output(output, num_tokens - seen, seen == 0 and num_tokens > 0)
            if output.finished:
                del self._streams[output.request_id], self._assemblies[output.request_id]
                self.num_reserved -= 1
            stream._put(output)

    def _on_core_gone(self) -> None:
        code = self.handle.exitcode  # None for a loop in a thread (its end was logged there)
        log.error("the engine's loop ended%s; failing every request", "" if code is None else f" (exit code {code})")
        self._stopped = True
        self._fail_all(EngineStoppedError("the engine stopped; the server must be restarted"))

    def _fail_streams(self, error: BaseException) -> None:
        """Hand `error` to the handlers of every request routed (which the engine no longer holds)."""
        for stream in set(self._streams.values()):
            stream._put(error)
        self.num_reserved -= len(self._streams)
        self._streams.clear()
        self._assemblies.clear()

    def _fail_all(self, error: BaseException) -> None:
        """Fail every request in flight, and the adds and compiles not yet answered (the loop is stopping)."""
        self._fail_streams(error)
        for future in [p.added for p in self._adds.values()] + list(self._compiles.values()):
            if not future.done():
                future.set_exception(error)
        self._adds.clear()
        self._compiles.clear()
        self.num_reserved = 0
