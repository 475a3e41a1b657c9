"""The engine in a process of its own (an engine core, as vLLM's), so that its steps' host work never waits for
the HTTP server's handlers on one GIL.

The child builds the Engine and loops: take the messages the server sent (adds, aborts, compiles, shutdown), answer
each add and compile, run a step when there is work, and send what the step produced, as deltas (each request's
new tokens, text and logprobs: a cumulative output would cost a pickle of every token so far, every step). Idle, it
blocks on its pipe. In the server's process, ProcessClient routes the answers to the handlers' streams: a reader
thread unpickles each message and hands it to the event loop; a writer thread sends, so that the loop never blocks
on a full pipe while the child is in a step. The child ignores SIGINT (the server drains, then says shutdown) and
exits when its pipe closes, so it never outlives the server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import queue
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from deltaserve.config import EngineConfig
from deltaserve.core.async_engine import (
    EngineClient,
    EngineInfo,
    EngineInput,
    EngineObserver,
    EngineStats,
    EngineStoppedError,
    PendingAdd,
)
from deltaserve.core.outputs import CompletionOutput, RequestOutput
from deltaserve.sampling_params import StructuredOutputsParams
from deltaserve.structured import errors
from deltaserve.tokenizer import load_tokenizer

log = logging.getLogger("deltaserve")

STARTUP_TIMEOUT_S = 3600.0  # loading, compiling and capturing a large model on a cold machine


class EngineStartError(RuntimeError):
    """The engine process failed to start: the message is the child's error."""


@dataclass
class _Delta:
    """What one step added to one request's output: each list from index `*_start` on is replaced by the new items.
    An output only grows (the engine rewinds a step's own tokens before it outputs them); a start below the length
    sent before says that items were taken back all the same."""

    req_id: str
    finished: bool
    token_start: int
    token_ids: list[int]
    text_start: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs_start: int
    logprobs: list | None
    cumulative_logprob: float | None
    prompt_logprobs_start: int
    prompt_logprobs: list | None
    metrics: dict[str, float]
    num_cached_tokens: int


@dataclass
class _Sent:
    """How much of a request's output the child has sent (lengths of its lists and text)."""

    tokens: int = 0
    text: int = 0
    logprobs: int = 0
    prompt_logprobs: int = 0


def _delta(output: RequestOutput, sent: _Sent) -> _Delta:
    c = output.outputs[0]
    starts = (min(sent.tokens, len(c.token_ids)), min(sent.text, len(c.text)),
              min(sent.logprobs, len(c.logprobs or ())), min(sent.prompt_logprobs, len(output.prompt_logprobs or ())))
    sent.tokens, sent.text = len(c.token_ids), len(c.text)
    sent.logprobs, sent.prompt_logprobs = len(c.logprobs or ()), len(output.prompt_logprobs or ())
    return _Delta(output.request_id, output.finished, starts[0], c.token_ids[starts[0]:], starts[1], c.text[starts[1]:],
                  c.finish_reason, c.stop_reason, starts[2], None if c.logprobs is None else c.logprobs[starts[2]:],
                  c.cumulative_logprob, starts[3],
                  None if output.prompt_logprobs is None else output.prompt_logprobs[starts[3]:],
                  output.metrics, output.num_cached_tokens)


def _error_message(e: BaseException) -> tuple[str, str, str | None]:
    """An exception as (kind, message, param) for the pipe (structured outputs' errors do not all pickle)."""
    kind = type(e).__name__ if isinstance(e, errors.StructuredOutputsUnavailable | errors.GrammarError |
                                          errors.CompilesBusy) else "ValueError" if isinstance(e, ValueError) \
        else "RuntimeError"
    return kind, str(e), getattr(e, "param", None)


def _rebuild_error(kind: str, message: str, param: str | None) -> BaseException:
    if kind == "GrammarError":
        return errors.GrammarError(message, param)
    if kind in ("StructuredOutputsUnavailable", "CompilesBusy"):
        e = getattr(errors, kind).__new__(getattr(errors, kind))
        ValueError.__init__(e, message)
        return e
    return ValueError(message) if kind == "ValueError" else RuntimeError(message)


class _Core:
    """The child's loop over one Engine (see the module docstring)."""

    def __init__(self, engine, conn_in, conn_out):
        self.engine, self.conn_in, self.conn_out = engine, conn_in, conn_out
        self.sent: dict[str, _Sent] = {}  # requests added and not finished or aborted
        self.compiles: dict[int, Future] = {}

    def run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            timeout = 0 if busy else 0.01 if self.compiles else None  # block while there is nothing to do
            try:
                messages = [self.conn_in.recv()] if self.conn_in.poll(timeout) else []
                while messages and self.conn_in.poll():
                    messages.append(self.conn_in.recv())
            except EOFError:
                return  # the server is gone
            answers = []
            for message in messages:
                if message[0] == "shutdown":
                    return
                answers += getattr(self, "_" + message[0])(*message[1:])
            answers += self._compiled()
            if messages or answers:  # the gauges too: an abort with nothing left to step frees pages all the same
                self.conn_out.send(("answers", answers, EngineStats.of(self.engine)))
            if self.engine.has_unfinished_requests():
                self.conn_out.send(self._step())

    def _add(self, key: int, items: list[tuple[str, EngineInput]]) -> list:
        added = []
        try:
            for req_id, item in items:
                self.engine.add_request(item.prompt_token_ids, item.params, prompt=item.prompt, request_id=req_id)
                added.append(req_id)
        except Exception as e:  # all or none
            for req_id in added:
                self.engine.abort(req_id)
            return [("add", key, _error_message(e))]
        self.sent.update((req_id, _Sent()) for req_id in added)
        return [("add", key, None)]

    def _abort(self, req_ids: list[str]) -> list:
        for req_id in req_ids:
            if self.sent.pop(req_id, None) is not None:
                self.engine.abort(req_id)
        return []

    def _compile(self, key: int, spec: StructuredOutputsParams) -> list:
        try:
            self.compiles[key] = self.engine.structured_outputs().submit(spec)
        except ValueError as e:
            return [("compile", key, _error_message(e))]
        return []

    def _compiled(self) -> list:
        done = [key for key, future in self.compiles.items() if future.done()]
        answers = []
        for key in done:
            error = self.compiles.pop(key).exception()
            answers.append(("compile", key, None if error is None else _error_message(error)))
        return answers

    def _step(self) -> tuple:
        try:
            outputs = self.engine.step()
        except Exception as e:  # fail the requests it held; the next ones are served
            log.exception("engine step failed; aborting every request the engine holds")
            for req_id in self.sent:
                self.engine.abort(req_id)
            self.sent.clear()
            return "failed", f"{type(e).__name__}: {e}"
        deltas = []
        for output in outputs:
            sent = self.sent.get(output.request_id)
            if sent is not None:
                deltas.append(_delta(output, sent))
                if output.finished:
                    del self.sent[output.request_id]
        return "step", deltas, EngineStats.of(self.engine)


def _child_main(engine_arguments: Callable[[], tuple[str, EngineConfig]], conn_in, conn_out) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server drains, then stops us
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        from deltaserve.core.engine import Engine

        model, config = engine_arguments()
        if config.tensor_parallel_size != 1:
            raise ValueError("the engine process runs one rank; with tensor_parallel_size > 1 serve without it "
                             "(--no-engine-process)")
        engine = Engine(model, config)
        info = EngineInfo.of(engine)
        conn_out.send(("ready", model, EngineInfo(None, info.max_model_len, info.cache_tokens, info.max_num_seqs,
                                                  info.stats), engine.async_scheduling))
    except Exception as e:  # a bad input (ValueError, OSError) says what to do; anything else is ours
        conn_out.send(("error", isinstance(e, ValueError | OSError), str(e) if isinstance(e, ValueError | OSError)
                       else f"{type(e).__name__}: {e}"))
        return
    try:
        _Core(engine, conn_in, conn_out).run()
    except (BrokenPipeError, EOFError):
        pass  # the server is gone
    finally:
        engine.shutdown()


class EngineProcess:
    """An engine process: its pipes, what the server reads of it (info, once it is ready), and its stop."""

    def __init__(self, engine_arguments: Callable[[], tuple[str, EngineConfig]]):
        """Start the child, which builds Engine(*engine_arguments()) (a picklable callable: the defaults that depend
        on the machine are settled there, so that this process need not import torch first). Returns at once; the
        server's own imports overlap the child's start, and info waits for it."""
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or OpenMP state
        self.to_child, child_in = context.Pipe(duplex=False)[::-1]
        child_out, self.from_child = context.Pipe(duplex=False)[::-1]
        self.process = context.Process(target=_child_main, args=(engine_arguments, child_in, child_out),
                                       name="deltaserve-engine", daemon=True)
        self.process.start()
        child_in.close()
        child_out.close()
        self._info: EngineInfo | None = None
        self.async_scheduling: bool | None = None

    @property
    def info(self) -> EngineInfo:
        """What the server reads of the engine, waiting for the child to build it: ValueError for a bad input,
        EngineStartError for anything else, with the child's message. The model folder's tokenizer is loaded here
        too, for the server's own tokenizing."""
        if self._info is None:
            message = self._first_message()
            if message[0] == "error":
                self.close()
                raise ValueError(message[2]) if message[1] else EngineStartError(
                    f"the engine process failed to start: {message[2]}")
            model, info, self.async_scheduling = message[1:]
            tokenizer = load_tokenizer(model) if Path(model).is_dir() else None
            self._info = EngineInfo(tokenizer, info.max_model_len, info.cache_tokens, info.max_num_seqs, info.stats)
        return self._info

    def _first_message(self) -> tuple:
        if not self.from_child.poll(STARTUP_TIMEOUT_S):
            self.close()
            raise EngineStartError(f"the engine process did not start within {STARTUP_TIMEOUT_S:g} s")
        try:
            return self.from_child.recv()
        except EOFError:
            self.close()
            raise EngineStartError(f"the engine process exited while starting (exit code {self.process.exitcode}); "
                                   "its log is above") from None

    def client(self, max_queue: int, observer: EngineObserver | None = None) -> ProcessClient:
        return ProcessClient(self, max_queue, observer)

    def close(self, timeout: float = 30.0) -> None:
        """Ask the child to stop, then end it if it does not within timeout seconds."""
        try:
            self.to_child.send(("shutdown",))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.to_child.close()
        self.from_child.close()


@dataclass
class _Assembly:
    """A request's output so far, rebuilt from the child's deltas."""

    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    prompt_logprobs: list | None = None

    def apply(self, d: _Delta) -> RequestOutput:
        self.token_ids[d.token_start:] = d.token_ids
        self.text = self.text[:d.text_start] + d.text
        if d.logprobs is not None:
            self.logprobs = (self.logprobs or [])[:d.logprobs_start] + d.logprobs
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs or [])[:d.prompt_logprobs_start] + d.prompt_logprobs
        completion = CompletionOutput(0, self.text, list(self.token_ids), d.finish_reason, d.stop_reason,
                                      None if self.logprobs is None else list(self.logprobs), d.cumulative_logprob)
        return RequestOutput(d.req_id, self.prompt, self.prompt_token_ids, [completion], d.finished,
                             None if self.prompt_logprobs is None else list(self.prompt_logprobs), d.metrics,
                             d.num_cached_tokens)


class ProcessClient(EngineClient):
    """EngineClient over an EngineProcess (see the module docstring)."""

    def __init__(self, process: EngineProcess, max_queue: int, observer: EngineObserver | None = None):
        super().__init__(process.info, max_queue, observer)
        self.process = process
        self._keys = iter(range(1 << 62))
        self._adds: dict[int, PendingAdd] = {}
        self._compiles: dict[int, asyncio.Future] = {}
        self._assemblies: dict[str, _Assembly] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._stopped and self.process.process.is_alive()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._threads = [threading.Thread(target=target, name=name, daemon=True) for target, name in
                         ((self._write, "deltaserve-engine-writer"), (self._read, "deltaserve-engine-reader"))]
        for thread in self._threads:
            thread.start()

    async def shutdown(self) -> None:
        """Stop the child (after the server drained its requests), fail what is left."""
        self._stopped = True
        self._outbox.put(("shutdown",))
        self._outbox.put(None)  # the writer's last message: only it writes to the pipe

        def stop():
            for thread in self._threads[:1]:  # the writer, if started
                thread.join()
            self.process.close()

        await asyncio.get_running_loop().run_in_executor(None, stop)
        self._fail_all(EngineStoppedError("the server is shutting down"))

    def compile(self, spec: StructuredOutputsParams) -> asyncio.Future:
        if not self.is_running:
            raise EngineStoppedError("the engine is not running (the server is shutting down or failed)")
        key = next(self._keys)
        self._compiles[key] = future = asyncio.get_running_loop().create_future()
        self._outbox.put(("compile", key, spec))
        return future

    def _send_add(self, pending: PendingAdd) -> None:
        key = next(self._keys)
        self._adds[key] = pending
        self._outbox.put(("add", key, list(zip(pending.stream.req_ids, pending.inputs))))

    def _send_aborts(self, req_ids: list[str]) -> None:
        for req_id in self._forget_aborted(req_ids):
            self._assemblies.pop(req_id, None)
        self._outbox.put(("abort", req_ids))

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.process.to_child.send(message)
            except (BrokenPipeError, OSError):
                return  # the reader sees the child gone

    def _read(self) -> None:
        try:
            while True:
                message = self.process.from_child.recv()
                self._loop.call_soon_threadsafe(self._on_message, message)
            # EOF: the child exited; OSError: its pipe was closed here; RuntimeError: the event loop is closed
        except (EOFError, OSError, RuntimeError):
            pass
        if not self._stopped:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._on_child_gone)

    def _on_message(self, message: tuple) -> None:
        if message[0] == "answers":
            for kind, key, error in message[1]:
                self._on_answer(kind, key, None if error is None else _rebuild_error(*error))
            self.observer.on_step(message[2])
        elif message[0] == "step":
            self._dispatch([self._assemblies[d.req_id].apply(d) for d in message[1] if d.req_id in self._assemblies])
            for d in message[1]:
                if d.finished:
                    self._assemblies.pop(d.req_id, None)
            self.observer.on_step(message[2])
        else:  # "failed": the child aborted every request it held
            self._assemblies.clear()
            self._fail_streams(RuntimeError(f"engine step failed: {message[1]}"))

    def _on_answer(self, kind: str, key: int, error: BaseException | None) -> None:
        if kind == "compile":
            future = self._compiles.pop(key)
            if future.done():  # its handler gave up waiting
                return
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
            return
        pending = self._adds.pop(key)
        if error is not None:
            self._refuse(pending, error)
        elif self._accept(pending):
            for req_id, item in zip(pending.stream.req_ids, pending.inputs):
                self._assemblies[req_id] = _Assembly(item.prompt, item.prompt_token_ids)
        else:  # the client left while its add was on its way
            self._outbox.put(("abort", pending.stream.req_ids))

    def _on_child_gone(self) -> None:
        log.error("the engine process exited (exit code %s); failing every request", self.process.process.exitcode)
        self._stopped = True
        self._fail_all(EngineStoppedError("the engine process exited; the server must be restarted"))

    def _fail_all(self, error: BaseException) -> None:
        self._fail_streams(error)
        self._assemblies.clear()
        for pending in self._adds.values():
            if not pending.added.done():
                pending.added.set_exception(error)
        for future in self._compiles.values():
            if not future.done():
                future.set_exception(error)
        self._adds.clear()
        self._compiles.clear()
        self.num_reserved = 0
