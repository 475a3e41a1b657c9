"""Which part of each full parameter a tensor-parallel rank holds, and copying a checkpoint piece into that part.

A sharded parameter keeps, along one dim, some ranges of the full parameter's indices, concatenated in order
(KDA's in_proj keeps this rank's q, k, v rows, all of f_a and g_a, and this rank's b rows). Parameters not named
here are replicated."""

from __future__ import annotations

import torch

from deltaserve.config import KDA, MOE, ModelConfig
from deltaserve.distributed import ParallelConfig
from deltaserve.loader.checkpoint import CheckpointError

Shard = tuple[int, list[tuple[int, int]]]  # (dim, ranges [start, stop) of full indices kept, in local order)


def shard_specs(cfg: ModelConfig, parallel: ParallelConfig) -> dict[str, Shard]:
    """deltaserve parameter name -> this rank's shard of it, for every sharded parameter."""
    specs = {}
    for i in range(cfg.num_hidden_layers):
        attn = _kda_specs(cfg, parallel) if cfg.layer_types[i] == KDA else _mla_specs(cfg, parallel)
        mlp = _moe_specs(cfg, parallel) if cfg.mlp_types[i] == MOE else _swiglu_specs(cfg.intermediate_size, parallel)
        specs.update({f"layers.{i}.self_attn.{k}": v for k, v in attn.items()})
        specs.update({f"layers.{i}.mlp.{k}": v for k, v in mlp.items()})
    return specs


def _part(parallel: ParallelConfig, total: int, offset: int = 0) -> tuple[int, int]:
    start, size = parallel.split(total)
    return offset + start, offset + start + size


def _kda_specs(cfg: ModelConfig, p: ParallelConfig) -> dict[str, Shard]:
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    HK = H * K
    heads = _part(p, HK)
    qkv = [_part(p, HK, c * HK) for c in range(3)]
    return {"in_proj.weight": (0, qkv + [(3 * HK, 3 * HK + 2 * K), _part(p, H, 3 * HK + 2 * K)]),
            "conv_weight": (0, qkv), "fg_b_proj.weight": (0, [heads, _part(p, HK, HK)]), "dt_bias": (0, [heads]),
            "A_log": (0, [_part(p, H)]), "o_proj.weight": (1, [heads])}


def _mla_specs(cfg: ModelConfig, p: ParallelConfig) -> dict[str, Shard]:
    H, q_rows = cfg.num_attention_heads, cfg.num_attention_heads * cfg.qk_head_dim
    return {"in_proj.weight": (0, [_part(p, q_rows), (q_rows, q_rows + cfg.kv_lora_rank + cfg.qk_rope_head_dim)]),
            "kv_b_proj.weight": (0, [_part(p, H * (cfg.qk_nope_head_dim + cfg.v_head_dim))]),
            "o_proj.weight": (1, [_part(p, H * cfg.v_head_dim)])}


def _swiglu_specs(inter: int, p: ParallelConfig, prefix: str = "") -> dict[str, Shard]:
    return {prefix + "gate_up_proj.weight": (0, [_part(p, inter), _part(p, inter, inter)]),
            prefix + "down_proj.weight": (1, [_part(p, inter)])}


def _moe_specs(cfg: ModelConfig, p: ParallelConfig) -> dict[str, Shard]:
    specs = _swiglu_specs(cfg.moe_intermediate_size * cfg.num_shared_experts, p, "shared_experts.")
    if p.expert_parallel:
        experts = _part(p, cfg.num_experts)
        return specs | {"w13": (0, [experts]), "w2": (0, [experts])}
    I = cfg.moe_intermediate_size
    return specs | {"w13": (1, [_part(p, I), _part(p, I, I)]), "w2": (2, [_part(p, I)])}


def local_parts(index: tuple, full_shape: torch.Size, shard: Shard) -> list[tuple[tuple, int, int, int]]:
    """Where a piece filling full[index] lands in the local shard: (local index, piece dim, start, length) for
    each part of it this rank keeps (the piece is narrowed along `piece dim`); [] when the rank keeps none."""
    dim, ranges = shard
    index = tuple(index) + (slice(None),) * (len(full_shape) - len(index))
    entry, piece_dim = index[dim], dim - sum(isinstance(i, int) for i in index[:dim])
    parts, offset = [], 0
    for start, stop in ranges:
        if isinstance(entry, int):
            if start <= entry < stop:
                parts.append((index[:dim] + (offset + entry - start,) + index[dim + 1:], piece_dim, 0, -1))
        else:
            a, b, _ = entry.indices(full_shape[dim])
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                local = slice(offset + lo - start, offset + hi - start)
                parts.append((index[:dim] + (local,) + index[dim + 1:], piece_dim, lo - a, hi - lo))
        offset += stop - start
    return parts


def copy_piece(target: torch.Tensor, index: tuple, full_shape: torch.Size, shard: Shard | None, read) -> None:
    """Copy a checkpoint piece (read() -> the tensor filling full[index]) into the local parameter `target`,
    keeping only this rank's part; the checkpoint tensor is read only when some of it is kept."""
    piece_shape = torch.empty(full_shape, device="meta")[index].shape
    if shard is None:
        (target[index] if index else target).copy_(read().reshape(piece_shape))
        return
    parts = local_parts(index, full_shape, shard)
    if parts:
        tensor = read().reshape(piece_shape)
        for local, piece_dim, start, length in parts:
            target[local].copy_(tensor if length < 0 else tensor.narrow(piece_dim, start, length))


def shard_fp8(param: str, values: torch.Tensor, scales: torch.Tensor, shard: Shard,
              extent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a whole FP8 parameter (values [..], block scales with `extent` elements per block along
    the shard's dim): the kept indices, and for each local block the scales of the whole parameter's block its
    elements come from. A local block must not mix elements of two blocks (each element keeps its own scale)."""
    dim, ranges = shard
    kept = torch.cat([torch.arange(start, stop) for start, stop in ranges])
    blocks = kept // extent  # the whole parameter's block of each kept index
    first = blocks[::extent]  # ... of each local block's first element
    if not torch.equal(blocks, first.repeat_interleave(extent)[: len(kept)]):
        local = int((blocks != first.repeat_interleave(extent)[: len(kept)]).nonzero()[0])
        raise CheckpointError(
            f"parameter {param}: this tensor-parallel rank keeps indices {ranges} of dim {dim}, so its local FP8 block "
            f"{local // extent} ({extent} wide) would mix elements of two blocks of the whole weight (index "
            f"{int(kept[local])}); use a tensor_parallel_size that splits it on {extent}-element block boundaries, "
            "or run without FP8")
    local_values = values.view(torch.uint8).index_select(dim, kept.to(values.device)).view(values.dtype)
    return local_values, scales.index_select(dim, first.to(scales.device))
