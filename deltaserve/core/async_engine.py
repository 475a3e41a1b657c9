"""AsyncEngine: the synchronous Engine driven from asyncio, for the HTTP server.

One asyncio task, the engine loop, owns the Engine. Each turn it (1) applies the adds and aborts that handlers
queued since the last step, (2) runs engine.step() in a one-thread executor, so the event loop keeps serving HTTP
while the model runs, and (3) routes each RequestOutput to its handler's stream. So the Engine is touched by one
thing at a time, and an abort frees its pages and slot at a step boundary, never in the middle of a step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from deltaserve.core.engine import Engine
from deltaserve.core.outputs import RequestOutput
from deltaserve.sampling_params import SamplingParams

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


class EngineObserver:
    """Hooks the loop calls (on the event loop, between steps) so that metrics need no lock; no-ops here."""

    def on_step(self, engine: Engine) -> None:
        """After every step and every batch of adds/aborts: read gauges (running, waiting, cache)."""

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

    def __init__(self, owner: AsyncEngine, req_ids: list[str]):
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
class _PendingAdd:
    stream: RequestStream
    inputs: list[EngineInput]
    added: asyncio.Future


class AsyncEngine:
    """Runs one Engine from an asyncio loop; see the module docstring for the design."""

    def __init__(self, engine: Engine, max_queue: int, observer: EngineObserver | None = None):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue = {max_queue!r}: must be an integer >= 0 (requests that may wait)")
        self.engine = engine
        self.capacity = engine.config.max_num_seqs + max_queue  # engine requests accepted at once
        self.observer = observer or EngineObserver()
        self.num_reserved = 0  # engine requests accepted and not yet finished or aborted
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds: list[_PendingAdd] = []
        self._pending_aborts: list[str] = []
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaserve-engine")
        self._task: asyncio.Task | None = None
        self._stopped = False

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
        pending = _PendingAdd(stream, inputs, asyncio.get_running_loop().create_future())
        self.num_reserved += len(inputs)
        self._pending_adds.append(pending)
        self._wakeup.set()
        try:
            await pending.added  # a cancelled wait cancels the future: _apply_add then skips it
        except asyncio.CancelledError:
            if pending.added.done() and not pending.added.cancelled() and pending.added.exception() is None:
                stream.abort()  # queued just before the cancellation reached us
            raise
        return stream

    def _abort(self, req_ids: list[str]) -> None:
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
                self.observer.on_step(self.engine)
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
        self._apply_aborts(aborts)
        adds, self._pending_adds = self._pending_adds, []
        for pending in adds:
            self._apply_add(pending)
        self.observer.on_step(self.engine)

    def _apply_aborts(self, req_ids: list[str]) -> None:
        aborted = [req_id for req_id in req_ids if self._streams.pop(req_id, None) is not None]
        for req_id in aborted:
            self.engine.abort(req_id)
        self.num_reserved -= len(aborted)
        if aborted:
            self.observer.on_abort(len(aborted))

    def _apply_add(self, pending: _PendingAdd) -> None:
        req_ids = pending.stream.req_ids
        if pending.added.cancelled():  # the client left before its request was queued
            self.num_reserved -= len(req_ids)
            return
        added = []
        try:
            for req_id, item in zip(req_ids, pending.inputs):
                self.engine.add_request(item.prompt_token_ids, item.params, prompt=item.prompt, request_id=req_id)
                added.append(req_id)
        except Exception as e:  # all or none: take back the ones already queued
            for req_id in added:
                self.engine.abort(req_id)
            self.num_reserved -= len(req_ids)
            pending.added.set_exception(e)
            return
        self._streams.update(dict.fromkeys(req_ids, pending.stream))
        pending.added.set_result(None)

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
        """Abort every request the engine holds and hand `error` to their handlers; adds not yet applied stay
        queued, as they took no part in the step that failed."""
        for req_id in self._streams:
            self.engine.abort(req_id)
        for stream in set(self._streams.values()):
            stream._put(error)
        self.num_reserved -= len(self._streams)
        self._streams.clear()

    def _fail_all(self, error: BaseException) -> None:
        """Fail every request in flight, the queued adds too (the loop is stopping)."""
        self._fail_streams(error)
        for pending in self._pending_adds:
            if not pending.added.done():
                pending.added.set_exception(error)
        self._pending_adds.clear()
        self._pending_aborts.clear()
        self.num_reserved = 0
