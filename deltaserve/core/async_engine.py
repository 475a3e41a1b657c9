"""The engine driven from asyncio, for the HTTP server: EngineClient's streams, bound and routing over an engine
that runs in a thread of this process (AsyncEngine, here) or in a process of its own (core/engine_process.py).

AsyncEngine: one asyncio task, the engine loop, owns the Engine. Each turn it (1) applies the adds and aborts that
handlers queued since the last step, (2) runs engine.step() in a one-thread executor, so the event loop keeps
serving HTTP while the model runs, and (3) routes each RequestOutput to its handler's stream. So the Engine is
touched by one thing at a time, and an abort frees its pages and slot at a step boundary, never in the middle of a
step. The step's host work and the handlers still share this process's GIL; EngineProcess does not."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deltaserve.cache.manager import CacheOccupancy
from deltaserve.core.outputs import RequestOutput
from deltaserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:  # the server's process of an engine process imports no torch before it starts the engine
    from deltaserve.core.engine import Engine

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
    """The engine's gauges, read between steps: requests running and waiting, and the cache's pools."""

    num_running: int
    num_waiting: int
    cache: CacheOccupancy

    @classmethod
    def of(cls, engine: Engine) -> EngineStats:
        return cls(engine.num_running, engine.num_waiting, engine.cache_occupancy())


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
        cache = engine.cache_occupancy()
        return cls(engine.tokenizer, engine.max_model_len, cache.num_blocks * cache.block_size,
                   engine.config.max_num_seqs, EngineStats.of(engine))


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


class EngineClient:
    """What the server drives, wherever the engine runs: adds under a bound, streams, aborts and the routing of
    outputs to them. A subclass moves adds and aborts to its engine (_send_add, _send_aborts) and hands back what
    the engine answered (_accept or _refuse an add, _dispatch outputs, _fail_streams)."""

    def __init__(self, info: EngineInfo, max_queue: int, observer: EngineObserver | None = None):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue = {max_queue!r}: must be an integer >= 0 (requests that may wait)")
        self.info = info
        self.capacity = info.max_num_seqs + max_queue  # engine requests accepted at once
        self.observer = observer or EngineObserver()
        self.num_reserved = 0  # engine requests accepted and not yet finished or aborted
        self._streams: dict[str, RequestStream] = {}
        self._stopped = False

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        """Start routing (on the running event loop)."""
        raise NotImplementedError

    async def shutdown(self) -> None:
        """Stop the engine (after the server drained its requests) and fail what is left."""
        raise NotImplementedError

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
        self._send_add(pending)
        try:
            await pending.added  # a cancelled wait cancels the future: the answer to the add then aborts it
        except asyncio.CancelledError:
            if pending.added.done() and not pending.added.cancelled() and pending.added.exception() is None:
                stream.abort()  # queued just before the cancellation reached us
            raise
        return stream

    def compile(self, spec: StructuredOutputsParams) -> asyncio.Future:
        """A future of spec's grammar compiled on the engine's pool (cached there), or the ValueError that refuses
        it (structured/errors.py; raised at once where no compile is needed to know)."""
        raise NotImplementedError

    def _send_add(self, pending: PendingAdd) -> None:
        raise NotImplementedError

    def _send_aborts(self, req_ids: list[str]) -> None:
        raise NotImplementedError

    def _abort(self, req_ids: list[str]) -> None:
        self._send_aborts(req_ids)

    def _accept(self, pending: PendingAdd) -> bool:
        """The engine queued pending's requests: route their outputs to its stream. False when the client left
        before (the caller then aborts them)."""
        if pending.added.cancelled():
            self.num_reserved -= len(pending.stream.req_ids)
            return False
        self._streams.update(dict.fromkeys(pending.stream.req_ids, pending.stream))
        pending.added.set_result(None)
        return True

    def _refuse(self, pending: PendingAdd, error: BaseException) -> None:
        """The engine queued none of pending's requests (error says why)."""
        self.num_reserved -= len(pending.stream.req_ids)
        if not pending.added.done():
            pending.added.set_exception(error)

    def _forget_aborted(self, req_ids: list[str]) -> list[str]:
        """Stop routing req_ids (aborted by their streams); those still routed, which the engine must abort."""
        aborted = [req_id for req_id in req_ids if self._streams.pop(req_id, None) is not None]
        self.num_reserved -= len(aborted)
        if aborted:
            self.observer.on_abort(len(aborted))
        return aborted

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            num_tokens = len(output.outputs[0].token_ids)
            seen = stream.num_tokens[output.request_id]
            stream.num_tokens[output.request_id] = num_tokens
            self.observer.on_output(output, num_tokens - seen, seen == 0 and num_tokens > 0)
            if output.finished:
                del self._streams[output.request_id]
                self.num_reserved -= 1
            stream._put(output)

    def _fail_streams(self, error: BaseException) -> None:
        """Hand `error` to the handlers of every request routed (which the engine no longer holds); adds not yet
        answered stay queued, as they took no part in what failed."""
        for stream in set(self._streams.values()):
            stream._put(error)
        self.num_reserved -= len(self._streams)
        self._streams.clear()


class AsyncEngine(EngineClient):
    """Runs one Engine of this process from an asyncio loop; see the module docstring for the design."""

    def __init__(self, engine: Engine, max_queue: int, observer: EngineObserver | None = None):
        super().__init__(EngineInfo.of(engine), max_queue, observer)
        self.engine = engine
        self._pending_adds: list[PendingAdd] = []
        self._pending_aborts: list[str] = []
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaserve-engine")
        self._task: asyncio.Task | None = None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="deltaserve-engine-loop")

    async def shutdown(self) -> None:
        """Stop the loop (after the server drained its requests), fail what is left, release the thread."""
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._executor.shutdown(wait=True)  # a step still running finishes before the engine is touched again
        self._fail_all(EngineStoppedError("the server is shutting down"))

    def compile(self, spec: StructuredOutputsParams) -> asyncio.Future:
        return asyncio.wrap_future(self.engine.structured_outputs().submit(spec))

    def _send_add(self, pending: PendingAdd) -> None:
        self._pending_adds.append(pending)
        self._wakeup.set()

    def _send_aborts(self, req_ids: list[str]) -> None:
        self._pending_aborts.extend(req_ids)
        self._wakeup.set()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    await self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                try:
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
                except Exception as e:  # a failed step: fail its requests, keep serving the next ones
                    log.exception("engine step failed; aborting every request the engine holds")
                    self._fail_streams(e)
                    continue
                self._dispatch(outputs)
                self.observer.on_step(EngineStats.of(self.engine))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.exception("engine loop died")
            self._fail_all(e)
            raise

    def _apply_pending(self) -> None:
        if not (self._pending_adds or self._pending_aborts):
            return
        aborts, self._pending_aborts = self._pending_aborts, []
        for req_id in self._forget_aborted(aborts):
            self.engine.abort(req_id)
        adds, self._pending_adds = self._pending_adds, []
        for pending in adds:
            self._apply_add(pending)
        self.observer.on_step(EngineStats.of(self.engine))

    def _apply_add(self, pending: PendingAdd) -> None:
        if pending.added.cancelled():  # the client left before its request was queued
            self._refuse(pending, asyncio.CancelledError())
            return
        added = []
        try:
            for req_id, item in zip(pending.stream.req_ids, pending.inputs):
                self.engine.add_request(item.prompt_token_ids, item.params, prompt=item.prompt, request_id=req_id)
                added.append(req_id)
        except Exception as e:  # all or none: take back the ones already queued
            for req_id in added:
                self.engine.abort(req_id)
            self._refuse(pending, e)
            return
        self._accept(pending)

    def _fail_streams(self, error: BaseException) -> None:
        for req_id in self._streams:
            self.engine.abort(req_id)
        super()._fail_streams(error)

    def _fail_all(self, error: BaseException) -> None:
        """Fail every request in flight, the queued adds too (the loop is stopping)."""
        self._fail_streams(error)
        for pending in self._pending_adds:
            if not pending.added.done():
                pending.added.set_exception(error)
        self._pending_adds.clear()
        self._pending_aborts.clear()
        self.num_reserved = 0
