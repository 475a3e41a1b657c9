"""Block-wise FP8 weights, vectorised: the CPU fallback, and the prefill path on a GPU (dequantize, then the
dtype's GEMM). A weight w [..., N, K] is held as q [..., N, K] float8_e4m3fn and scale_inv [..., ceil(N/bn),
ceil(K/bk)] float32 with w ~= q * scale_inv[..., n // bn, k // bk] (the hub's `weight_scale_inv`). Leading dims
(experts) have blocks of their own. Twins: kernels.quant.naive."""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
_DECODE_ROWS = 64  # up to this many rows of activations, the GPU reads the FP8 weights in one Triton kernel


def scale_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, int]) -> tuple[int, ...]:
    """The shape of the block scales of a weight of `shape` [..., N, K]."""
    *lead, N, K = shape
    return (*lead, -(-N // block[0]), -(-K // block[1]))


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any float dtype) -> (q [..., N, K] float8_e4m3fn, scale_inv float32 [..., ceil(N/bn),
    ceil(K/bk)]): per block, scale_inv = amax / 448 (1 for an all-zero block) and q = round(w / scale_inv)."""
    bn, bk = block
    *lead, N, K = w.shape
    nb, kb = -(-N // bn), -(-K // bk)
    padded = F.pad(w.float(), (0, kb * bk - K, 0, nb * bn - N)).view(*lead, nb, bn, kb, bk)
    amax = padded.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (padded / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, nb * bn, kb * bk)[..., :N, :K].contiguous(), scale


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N/bn), ceil(K/bk)] -> q * scale in float32, rounded once
    to dtype, [..., N, K]."""
    N, K = q.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :N, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :K]
    return (q.float() * scale).to(dtype)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               pdl: bool = True) -> torch.Tensor:
    """y = x W^T with W the dequantized q: x [..., K] -> [..., N] in x's dtype. On a GPU, one row runs the GEMV
    kernel (kernels.gemv.fp8_gemv) and up to _DECODE_ROWS rows the weight-only matmul, both reading the FP8 weights
    directly (weight-only: FP8 loads, scale, x's dtype in, float32 accumulation); more rows
    (prefill, compute-bound) dequantize once and run the dtype's GEMM, whose cost dwarfs the dequantization. pdl: the
    GEMV's programmatic dependent launch (kernels.pdl)."""
    if x.is_cuda:
        from deltaserve.kernels.gemv import GEMV_MAX_TOKENS, fp8_gemv
        from deltaserve.kernels.quant.triton_linear import fp8_dequantize_triton, fp8_matmul

        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= GEMV_MAX_TOKENS:  # one launch, one read of the weights (fp8_matmul splits K over two)
            rows = rows if rows.stride(1) == 1 else rows.contiguous()
            return fp8_gemv(rows, q, scale_inv.float(), block, pdl=pdl).view(*x.shape[:-1], q.shape[0])
        if rows.shape[0] <= _DECODE_ROWS:
            return fp8_matmul(rows, q, scale_inv, block).view(*x.shape[:-1], q.shape[0])
        return F.linear(x, fp8_dequantize_triton(q, scale_inv, block, x.dtype))
    return F.linear(x, dequantize_fp8(q, scale_inv, block, x.dtype))
