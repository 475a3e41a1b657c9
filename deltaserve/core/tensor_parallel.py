"""Running one model over several processes: rank 0 is the engine (scheduler, tokenizer, clients), the other ranks
run `worker_loop`: each loads its shard, takes the cache plan and then every step's SchedulerOutput from rank 0,
and runs the same forward pass. After the all-reduces every rank holds the same logits and samples the same
tokens (same seeds), so only rank 0's outputs are used.

Two ways in: `start_group` spawns ranks 1..N-1 from the calling process (rank 0), or under torchrun every process
calls it and the ranks other than 0 run the worker loop and exit there.

Spawned workers leave their ending to rank 0: they ignore Ctrl-C (the terminal sends it to every process of the
group), rank 0 watches them while the group forms and ends them when it stops, and a worker whose rank 0 went away
exits without a word (rank 0 reports its own end)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import wait

import torch.distributed as dist
import torch.multiprocessing as mp

from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.core.engine import Engine
from deltaserve.distributed import ParallelConfig, broadcast_object, check_device, check_divisible, init_process_group
from deltaserve.loader.model_loader import DTYPES
from deltaserve.runner.model_runner import ModelRunner

STARTUP_TIMEOUT_S = 600.0  # a worker's spawn and imports on a loaded machine; it loads the model after it joins
STUCK_STEP_S = 30.0  # after a worker's death, how long rank 0 may stay inside a step before the process is ended
EXIT_WAIT_S = 2.0  # a dead rank's closed connection can reach rank 0 before its process can be reaped
_REAPING = threading.Lock()  # one thread at a time reaps a worker (GroupWatch's and the main thread's)
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")  # gloo's words when another rank's process ended


class RankError(RuntimeError):
    """A rank of the group exited, or never joined it: the CLI says it in one line (exit 1)."""


def start_engine(model: str, config: EngineConfig, progress=None) -> tuple[Engine, list | None]:
    """The engine (rank 0 of config.tensor_parallel_size ranks) and the worker processes it started (None on one
    process); end with stop_engine."""
    if config.tensor_parallel_size == 1:
        return Engine(model, config, progress), None
    parallel, rank_config, workers = start_group(model, config)
    try:
        engine = Engine(model, rank_config, progress, parallel)
    except BaseException as error:  # the workers wait for rank 0's plan forever: end them
        abort_group(workers, error, "during start-up")
        raise
    if workers:  # torchrun's own agent ends the group when one of its processes fails
        engine.group_watch = GroupWatch(workers)
    return engine, workers


class GroupWatch:
    """Rank 0's watch over the workers it spawned (a daemon thread from start to stop_engine).

    When a worker exits before rank 0 ends the group, `error` holds a RankError naming it (`failed` is set), every
    later step raises it before sending anything, and a wait on the group (`waiting`: a step, or the group's
    teardown) that lasts stuck_s past the exit ends the process with that line (exit 1): over gloo a dead peer's
    collective fails within milliseconds, but an NCCL collective waits for it until NCCL's watchdog ends the
    process, ten minutes later. An engine between steps is left alone (a server then answers 503; the offline
    API's next call raises the error). The workers are reaped under _REAPING, which the main thread's reaps take too
    (two threads joining one process could both miss its exit code)."""

    def __init__(self, workers: list, stuck_s: float = STUCK_STEP_S, end_process=os._exit):
        self.workers, self.stuck_s, self._end_process = workers, stuck_s, end_process
        self.error: RankError | None = None
        self.failed = threading.Event()
        self._expected = False  # rank 0 is ending the group: its workers' exits are its own doing
        self._stopped = threading.Event()
        self._waiting_since: float | None = None
        self._thread = threading.Thread(target=self._watch, name="deltaserve-rank-watch", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def waiting(self, check: bool = True):
        """Rank 0 may wait on the other ranks inside (check: raise the group's error first)."""
        if check and self.error is not None:
            raise self.error
        self._waiting_since = time.monotonic()
        try:
            yield
        finally:
            self._waiting_since = None

    def expect_exits(self) -> None:
        """From here rank 0 ends the workers: their exits are not an error."""
        self._expected = True

    def stop(self) -> None:
        """The group is gone (stop_engine): stop watching."""
        self._expected = True
        self._stopped.set()

    def _watch(self) -> None:
        sentinels = [worker.sentinel for worker in self.workers]
        while not wait(sentinels, timeout=1.0):
            if self._stopped.is_set():
                return
        if self._expected:
            return
        rank, code = _exited_worker(self.workers, EXIT_WAIT_S)
        self.error = RankError(f"rank {rank} exited with code {_exit_code(code)} while running")
        died = time.monotonic()
        self.failed.set()
        while not self._stopped.wait(0.1):
            since = self._waiting_since
            if since is not None and time.monotonic() - max(since, died) > self.stuck_s:
                print(f"error: {self.error}; rank 0 waited {self.stuck_s:.0f} s on the group for it, so this process "
                      "ends", file=sys.stderr, flush=True)
                for worker in self.workers:
                    worker.kill()
                self._end_process(1)
                return


def stop_engine(engine: Engine, workers: list | None) -> None:
    """Tell the other ranks to stop, leave the group and reap the workers (a no-op on one process).

    When a step was cut off on rank 0 (engine.mid_step: Ctrl-C inside it) the workers may wait inside one of its
    collectives, where a stop broadcast would never reach them, and when a worker has died there is no one to tell:
    then the group is ended at once instead (RankError when a worker died by itself)."""
    if workers is None:
        return
    watch = engine.group_watch
    if watch is not None:
        watch.expect_exits()
    try:
        if not engine.mid_step and engine.group_error is None and _exited_worker(workers, 0.0) is None:
            engine.shutdown()
            stop_group(workers)
            return
        error = sys.exc_info()[1]
        # the teardown may wait on a collective a dead rank never joins: the watch ends the process then
        with contextlib.nullcontext() if watch is None else watch.waiting(check=False):
            try:
                abort_group(workers, error, "while running")
            finally:
                try:
                    engine.shutdown()  # rank 0's own part (the group is gone: its broadcast fails at once)
                except (RuntimeError, ValueError):
                    pass
    finally:
        if watch is not None:
            watch.stop()


def start_group(model: str, config: EngineConfig) -> tuple[ParallelConfig, EngineConfig, list]:
    """Join (torchrun) or start (spawned workers) a group of config.tensor_parallel_size ranks; returns rank 0's
    ParallelConfig, its EngineConfig (device cuda:0 on GPUs) and the worker processes it started."""
    world = config.tensor_parallel_size
    check_device(config.device.split(":")[0], world)  # rank r runs on cuda:r (_rank_config)
    check_divisible(ModelConfig.from_file(model), ParallelConfig(0, world, config.enable_expert_parallel))
    if config.device != "cpu":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        return _join_torchrun(model, config), _rank_config(config, 0), []
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # port 0: the system picks one
    workers = _spawn_workers(model, config, store.port)
    parallel = ParallelConfig(0, world, config.enable_expert_parallel)
    try:
        _wait_for_workers(store, workers)
        init_process_group(parallel, store, config.device)
    except BaseException as error:
        abort_group(workers, error, "during start-up")
        raise
    return parallel, _rank_config(config, 0), workers


def stop_group(workers: list, timeout_s: float = 30.0) -> None:
    """After Engine.shutdown (or a failed start): leave the group and reap the workers this process started."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for worker in workers:
        with _REAPING:  # is_alive reaps too
            worker.join(timeout_s)
            if worker.is_alive():
                worker.terminate()


def abort_group(workers: list, error: BaseException | None, when: str) -> None:
    """End the workers at once and leave the group, after `error` on rank 0 (None: none); raises RankError when a
    worker had exited by itself and rank 0's error is what that does to it (its collectives fail with gloo's
    "Connection closed by peer") or there is none. Rank 0's own errors (a bad checkpoint, which every rank reads
    and fails on at about the same time; Ctrl-C) stay what they are."""
    communication = error is None or isinstance(error, dist.DistError) or any(
        words in str(error) for words in PEER_GONE)
    exited = _exited_worker(workers, EXIT_WAIT_S if communication else 0.0)
    for worker in workers:
        worker.terminate()
    stop_group(workers, timeout_s=EXIT_WAIT_S)
    if exited is not None and communication and not isinstance(error, RankError):
        rank, code = exited
        raise RankError(f"rank {rank} exited with code {_exit_code(code)} {when}") from error


def worker_loop(model: str, config: EngineConfig, parallel: ParallelConfig) -> None:
    """A rank other than 0: load this rank's shard, then run every step rank 0 broadcasts until it sends None."""
    cfg = ModelConfig.from_file(model, config.quantization)
    weights = ModelRunner.load_model(model, cfg, config, None, parallel)
    plan = broadcast_object(None, parallel)
    runner = ModelRunner(weights, cfg, plan, DTYPES[config.dtype], config.device, config.seed, cuda_graphs=False)
    while (sched := broadcast_object(None, parallel)) is not None:
        runner.execute(sched)


def _spawn_workers(model: str, config: EngineConfig, port: int) -> list:
    """Ranks 1..N-1, started with Ctrl-C ignored (from their first instruction on: Python keeps an inherited
    SIG_IGN), since rank 0 ends them. Rank 0 ignores it too while it starts them, a few milliseconds (a blocked
    signal would wait for it instead, but a spawned process starts with no signal blocked)."""
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_spawned_worker, args=(rank, model, config, port), daemon=True)
               for rank in range(1, config.tensor_parallel_size)]
    in_main_thread = threading.current_thread() is threading.main_thread()  # only it may set a signal's handler
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        for worker in workers:
            worker.start()
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)
    return workers


def _wait_for_workers(store: dist.TCPStore, workers: list) -> None:
    """Until every worker has reached rank 0's store (the group then forms at once), watching them: gloo's own
    rendezvous would wait its whole timeout for a rank that died."""
    keys = [_joined_key(rank) for rank in range(1, len(workers) + 1)]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not store.check(keys):
        exited = _exited_worker(workers, 0.0)
        if exited is not None:
            raise RankError(f"rank {exited[0]} exited with code {_exit_code(exited[1])} during start-up")
        if time.monotonic() > deadline:
            missing = [rank for rank, key in enumerate(keys, 1) if not store.check([key])]
            raise RankError(f"rank(s) {', '.join(map(str, missing))} did not join the group within "
                            f"{STARTUP_TIMEOUT_S:.0f} s of start-up")
        wait([worker.sentinel for worker in workers], timeout=0.05)


def _spawned_worker(rank: int, model: str, config: EngineConfig, port: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # again: a rank 0 outside the main thread could not set it for us
    parallel = ParallelConfig(rank, config.tensor_parallel_size, config.enable_expert_parallel)
    config = _rank_config(config, rank)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        store.set(_joined_key(rank), "")
        init_process_group(parallel, store, config.device)
        worker_loop(model, config, parallel)
    except Exception as error:
        _exit_worker(rank, error)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_worker(rank: int, error: Exception) -> None:
    """A worker's end on an error: quiet when rank 0 went away (it says why itself), else the error in one line
    before rank 0 reports this rank's exit."""
    if not any(words in str(error) for words in PEER_GONE):
        message = " ".join(str(error).split()) or "(no message)"
        print(f"error: rank {rank}: {type(error).__name__}: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def _join_torchrun(model: str, config: EngineConfig) -> ParallelConfig:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel_size:
        raise ValueError(f"torchrun started {world} processes but tensor_parallel_size = "
                         f"{config.tensor_parallel_size}; pass --nproc-per-node equal to it")
    parallel = ParallelConfig(rank, world, config.enable_expert_parallel)
    init_process_group(parallel, "env://", config.device)
    if rank != 0:  # only rank 0 talks to clients: the others serve its steps, then end the process
        try:
            worker_loop(model, _rank_config(config, rank), parallel)
        except Exception as error:
            _exit_worker(rank, error)
        finally:
            dist.destroy_process_group()
        sys.exit(0)
    return parallel


def _exited_worker(workers: list, wait_s: float) -> tuple[int, int] | None:
    """(rank, exit code) of the first worker that has exited, waiting up to wait_s for one."""
    ended = wait([worker.sentinel for worker in workers], timeout=wait_s) if workers else []
    for rank, worker in enumerate(workers, 1):
        if worker.sentinel in ended:
            with _REAPING:  # reading exitcode reaps too
                worker.join()  # its sentinel closes a moment before the process can be reaped (and its code read)
                return rank, worker.exitcode
    return None


def _exit_code(code: int | None) -> str:
    """-9 as '-9 (SIGKILL)': multiprocessing gives a signal's death as its negative number."""
    if code is None:  # reaped by something other than multiprocessing
        return "unknown"
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def _joined_key(rank: int) -> str:
    return f"deltaserve/joined/{rank}"


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """One GPU per rank (cuda:rank); on the CPU the cores are shared out (unless threads is set): N ranks each
    spinning on every core made a step ten times slower."""
    if config.device != "cpu":
        return dataclasses.replace(config, device=f"cuda:{rank}")
    if config.threads is None:
        return dataclasses.replace(config, threads=max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    return config
