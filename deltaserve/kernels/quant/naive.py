"""The spec of block-wise FP8 weights, one block at a time: quantize, dequantize, and the matmul that reads them."""

from __future__ import annotations

import torch

from deltaserve.kernels.quant.fp8 import FP8, FP8_MAX


def naive_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels.quant.fp8.quantize_fp8, for w [N, K]: a loop over the blocks."""
    bn, bk = block
    N, K = w.shape
    q = torch.empty(N, K, dtype=FP8)
    scale = torch.empty(-(-N // bn), -(-K // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            amax = tile.abs().max().item()
            s = amax / FP8_MAX if amax > 0 else 1.0
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / scale[i, j]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def naive_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Same contract as kernels.quant.fp8.dequantize_fp8, for q [N, K]: each block times its scale."""
    bn, bk = block
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            tile = q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float() * scale_inv[i, j].float()
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = tile.to(dtype)
    return out


def naive_fp8_linear(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] -> x W^T [M, N] in float32, W dequantized block by block."""
    return x.float() @ naive_dequantize(q, scale_inv, block).T
