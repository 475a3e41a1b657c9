"""The routed experts' weighted sum after grouped GEMMs, in one Triton kernel: each token's k outputs, read where the
sort by expert put them, times their routing weights, summed in float32 in slot order and rounded once.

Its torch twin (kernels.moe.experts._weighted_sum's torch path) widens the sorted outputs to float32, multiplies,
permutes them back with an index_copy and sums: five passes over [T*k, D] float32, where this kernel reads the bf16
outputs once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _weighted_sum_kernel(y_ptr, where_ptr, w_ptr, out_ptr, D: tl.constexpr, K_SLOTS: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    token, pid_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(K_SLOTS):
        row = tl.load(where_ptr + token * K_SLOTS + j)  # where the sort put pair (token, j)
        weight = tl.load(w_ptr + token * K_SLOTS + j)
        acc += tl.load(y_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32) * weight
    tl.store(out_ptr + token * D + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def rows_of_pairs(order: torch.Tensor) -> torch.Tensor:
    """order (sorted row -> pair) inverted: each pair's sorted row."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def weighted_sum(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                 where: torch.Tensor | None = None) -> torch.Tensor:
    """y [T*k, D]: the (token, slot) pairs' outputs in sorted order (pair order[i] at row i); weights [T, k] float32
    -> sum_j weights[t, j] * y[row of (t, j)], [T, D] in dtype. where: order's inverse (each pair's row), if the
    sort already made it."""
    T, k = weights.shape
    D = y.shape[1]
    if where is None:
        where = rows_of_pairs(order)
    out = torch.empty(T, D, dtype=dtype, device=y.device)
    if T:
        _weighted_sum_kernel[(T, triton.cdiv(D, 512))](y.contiguous(), where, weights.float().contiguous(), out, D=D,
                                                       K_SLOTS=k, BLOCK_D=512, num_warps=4)
    return out
