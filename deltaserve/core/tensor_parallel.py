"""Running one model over several processes: rank 0 is the engine (scheduler, tokenizer, clients), the other ranks
run `worker_loop`: each loads its shard, takes the cache plan and then every step's SchedulerOutput from rank 0,
and runs the same forward pass. After the all-reduces every rank holds the same logits and samples the same
tokens (same seeds), so only rank 0's outputs are used.

Two ways in: `start_group` spawns ranks 1..N-1 from the calling process (rank 0), or under torchrun every process
calls it and the ranks other than 0 run the worker loop and exit there."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.core.engine import Engine
from deltaserve.distributed import ParallelConfig, broadcast_object, check_device, check_divisible, init_process_group
from deltaserve.loader.model_loader import DTYPES
from deltaserve.runner.model_runner import ModelRunner


def start_engine(model: str, config: EngineConfig, progress=None) -> tuple[Engine, list | None]:
    """The engine (rank 0 of config.tensor_parallel_size ranks) and the worker processes it started (None on one
    process); end with stop_engine."""
    if config.tensor_parallel_size == 1:
        return Engine(model, config, progress), None
    parallel, rank_config, workers = start_group(model, config)
    try:
        return Engine(model, rank_config, progress, parallel), workers
    except BaseException:
        stop_group(workers, timeout_s=0)  # they wait for rank 0's plan forever: end them
        raise


def stop_engine(engine: Engine, workers: list | None) -> None:
    """Tell the other ranks to stop, leave the group and reap the workers (a no-op on one process)."""
    if workers is not None:
        engine.shutdown()
        stop_group(workers)


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
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_spawned_worker, args=(rank, model, config, init_method), daemon=True)
               for rank in range(1, world)]
    for worker in workers:
        worker.start()
    parallel = ParallelConfig(0, world, config.enable_expert_parallel)
    init_process_group(parallel, init_method, config.device)
    return parallel, _rank_config(config, 0), workers


def stop_group(workers: list, timeout_s: float = 30.0) -> None:
    """After Engine.shutdown (or a failed start): leave the group and reap the workers this process started."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for worker in workers:
        worker.join(timeout_s)
        if worker.is_alive():
            worker.terminate()


def worker_loop(model: str, config: EngineConfig, parallel: ParallelConfig) -> None:
    """A rank other than 0: load this rank's shard, then run every step rank 0 broadcasts until it sends None."""
    cfg = ModelConfig.from_file(model, config.quantization)
    weights = ModelRunner.load_model(model, cfg, config, None, parallel)
    plan = broadcast_object(None, parallel)
    runner = ModelRunner(weights, cfg, plan, DTYPES[config.dtype], config.device, config.seed, cuda_graphs=False)
    while (sched := broadcast_object(None, parallel)) is not None:
        runner.execute(sched)


def _spawned_worker(rank: int, model: str, config: EngineConfig, init_method: str) -> None:
    parallel = ParallelConfig(rank, config.tensor_parallel_size, config.enable_expert_parallel)
    config = _rank_config(config, rank)
    init_process_group(parallel, init_method, config.device)
    try:
        worker_loop(model, config, parallel)
    finally:
        dist.destroy_process_group()


def _join_torchrun(model: str, config: EngineConfig) -> ParallelConfig:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.tensor_parallel_size:
        raise ValueError(f"torchrun started {world} processes but tensor_parallel_size = "
                         f"{config.tensor_parallel_size}; pass --nproc-per-node equal to it")
    parallel = ParallelConfig(rank, world, config.enable_expert_parallel)
    init_process_group(parallel, "env://", config.device)
    if rank != 0:  # only rank 0 talks to clients: the others serve its steps, then end the process
        worker_loop(model, _rank_config(config, rank), parallel)
        dist.destroy_process_group()
        sys.exit(0)
    return parallel


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """One GPU per rank (cuda:rank); on the CPU the cores are shared out (unless threads is set): N ranks each
    spinning on every core made a step ten times slower."""
    if config.device != "cpu":
        return dataclasses.replace(config, device=f"cuda:{rank}")
    if config.threads is None:
        return dataclasses.replace(config, threads=max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))
    return config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

