"""The sizing of the two pools (MLA pages, KDA state slots) from a memory budget.

The layers' cache specs (deltaserve/cache_spec.py) price one page and one slot across the whole model: pages are
shared by all MLA layers, slots by all KDA layers. For the 48B model in bf16: ~8 KB of MLA cache per token, ~43 MB
per KDA slot."""

from __future__ import annotations

import math
from dataclasses import dataclass

from deltaserve.cache_spec import KDAStateSpec, MLAPageSpec, layer_cache_specs
from deltaserve.config import ConfigError, EngineConfig, ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
DEFAULT_CPU_CACHE_BYTES = 1 << 30  # cap of the CPU default: enough for small models, cheap to zero on a laptop
GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


@dataclass(frozen=True)
class CachePlan:
    """How many pages and slots the runner allocates, and what one of each costs in bytes."""

    num_blocks: int
    num_slots: int
    block_size: int
    bytes_per_block: int  # one page across all MLA layers
    bytes_per_slot: int  # one request's state across all KDA layers
    num_snapshot_slots: int = 0  # prefix caching's KDA state snapshots (bytes_per_slot each); 0: caching off
    latent_dtype: str | None = None  # the MLA pages' dtype (EngineConfig.latent_dtype); None: the run dtype


def plan_cache(model: ModelConfig, engine: EngineConfig, max_model_len: int,
               budget_bytes: int | None = None) -> CachePlan:
    """Size the pools: num_slots = max_num_seqs, snapshot slots (prefix caching only) from num_snapshot_slots
    (default: two a slot, at most a quarter of a given budget), pages from num_cache_blocks or from what the byte
    budget leaves after the slots and snapshots.

    The budget is `budget_bytes` (the runner's measurement of free device memory), else engine.cache_bytes,
    else on CPU the bytes of max_num_seqs sequences of max_model_len tokens (plus the snapshots), capped at 1 GiB."""
    specs, dtype_bytes = layer_cache_specs(model), DTYPE_BYTES[engine.dtype]
    latent_bytes = DTYPE_BYTES[engine.latent_dtype]
    bytes_per_block = sum(s.page_bytes(engine.block_size, latent_bytes) for s in specs if isinstance(s, MLAPageSpec))
    bytes_per_slot = sum(s.slot_bytes(dtype_bytes) for s in specs if isinstance(s, KDAStateSpec))
    num_slots = engine.max_num_seqs
    num_snapshots = (engine.num_snapshot_slots or 2 * num_slots) if engine.enable_prefix_caching else 0
    blocks_per_seq = math.ceil(max_model_len / engine.block_size)
    if engine.num_cache_blocks is not None:
        num_blocks = engine.num_cache_blocks
    elif bytes_per_block == 0:  # no MLA layer: pages cost nothing, give every slot a full-length table
        num_blocks = num_slots * blocks_per_seq
    else:
        full_length = num_slots * (bytes_per_slot + blocks_per_seq * bytes_per_block) + num_snapshots * bytes_per_slot
        budget = _budget(engine, budget_bytes, full_length)
        given = budget_bytes is not None or engine.cache_bytes is not None  # not sized for full-length sequences
        if given and num_snapshots and engine.num_snapshot_slots is None and bytes_per_slot:
            # the default, two snapshots a slot, gives way where it would take over a quarter of a given budget
            # (many slots of a large model: 512 snapshots of the 48B model's 41 MiB states would be 21 GiB)
            num_snapshots = max(1, min(num_snapshots, budget // 4 // bytes_per_slot))
        num_blocks = _blocks_in_budget(budget, num_slots, num_snapshots, bytes_per_slot, bytes_per_block)
    return CachePlan(num_blocks, num_slots, engine.block_size, bytes_per_block, bytes_per_slot, num_snapshots,
                     engine.latent_dtype)


def describe_plan(plan: CachePlan) -> str:
    """One line for the start-up log."""
    pages = plan.num_blocks * plan.bytes_per_block
    slots = plan.num_slots * plan.bytes_per_slot
    snapshots = plan.num_snapshot_slots * plan.bytes_per_slot
    snapshot_text = (f" + {plan.num_snapshot_slots} KDA snapshots for prefix caching ({format_bytes(snapshots)})"
                     if plan.num_snapshot_slots else "")
    float8 = ", float8" if plan.latent_dtype == "float8_e4m3fn" else ""
    return (f"cache: {plan.num_blocks} MLA pages x {plan.block_size} tokens = {plan.num_blocks * plan.block_size} "
            f"tokens ({format_bytes(pages)}{float8}) + {plan.num_slots} KDA state slots ({format_bytes(slots)})"
            f"{snapshot_text}; {format_bytes(pages + slots + snapshots)} in all")


def format_bytes(num_bytes: int) -> str:
    """1536 -> '1.5 KiB'; a negative count (a budget overdrawn) keeps its sign: -2 GiB -> '-2.0 GiB'."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"


def _budget(engine: EngineConfig, budget_bytes: int | None, full_length_bytes: int) -> int:
    if budget_bytes is not None:
        return budget_bytes
    if engine.cache_bytes is not None:
        return engine.cache_bytes
    if engine.device != "cpu":
        raise ConfigError(f"no cache budget on device {engine.device!r}: pass the runner's measurement "
                          "(ModelRunner.cache_budget) as budget_bytes, or set cache_bytes")
    return min(full_length_bytes, DEFAULT_CPU_CACHE_BYTES)


def _blocks_in_budget(budget: int, num_slots: int, num_snapshots: int, bytes_per_slot: int,
                      bytes_per_block: int) -> int:
    slots_bytes = (num_slots + num_snapshots) * bytes_per_slot
    if budget < slots_bytes + bytes_per_block:
        snapshots = f" and {num_snapshots} prefix-caching snapshots" if num_snapshots else ""
        raise ConfigError(
            f"cache budget {budget} B ({format_bytes(budget)}) cannot hold {num_slots} KDA state slots{snapshots} "
            f"({format_bytes(bytes_per_slot)} each, {format_bytes(slots_bytes)} in all) plus one MLA page "
            f"({format_bytes(bytes_per_block)}); raise the engine option cache_bytes (or, on a GPU, "
            "gpu_memory_utilization, or free the memory other processes or engines hold), or lower max_num_seqs "
            "(--max-num-seqs) or num_snapshot_slots")
    return (budget - slots_bytes) // bytes_per_block
