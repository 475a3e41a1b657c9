"""Grammar compiles in child processes, bounded in time and in memory.

xgrammar's compile has no bound of its own, and some constraints a few kilobytes long take minutes or grow without
limit (nested stars: BENCHMARKS.md). In the engine's process such a compile could be abandoned but never stopped,
and its memory could take the whole server down. Here each compile runs in a child process (`python -m` this
module) that limits its own address space to what it held after start-up plus a memory budget; the parent kills it
at the time limit. A child that was killed, or failed for memory, is replaced at the next compile (a start costs
about 3 s: xgrammar imports torch and transformers).

The child also fills the mask of an output's first token under the same bounds (for an ambiguous grammar that can
take far longer than the compile). It answers with the compiled grammar serialized when that is cheaper than
compiling again (xgrammar's JSON costs about SERIALIZE_S_PER_BYTE each way for a byte of grammar, and a bounded
repetition can make 70 MB of it), else only that the compile fits its bounds, and the parent compiles it itself:
the compile is deterministic, so it takes the same time and memory there. Messages are pickles over the child's
stdin and stdout (ours, both ends)."""

from __future__ import annotations

import hashlib
import math
import os
import pickle
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

START_TIMEOUT_S = 120.0  # a worker not ready by then counts as one that cannot start (importing xgrammar takes ~3 s)
SERIALIZE_S_PER_BYTE = 7e-8  # serialize_json + deserialize_json, measured on a 160k-token vocabulary
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding deltaserve, for the child's path


class WorkerDied(Exception):
    """The child ended before it answered: killed at the time limit (timed_out) or dead of something else."""

    def __init__(self, timed_out: bool, returncode: int | None):
        super().__init__(f"grammar compile worker ended (timed out: {timed_out}, exit status {returncode})")
        self.timed_out = timed_out


class CompileWorker:
    """One child process holding an xgrammar GrammarCompiler over one vocabulary. It is started first (it imports
    xgrammar meanwhile) and given its vocabulary by start()."""

    command = [sys.executable, "-m", __name__]

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")])))
        # a session of its own: the terminal's Ctrl-C is the parent's to handle (the child ends when its stdin does)
        self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                      start_new_session=True)

    def start(self, tokenizer_info_json: str, memory_bytes: int, timeout_s: float, serialize_s_per_byte: float) -> None:
        """Send the vocabulary, the memory budget, the time limit (the child stops itself at twice that in CPU time,
        should the parent be gone) and the cost of passing a grammar back (a compile that took less than its
        grammar's bytes times serialize_s_per_byte is compiled again by the parent); OSError when the child does not
        answer ready within START_TIMEOUT_S."""
        try:
            message = (tokenizer_info_json, memory_bytes, timeout_s, serialize_s_per_byte)
            ready = self._call(message, START_TIMEOUT_S)[0] == "ready"
        except WorkerDied:
            ready = False
        if not ready:
            self.close()
            raise OSError(f"the grammar compile worker did not start (exit status {self._proc.returncode}; its "
                          "error, if any, is on stderr above)")

    def compile(self, method: str, args: tuple, kwargs: dict, timeout_s: float) -> tuple:
        """The child's answer to GrammarCompiler.<method>(*args, **kwargs), then first_mask of what it compiled:
        ("compiled", the grammar's JSON or None to compile it again, first_mask's seconds, whether it allows a
        token), ("memory", None) or ("error", xgrammar's message). WorkerDied when the child ends first (killed at
        timeout_s, or crashed)."""
        return self._call((method, args, kwargs), timeout_s)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        """Kill the child (it may be compiling) and reap it."""
        self._proc.kill()
        self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            pipe.close()

    def _call(self, message, timeout_s: float):
        killed = threading.Event()

        def kill() -> None:
            killed.set()  # before the kill, so that the read it ends sees why
            self._proc.kill()

        timer = threading.Timer(timeout_s, kill)
        timer.start()
        try:
            pickle.dump(message, self._proc.stdin)
            self._proc.stdin.flush()
            return pickle.load(self._proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            timed_out = killed.is_set()
            self.close()
            raise WorkerDied(timed_out, self._proc.returncode) from None
        finally:
            timer.cancel()


class CompileWorkers:
    """The workers of one vocabulary and one pair of bounds, shared by every GrammarBackend of this process that has
    them (acquire, release): an idle worker is handed to each compile, and a new one started when none is idle (so
    there are at most as many as compiles at once). Thread-safe."""

    def __init__(self, key: tuple, tokenizer_info_json: str, memory_bytes: int, timeout_s: float):
        self.key, self.users = key, 0
        self.memory_bytes, self.timeout_s = memory_bytes, timeout_s
        self.serialize_s_per_byte = SERIALIZE_S_PER_BYTE
        self._vocabulary = tokenizer_info_json
        self._idle: list[CompileWorker] = []
        self._lock = threading.Lock()
        self._closed = False

    def compile(self, method: str, args: tuple, kwargs: dict) -> tuple:
        """CompileWorker.compile on an idle or new worker, bounded by timeout_s: WorkerDied when the worker ended
        before it answered, OSError when a new one could not start."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _take_spare() or CompileWorker()
            worker.start(self._vocabulary, self.memory_bytes, self.timeout_s, self.serialize_s_per_byte)
        answer = worker.compile(method, args, kwargs, self.timeout_s)
        with self._lock:
            if answer[0] == "memory" or self._closed or not worker.alive():
                worker.close()
            else:
                self._idle.append(worker)
        return answer

    def close(self) -> None:
        """Kill the idle workers; those compiling now are killed when they answer."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()


# the pools of this process, by (vocabulary digest, memory, time): a server's engines, or a notebook's many LLMs over
# one model, share their workers (~270 MB each) and pay one start
_pools: dict[tuple, CompileWorkers] = {}
_spare: CompileWorker | None = None  # started by prestart, taken by the first new worker
_pools_lock = threading.Lock()


def prestart() -> None:
    """Start a worker now when none runs in this process (OSError when none can start), so that its import of
    xgrammar overlaps the caller's own and its building of the vocabulary: the first constrained request's start."""
    global _spare
    with _pools_lock:
        if not _pools and _spare is None:
            _spare = CompileWorker()


def _take_spare() -> CompileWorker | None:
    global _spare
    with _pools_lock:
        spare, _spare = _spare, None
    return spare


def acquire(tokenizer_info_json: str, memory_bytes: int, timeout_s: float) -> CompileWorkers:
    """The pool of this vocabulary (xgrammar's TokenizerInfo.serialize_json()) and bounds, shared; release it once
    done with it."""
    key = (hashlib.sha256(tokenizer_info_json.encode()).hexdigest(), memory_bytes, timeout_s)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = CompileWorkers(key, tokenizer_info_json, memory_bytes, timeout_s)
        pool.users += 1
    return pool


def release(pool: CompileWorkers) -> None:
    """One user less of pool; the last closes its workers."""
    with _pools_lock:
        pool.users -= 1
        if pool.users > 0:
            return
        _pools.pop(pool.key, None)
    pool.close()


def first_mask(xgrammar, compiled) -> tuple[float, bool]:
    """The seconds a new matcher of compiled takes to fill the mask of an output's first token (an ambiguous grammar
    can take minutes), and whether the mask allows any token."""
    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    start = time.perf_counter()
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return time.perf_counter() - start, bool(bitmask.any())


def _limit_cpu(seconds: float) -> None:
    """Let this process use `seconds` more of CPU time (the kernel then ends it with SIGXCPU)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _address_space() -> int:
    """This process's virtual memory size in bytes (Linux's /proc; 0 where there is none)."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return 0
    return int(line.split()[1]) * 1024


def _serve() -> None:
    """The child: read the vocabulary and the bounds, bound the address space, then answer compiles (each bounded in
    CPU time too) until stdin closes (the parent exited or closed us)."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a library's print goes to stderr, never into the replies
    requests = sys.stdin.buffer

    def reply(message) -> None:
        pickle.dump(message, replies)
        replies.flush()

    import xgrammar  # while the parent builds the vocabulary

    try:
        info_json, memory_bytes, timeout_s, serialize_s_per_byte = pickle.load(requests)
    except EOFError:  # closed before it was given a vocabulary
        return
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.deserialize_json(info_json), max_threads=1,
                                        cache_enabled=False)
    limit = _address_space() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    reply(("ready", None))
    while True:
        try:
            method, args, kwargs = pickle.load(requests)
        except EOFError:
            return
        _limit_cpu(2 * timeout_s)  # the parent kills us at timeout_s; this ends a compile it can no longer kill
        start = time.perf_counter()
        try:
            compiled = getattr(compiler, method)(*args, **kwargs)
            cheaper = compiled.memory_size_bytes * serialize_s_per_byte < time.perf_counter() - start
            answer = ("compiled", compiled.serialize_json() if cheaper else None, *first_mask(xgrammar, compiled))
        except (MemoryError, RuntimeError) as e:
            if isinstance(e, MemoryError) or "bad_alloc" in str(e):
                reply(("memory", None))
                return  # what failed to allocate may have left the compiler half-built: the parent starts anew
            answer = ("error", str(e))
        reply(answer)


if __name__ == "__main__":
    _serve()
