"""The router on GPUs. Its logits for a few tokens in one GEMV kernel (router_logits: bf16 activations against the
float32 weights, widened in registers; twin F.linear(x.float(), weight)). The choice in one kernel where every
group stays (topk_group >= num_groups, as in Kimi-Linear-48B): sigmoid scores, bias-corrected top-k, unbiased
weights, renormalised and scaled, in one launch where torch's top-k alone is several. Twin:
kernels.moe.routing.grouped_topk.

Ids come out in descending biased score (ties: the lower expert id), weights in the same order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.autotune import tile_configs, with_tile
from deltaserve.kernels.gemv import GEMV_NAMES, NO_SCALES, gemv_jit
from deltaserve.kernels.pdl import pdl_args, pdl_enter


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, E: tl.constexpr, K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, SCALE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * E + experts, mask=experts < E, other=0.0)
    scores = tl.sigmoid(logits)
    biased = scores + tl.load(bias_ptr + experts, mask=experts < E, other=0.0)
    biased = tl.where(biased == biased, biased, float("-inf"))  # NaN (a broken row) never wins, never crashes
    free = experts < E  # a lane is a candidate until chosen: k distinct, valid ids whatever the scores
    slots = tl.arange(0, BLOCK_K)
    chosen_weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(K):
        candidates = tl.where(free, biased, float("-inf"))
        best = tl.max(candidates, axis=0)
        pick = tl.min(tl.where(free & (candidates == best), experts, BLOCK_E), axis=0)
        weight = tl.sum(tl.where(experts == pick, scores, 0.0), axis=0)
        chosen_weights = tl.where(slots == j, weight, chosen_weights)
        chosen_ids = tl.where(slots == j, pick.to(tl.int64), chosen_ids)
        free = free & (experts != pick)
    if RENORMALIZE:
        chosen_weights = chosen_weights / (tl.sum(chosen_weights, axis=0) + 1e-20)
    tl.store(weights_ptr + token * K + slots, chosen_weights * SCALE, mask=slots < K)
    tl.store(ids_ptr + token * K + slots, chosen_ids, mask=slots < K)


def triton_topk(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, renormalize: bool,
                scaling_factor: float, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] float32, correction_bias [E] float32 -> weights [T, top_k] float32, ids [T, top_k]
    int64; grouped_topk's result when no group is masked."""
    T, E = router_logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=router_logits.device)
    if T:
        _route_kernel[(T,)](router_logits.float().contiguous(), correction_bias.float().contiguous(), weights, ids,
                            E=E, K=top_k, RENORMALIZE=renormalize, SCALE=float(scaling_factor),
                            BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k), num_warps=1,
                            **pdl_args(router_logits.device, pdl))
    return weights, ids


ROUTER_GEMV_MAX_TOKENS = 16  # beyond this many tokens cuBLAS's matmul (after a float32 copy of x) is the better fit
# (experts, columns) of a program's tile, autotuned per shape; the wide tiles (the row in one step) are candidates too
_ROUTER_TILES = ((1, 1024), (1, 2048), (1, 4096), (2, 512), (2, 1024), (2, 4096), (4, 512), (8, 256))
# the shared GEMV kernel (kernels.gemv.gemv_jit) under these tiles, keyed on the token count too
_router_logits_kernel = triton.autotune(configs=tile_configs(GEMV_NAMES, _ROUTER_TILES, (2, 512), warps=(2, 4)),
                                        key=["K", "N", "T_BUCKET"])(gemv_jit)


def router_logits(x: torch.Tensor, weight: torch.Tensor, tile: tuple[int, int] | None = None,
                  pdl: bool = True) -> torch.Tensor:
    """x [T, D] (any float dtype), weight [E, D] float32 -> x @ weight^T [T, E] float32, x read in its own dtype
    and widened in registers: a decode step's router in one launch. Twin: F.linear(x.float(), weight). tile:
    (experts, columns) of a program instead of the autotuned choice."""
    T, D = x.shape
    E = weight.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T:
        x = x if x.stride(1) == 1 else x.contiguous()
        kernel, chosen = with_tile(_router_logits_kernel, GEMV_NAMES, tile)
        kernel[lambda meta: (triton.cdiv(E, meta["BLOCK_N"]), T)](
            x, weight.float().contiguous(), out, x.stride(0), out.stride(0), triton.next_power_of_2(T), N=E, K=D,
            GROUP_N=E, **NO_SCALES, **pdl_args(x.device, pdl), **chosen)
    return out
