"""The engine process's two halves in one process, for tests that must reach inside its engine (hold or break a
step): engine_process._Core runs in a thread over real pipes, and a ProcessClient drives it as it drives a child."""

from __future__ import annotations

import multiprocessing
import threading

from deltaserve.core.async_engine import EngineInfo
from deltaserve.core.engine import Engine
from deltaserve.core.engine_process import ProcessClient, _Core


class _ThreadAsProcess:
    """What ProcessClient reads of EngineProcess's `process`: alive or not, and an exit code."""

    def __init__(self, thread: threading.Thread):
        self.thread = thread
        self.exitcode = None

    def is_alive(self) -> bool:
        return self.thread.is_alive()


class CoreInThread:
    """EngineProcess's interface over an engine of this process, its core loop in a daemon thread."""

    def __init__(self, engine: Engine):
        self.engine = engine
        child_in, self.to_child = multiprocessing.Pipe(duplex=False)
        self.from_child, child_out = multiprocessing.Pipe(duplex=False)
        self.info = EngineInfo.of(engine)
        self.async_scheduling = engine.async_scheduling
        thread = threading.Thread(target=_Core(engine, child_in, child_out).run, daemon=True)
        self.process = _ThreadAsProcess(thread)
        thread.start()

    def client(self, max_queue: int) -> ProcessClient:
        return ProcessClient(self, max_queue)

    def close(self) -> None:
        try:
            self.to_child.send(("shutdown",))
        except OSError:
            pass
        self.process.thread.join(30)
