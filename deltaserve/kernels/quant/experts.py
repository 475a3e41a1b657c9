"""Routed experts whose weights are block-wise FP8: the chosen experts' weights are dequantized, then
kernels.moe.fused_experts runs as for any dtype (on a GPU, steps of few (token, expert) pairs instead read the FP8
weights in one Triton kernel per projection)."""

from __future__ import annotations

import torch

from deltaserve.kernels.moe import fused_experts
from deltaserve.kernels.quant.fp8 import dequantize_fp8

_FEW_ASSIGNMENTS_GPU = 32  # as kernels.moe.experts: up to this many pairs, one GEMV per pair beats a grouped GEMM


def fp8_fused_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                      w2_scale_inv: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """x [T, D]; w13 [E, 2I, D] and w2 [E, D, I] float8_e4m3fn with their block scales [E, ceil(rows/bn),
    ceil(cols/bk)]; weights [T, k] float32; ids [T, k]. Same result as fused_experts on the dequantized weights,
    [T, D] in x's dtype. A CUDA graph capture takes the kernel path at any size (the other one syncs)."""
    if x.is_cuda and (ids.numel() <= _FEW_ASSIGNMENTS_GPU or torch.cuda.is_current_stream_capturing()):
        from deltaserve.kernels.quant.triton_experts import fp8_decode_experts

        return fp8_decode_experts(x, w13, w13_scale_inv, w2, w2_scale_inv, weights, ids, block)
    hit = ids.unique()  # ascending, so fused_experts still sums contributions in ascending expert order
    local_ids = torch.searchsorted(hit, ids)
    w13_hit = dequantize_fp8(w13[hit], w13_scale_inv[hit], block, x.dtype)
    w2_hit = dequantize_fp8(w2[hit], w2_scale_inv[hit], block, x.dtype)
    return fused_experts(x, w13_hit, w2_hit, weights, local_ids)
