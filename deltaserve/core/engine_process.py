"""The engine's side of the server (an engine core, as vLLM's): a loop over one Engine that talks to the server's
EngineClient (core/async_engine.py) over two pipes, in a process of its own (EngineProcess, so that its steps' host
work never waits for the HTTP handlers on one GIL) or in a thread of the server's process (EngineThread).

The loop takes the messages the server sent (adds, aborts, compiles, shutdown), answers each add and compile, runs
a step when there is work and sends what the step produced as deltas (each request's new tokens, text and logprobs:
a cumulative output would cost a pickle of every token so far, every step), with the engine's gauges. Idle, it
blocks on its pipe. The child process ignores SIGINT (the server drains, then says shutdown) and exits when its pipe
closes, so it never outlives the server."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

from deltaserve.config import EngineConfig
from deltaserve.core.async_engine import EngineInfo, EngineInput, EngineStats
from deltaserve.core.outputs import RequestOutput
from deltaserve.sampling_params import ParamError, StructuredOutputsParams
from deltaserve.structured import errors
from deltaserve.tokenizer import load_tokenizer

log = logging.getLogger("deltaserve")

STARTUP_TIMEOUT_S = 3600.0  # loading, compiling and capturing a large model on a cold machine
GROUP_FAILURE_WAIT_S = 2.0  # after a failed step of a tensor-parallel group: time for its watch to see a dead rank


class EngineStartError(RuntimeError):
    """The engine process failed to start: the message is the child's error."""


@dataclass
class Delta:
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
    """How much of a request's output the core has sent (lengths of its lists and text)."""

    tokens: int = 0
    text: int = 0
    logprobs: int = 0
    prompt_logprobs: int = 0


def _delta(output: RequestOutput, sent: _Sent) -> Delta:
    c = output.outputs[0]
    starts = (min(sent.tokens, len(c.token_ids)), min(sent.text, len(c.text)),
              min(sent.logprobs, len(c.logprobs or ())), min(sent.prompt_logprobs, len(output.prompt_logprobs or ())))
    sent.tokens, sent.text = len(c.token_ids), len(c.text)
    sent.logprobs, sent.prompt_logprobs = len(c.logprobs or ()), len(output.prompt_logprobs or ())
    return Delta(output.request_id, output.finished, starts[0], c.token_ids[starts[0]:], starts[1], c.text[starts[1]:],
                 c.finish_reason, c.stop_reason, starts[2], None if c.logprobs is None else c.logprobs[starts[2]:],
                 c.cumulative_logprob, starts[3],
                 None if output.prompt_logprobs is None else output.prompt_logprobs[starts[3]:],
                 output.metrics, output.num_cached_tokens)


def error_message(e: BaseException) -> tuple[str, str, str | None]:
    """An exception as (kind, message, param) for the pipe (structured outputs' errors do not all pickle; the
    server's async_engine.rebuild_error makes them again)."""
    if isinstance(e, errors.StructuredOutputsUnavailable | errors.GrammarError | errors.CompilesBusy):
        return type(e).__name__, str(e), getattr(e, "param", None)
    if isinstance(e, ParamError):
        return "ValueError", str(e), e.field
    return "ValueError" if isinstance(e, ValueError) else "RuntimeError", str(e), None


class _Core:
    """The core loop over one Engine (see the module docstring)."""

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
            return [("add", key, error_message(e))]
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
        except Exception as e:  # one request's constraint never ends the loop
            return [("compile", key, error_message(e))]
        return []

    def _compiled(self) -> list:
        done = [key for key, future in self.compiles.items() if future.done()]
        answers = []
        for key in done:
            error = self.compiles.pop(key).exception()
            answers.append(("compile", key, None if error is None else error_message(error)))
        return answers

    def _step(self) -> tuple:
        try:
            outputs = self.engine.step()
        except Exception as e:  # fail the requests it held; the next ones are served
            watch = self.engine.group_watch  # over gloo a dead rank's step fails before the watch has reaped it
            if watch is not None and watch.failed.wait(GROUP_FAILURE_WAIT_S):
                raise watch.error from e  # a rank of the group is gone: no step can run again
            log.exception("engine step failed; aborting every request the engine holds")
            for req_id in self.sent:
                self.engine.abort(req_id)
            self.sent.clear()
            return "failed", f"{type(e).__name__}: {e}", EngineStats.of(self.engine)
        deltas = []
        for output in outputs:
            sent = self.sent.get(output.request_id)
            if sent is not None:
                deltas.append(_delta(output, sent))
                if output.finished:
                    del self.sent[output.request_id]
        return "step", deltas, EngineStats.of(self.engine)


def _child_main(engine_arguments: Callable[[], tuple[str, EngineConfig]], conn_in, conn_out) -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, or a stop of the whole group (systemd, kill -TERM -PGID):
        signal.signal(signum, signal.SIG_IGN)  # the server drains its requests, then stops us through the pipe
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        from deltaserve.core.engine import Engine

        model, config = engine_arguments()
        if config.tensor_parallel_size != 1:
            raise ValueError("the engine process runs one rank; with tensor_parallel_size > 1 serve without it "
                             "(--no-engine-process)")
        engine = Engine(model, config)
        # the tokenizer stays here: the server loads its own from the model folder
        conn_out.send(("ready", model, replace(EngineInfo.of(engine), tokenizer=None), engine.async_scheduling))
    except Exception as e:  # a bad input (ValueError, OSError) says what to do; anything else is ours
        conn_out.send(("error", isinstance(e, ValueError | OSError), str(e) if isinstance(e, ValueError | OSError)
                       else f"{type(e).__name__}: {e}"))
        return
    try:
        _serve(_Core(engine, conn_in, conn_out))
    finally:
        engine.shutdown()


def _serve(core: _Core) -> None:
    """The core loop until shutdown; its pipe ends closed after, so that the server's reader sees the loop end."""
    try:
        core.run()
    except (BrokenPipeError, EOFError):
        pass  # the server is gone
    except BaseException:
        if core.engine.group_error is not None:  # one line: the traceback is the step's, not the cause
            log.error("the engine's loop ended: %s; restart the server", core.engine.group_error)
            return
        log.exception("the engine's loop died")
        raise
    finally:
        core.conn_in.close()
        core.conn_out.close()


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
            self._info = replace(info, tokenizer=load_tokenizer(model) if Path(model).is_dir() else None)
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

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def close(self, timeout: float = 30.0) -> None:
        """Ask the child to stop, then end it if it does not within timeout seconds. The pipes close with this
        object (the server's reader may still be reading the child's last words)."""
        with contextlib.suppress(OSError):  # gone already
            self.to_child.send(("shutdown",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class EngineThread:
    """The core loop over an engine of this process, in a daemon thread: serve --no-engine-process, tensor
    parallel's rank 0, and tests that reach into the engine (hold or break its step)."""

    exitcode = None

    def __init__(self, engine):
        child_in, self.to_child = multiprocessing.Pipe(duplex=False)
        self.from_child, child_out = multiprocessing.Pipe(duplex=False)
        self.engine = engine
        self.info = EngineInfo.of(engine)
        self.async_scheduling = engine.async_scheduling
        self.core = _Core(engine, child_in, child_out)
        self._thread = threading.Thread(target=_serve, args=(self.core,), name="deltaserve-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        """The loop runs and can step: not when a rank of its tensor-parallel group has exited (the server's /health
        then answers 503 and new requests are refused at once, before one fails a step)."""
        return self._thread.is_alive() and self.engine.group_error is None

    def close(self, timeout: float = 30.0) -> None:
        """Ask the loop to stop and wait for it (a step in progress finishes first)."""
        with contextlib.suppress(OSError):
            self.to_child.send(("shutdown",))
        self._thread.join(timeout)
