"""Routed experts whose weights are block-wise FP8. On a GPU: few (token, expert) pairs run one GEMV per pair
(kernels.moe.triton_decode, multiplying in the block scales), more run grouped by expert (kernels.quant.triton_grouped);
both read the FP8 weights directly and neither syncs with the host, so decode steps capture in CUDA graphs.
Prefill-sized bf16 steps (_MIN_PAIRS_TO_DEQUANTIZE pairs and up, outside decode graphs) dequantize the experts a chunk
at a time and run bf16 grouped GEMMs, as FP8 linear layers do above a few rows. On the CPU: the chosen experts' weights
are dequantized, then kernels.moe.fused_experts runs as for any dtype."""

from __future__ import annotations

import torch

from deltaserve.kernels.moe import fused_experts
from deltaserve.kernels.quant.fp8 import dequantize_fp8

MAX_PAIRS_PER_PAIR_GEMV = 256  # (token, expert) pairs up to which a GEMV per pair beats the grouped kernel
# a prefill chunk of 1k+ tokens hits every expert many times: dequantizing them (E x 3 x D x I values) then
# tensor-core GEMMs, the shape of the bf16 path, beats the grouped FP8 kernel there. Where between 256 and this the
# crossover lies is for benchmarks/gpu/kernels_bench.py --parts fp8_experts to measure
_MIN_PAIRS_TO_DEQUANTIZE = 8192
_EXPERTS_PER_CHUNK = 32  # dequantized 32 at a time: 0.45 GB of bf16 at the 48B shape, inside the activation reserve


def fp8_fused_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                      w2_scale_inv: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      block: tuple[int, int], cpu_threads: int | None = None, in_graph: bool = False,
                      pdl: bool = True) -> torch.Tensor:
    """x [T, D]; w13 [E, 2I, D] and w2 [E, D, I] float8_e4m3fn with their block scales [E, ceil(rows/bn),
    ceil(cols/bk)]; weights [T, k] float32; ids [T, k]. Same result as fused_experts on the dequantized weights,
    [T, D] in x's dtype (cpu_threads, pdl: fused_experts'). in_graph (a CUDA graph's warm-up or capture): the
    FP8 kernels whatever the step's size (a graph's pool would keep dequantized weights for good, and a warm-up
    must compile what the capture will run)."""
    if x.is_cuda:
        if ids.numel() <= MAX_PAIRS_PER_PAIR_GEMV:
            from deltaserve.kernels.moe.triton_decode import decode_experts

            return decode_experts(x, w13, w2, weights, ids, w13_scale_inv, w2_scale_inv, block, pdl=pdl)
        if ids.numel() >= _MIN_PAIRS_TO_DEQUANTIZE and x.dtype == torch.bfloat16 and not in_graph:
            return dequantized_grouped_experts(x, w13, w13_scale_inv, w2, w2_scale_inv, weights, ids, block)
        from deltaserve.kernels.quant.triton_grouped import fp8_grouped_experts

        return fp8_grouped_experts(x, w13, w13_scale_inv, w2, w2_scale_inv, weights, ids, block)
    hit = ids.unique()  # ascending, so fused_experts still sums contributions in ascending expert order
    local_ids = torch.searchsorted(hit, ids)
    w13_hit = dequantize_fp8(w13[hit], w13_scale_inv[hit], block, x.dtype)
    w2_hit = dequantize_fp8(w2[hit], w2_scale_inv[hit], block, x.dtype)
    return fused_experts(x, w13_hit, w2_hit, weights, local_ids, cpu_threads)


def dequantized_grouped_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                                w2_scale_inv: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                                block: tuple[int, int]) -> torch.Tensor:
    """fp8_fused_experts' path for prefill-sized steps on a GPU: the experts dequantized _EXPERTS_PER_CHUNK at a
    time (Triton), each chunk through the grouped GEMMs of x's dtype. Syncs with the host once: not for graphs."""
    from deltaserve.kernels.moe.experts import grouped_experts_in_chunks
    from deltaserve.kernels.quant.triton_linear import fp8_dequantize_triton

    def dequantized(e0: int, e1: int):
        return (fp8_dequantize_triton(w13[e0:e1], w13_scale_inv[e0:e1], block, x.dtype),
                fp8_dequantize_triton(w2[e0:e1], w2_scale_inv[e0:e1], block, x.dtype))

    return grouped_experts_in_chunks(x, weights, ids, w13.shape[0], _EXPERTS_PER_CHUNK, dequantized)
