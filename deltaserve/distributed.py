"""Tensor and expert parallel over torch.distributed: who this process is, and the few collectives the model uses;
and check_device, the device option checked against the machine (the ranks' GPUs among it).

The rank and world size travel as an explicit ParallelConfig (passed to the layers, the loader and the engine);
nothing here is a hidden global except torch.distributed's own default process group and the gloo group that
broadcast_object uses beside it, set up together once per process."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from deltaserve.config import ConfigError, ModelConfig

GLOO_TIMEOUT = timedelta(days=365)  # init_process_group says why
_objects_group = None  # gloo, whatever the default group's backend: broadcast_object's (init_process_group says why)


def check_device(device: str, count: int = 1) -> None:
    """ValueError, saying what to pass instead, unless device ('cpu', 'cuda' or 'cuda:N') is on this machine with
    `count` GPUs from its index on (tensor parallel's ranks). Without it, CUDA missing surfaced as torch's
    AssertionError from deep inside the load."""
    if device == "cpu":
        return
    try:
        index = torch.device(device).index or 0
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a device name: use 'cpu', 'cuda' or 'cuda:N'") from None
    if not torch.cuda.is_available():
        built = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
        why = "torch finds no GPU" if built else "this torch is a CPU-only build"
        raise ValueError(f"device {device!r}: CUDA is not available ({why}); use device cpu (--device cpu), or leave "
                         "the device out to take what the machine has")
    have = torch.cuda.device_count()
    if index + count > have:
        ranks = f" for {count} tensor-parallel ranks" if count > 1 else ""
        raise ValueError(f"device {device!r}{ranks}: this machine has {have} GPU(s), cuda:0 to cuda:{have - 1}; "
                         "pass one of those (or fewer ranks)")


@dataclass(frozen=True)
class ParallelConfig:
    """This process's place: rank in [0, world_size); expert_parallel splits the routed experts across ranks
    (else each expert's intermediate dim is split)."""

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False

    def split(self, total: int) -> tuple[int, int]:
        """This rank's (start, size) of `total` items split evenly (check_divisible has checked it divides)."""
        size = total // self.world_size
        return self.rank * size, size


SINGLE = ParallelConfig()


def check_divisible(cfg: ModelConfig, parallel: ParallelConfig) -> None:
    """Every split dimension must divide by the world size; the error names the config.json field."""
    n = parallel.world_size
    fields = {"num_attention_heads": cfg.num_attention_heads, "linear_attn_config.num_heads": cfg.kda_num_heads,
              "intermediate_size": cfg.intermediate_size,
              "moe_intermediate_size * num_shared_experts": cfg.moe_intermediate_size * cfg.num_shared_experts}
    fields.update({"num_experts": cfg.num_experts} if parallel.expert_parallel
                  else {"moe_intermediate_size": cfg.moe_intermediate_size})
    for name, value in fields.items():
        if value % n:
            raise ConfigError(f"config field '{name}' = {value} does not divide by tensor_parallel_size = {n}; "
                              "pick a tensor_parallel_size that divides it")


def all_reduce(x: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """Sum x over the ranks, in place (the row-parallel projections' partial outputs)."""
    if parallel.world_size > 1:
        dist.all_reduce(x)
    return x


def broadcast_object(obj, parallel: ParallelConfig):
    """rank 0's obj, on every rank (obj is ignored elsewhere); picklable objects only."""
    if parallel.world_size == 1:
        return obj
    box = [obj if parallel.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=_objects_group)
    return box[0]


def init_process_group(parallel: ParallelConfig, rendezvous: str | dist.Store, device: str) -> None:
    """gloo on the CPU, NCCL on GPUs (each rank on cuda:rank); rendezvous: torchrun's "env://" or the store rank 0
    made (core/tensor_parallel.py).

    Workers wait for rank 0's next step inside broadcast_object for as long as rank 0 is idle (a server between
    requests), and a collective's timeout ends the wait: NCCL's watchdog aborts the process after 10 minutes, gloo's
    default after 30. So the steps travel over a gloo group of their own, on GPUs too (the objects are pickled on
    the host either way), whose timeout is a year: a rank's death still fails its peers' gloo collectives at once,
    as its connections close."""
    global _objects_group
    backend = "gloo" if device == "cpu" else "nccl"
    if backend == "nccl":
        torch.cuda.set_device(parallel.rank)
    where = {"store": rendezvous} if isinstance(rendezvous, dist.Store) else {"init_method": rendezvous}
    timeout = {"timeout": GLOO_TIMEOUT} if backend == "gloo" else {}
    dist.init_process_group(backend, rank=parallel.rank, world_size=parallel.world_size, **where, **timeout)
    _objects_group = dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT)

