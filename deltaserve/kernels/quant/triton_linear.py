"""FP8 weights on a GPU: a weight-only matmul for decode (FP8 loads, block scale, x's dtype in, float32 accumulation)
and a dequantize kernel for prefill. Twins: kernels.quant.naive (naive_fp8_linear, naive_dequantize); the dequantize
kernel equals kernels.quant.fp8.dequantize_fp8 bit for bit (the same float32 product, rounded once).

Any block size works: each weight element finds its scale at [row // BN, col // BK], so tiles need not align with
blocks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TORCH_TO_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, N, K, S_ROWS, S_COLS, BN: tl.constexpr, BK: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k, e = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    offsets = e * N * K + rows[:, None] * K + cols[None, :]
    q = tl.load(q_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + e * S_ROWS * S_COLS + (rows[:, None] // BN) * S_COLS + cols[None, :] // BK, mask=mask,
                other=0.0)
    tl.store(out_ptr + offsets, (q * s).to(out_ptr.dtype.element_ty), mask=mask)


def fp8_dequantize_triton(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """Same contract as kernels.quant.fp8.dequantize_fp8: q [..., N, K], scale_inv [..., nb, kb] -> [..., N, K]."""
    N, K = q.shape[-2:]
    lead = q.numel() // max(N * K, 1)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    grid = (triton.cdiv(N, 32), triton.cdiv(K, 128), lead)
    _dequantize_kernel[grid](q.contiguous(), scale_inv.float().contiguous(), out, N, K, scale_inv.shape[-2],
                             scale_inv.shape[-1], BN=block[0], BK=block[1], BLOCK_N=32, BLOCK_K=128, num_warps=4)
    return out


@triton.jit
def _matmul_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K: tl.constexpr, S_COLS: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ALIGNED: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of x W^T over K range [split * K_PER_SPLIT, + K_PER_SPLIT), written to y[split]
    (float32 partial sums when split over K, else y itself). ALIGNED: every weight tile lies in one scale block,
    whose scale is then one scalar load instead of one per element."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # the last range may be cut short by K (a scale index past K would read past the scales)
    for k0 in range(split * K_PER_SPLIT, tl.minimum(split * K_PER_SPLIT + K_PER_SPLIT, K), BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows_m[:, None] * K + cols[None, :], mask=(rows_m[:, None] < M) & (cols[None, :] < K),
                    other=0.0)
        w_mask = (rows_n[:, None] < N) & (cols[None, :] < K)
        q = tl.load(q_ptr + rows_n[:, None] * K + cols[None, :], mask=w_mask, other=0.0).to(tl.float32)
        if ALIGNED:
            s = tl.load(s_ptr + (pid_n * BLOCK_N // BN) * S_COLS + k0 // BK)
        else:
            s = tl.load(s_ptr + (rows_n[:, None] // BN) * S_COLS + cols[None, :] // BK, mask=w_mask, other=0.0)
        w = (q * s).to(DOT_DTYPE)  # the weight as the fallback dequantizes it, in x's dtype
        acc += tl.dot(x.to(DOT_DTYPE), tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
    y_mask = (rows_m[:, None] < M) & (rows_n[None, :] < N)
    tl.store(y_ptr + split * M * N + rows_m[:, None] * N + rows_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=y_mask)


_BLOCK_M, _BLOCK_N, _BLOCK_K = 16, 64, 128
_TARGET_PROGRAMS = 528  # ~4 a streaming multiprocessor on an H100/H200: enough loads in flight to stream weights


def _num_splits(M: int, N: int, K: int) -> int:
    """How many K ranges a decode matmul is split into so that the launch has ~_TARGET_PROGRAMS programs (a
    [1, 4096] x [4096, 2304] product has only 36 column tiles)."""
    tiles = triton.cdiv(N, _BLOCK_N) * triton.cdiv(M, _BLOCK_M)
    return max(1, min(triton.cdiv(_TARGET_PROGRAMS, tiles), triton.cdiv(K, _BLOCK_K)))


def fp8_matmul(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               splits: int | None = None) -> torch.Tensor:
    """x [M, K] (float32, bfloat16 or float16), q [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] ->
    x W^T [M, N] in x's dtype, float32 accumulation. Meant for small M (decode): each weight byte is read once
    per 16 rows of x. K is split into `splits` ranges (default: enough for ~_TARGET_PROGRAMS programs) whose
    float32 partial sums are added in a fixed order (deterministic)."""
    M, K = x.shape
    N = q.shape[0]
    if M == 0:
        return x.new_empty(0, N)
    splits = splits or _num_splits(M, N, K)
    k_per_split = triton.cdiv(triton.cdiv(K, splits), _BLOCK_K) * _BLOCK_K
    splits = triton.cdiv(K, k_per_split)
    aligned = block[0] % _BLOCK_N == 0 and block[1] % _BLOCK_K == 0
    y = torch.empty(splits, M, N, dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    grid = (triton.cdiv(N, _BLOCK_N), triton.cdiv(M, _BLOCK_M), splits)
    _matmul_kernel[grid](x.contiguous(), q.contiguous(), scale_inv.float().contiguous(), y, M, N, K,
                         scale_inv.shape[-1], K_PER_SPLIT=k_per_split, DOT_DTYPE=_TORCH_TO_TL[x.dtype], BN=block[0],
                         BK=block[1], ALIGNED=aligned, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
                         num_warps=4)
    return y[0] if splits == 1 else y.sum(0).to(x.dtype)
