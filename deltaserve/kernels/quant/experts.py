"""Routed experts whose weights are block-wise FP8. On a GPU: few (token, expert) pairs run one GEMV per pair
(kernels.moe.triton_decode, multiplying in the block scales), more run grouped by expert
(kernels.quant.triton_grouped); both read the FP8 weights directly and neither syncs with the host, so decode
steps capture in CUDA graphs. On the CPU: the chosen experts'
weights are dequantized, then kernels.moe.fused_experts runs as for any dtype."""

from __future__ import annotations

import torch

from deltaserve.kernels.moe import fused_experts
from deltaserve.kernels.quant.fp8 import dequantize_fp8

# measured on an H200, the 48B shape (256 experts, top-8), one layer: a GEMV per pair 34 / 254 / 984 us at 8 / 128
# / 512 pairs, grouped 99 / 367 / 730 us (and 834 us at 2048 pairs against 3.9 ms)
_MAX_PAIRS_PER_PAIR_GEMV = 256


def fp8_fused_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                      w2_scale_inv: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """x [T, D]; w13 [E, 2I, D] and w2 [E, D, I] float8_e4m3fn with their block scales [E, ceil(rows/bn),
    ceil(cols/bk)]; weights [T, k] float32; ids [T, k]. Same result as fused_experts on the dequantized weights,
    [T, D] in x's dtype."""
    if x.is_cuda:
        if ids.numel() <= _MAX_PAIRS_PER_PAIR_GEMV:
            from deltaserve.kernels.moe.triton_decode import decode_experts

            return decode_experts(x, w13, w2, weights, ids, w13_scale_inv, w2_scale_inv, block)
        from deltaserve.kernels.quant.triton_grouped import fp8_grouped_experts

        return fp8_grouped_experts(x, w13, w13_scale_inv, w2, w2_scale_inv, weights, ids, block)
    hit = ids.unique()  # ascending, so fused_experts still sums contributions in ascending expert order
    local_ids = torch.searchsorted(hit, ids)
    w13_hit = dequantize_fp8(w13[hit], w13_scale_inv[hit], block, x.dtype)
    w2_hit = dequantize_fp8(w2[hit], w2_scale_inv[hit], block, x.dtype)
    return fused_experts(x, w13_hit, w2_hit, weights, local_ids)
