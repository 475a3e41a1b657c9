"""Routed experts for a few tokens on the GPU: one GEMV kernel per projection reading only the chosen experts.

For a decode step of T tokens with k experts each, fused_experts' grouped GEMM path spends ~20 launches on
sorting and gathering; here it is two: (1) per (token, slot) pair, silu(x W1^T) * (x W3^T); (2) per pair, the
weighted down projection; the k rows of a token are then summed. Each pair reads its expert's weights, so this
pays off only while pairs rarely share an expert (small T): the caller picks.

The same kernels read FP8 weights with block scales (SCALED): each weight element is multiplied by its block's
scale, one scalar per tile where the tile lies inside one scale block (ALIGNED). Twin: kernels.moe.naive.naive_experts
(on the dequantized weights for FP8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_I, _BLOCK_D = 16, 128  # gate/up: 16 rows of gate and of up a program
_BLOCK_N, _BLOCK_K = 32, 128  # down


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, s13_ptr, ids_ptr, act_ptr, K_SLOTS: tl.constexpr, D: tl.constexpr,
                    I: tl.constexpr, SCALED: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_I: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    pid_i, pair = tl.program_id(0), tl.program_id(1)
    token = pair // K_SLOTS
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    base, s_base = w13_ptr + expert * (2 * I * D), s13_ptr + expert * (S_ROWS * S_COLS)
    acc_gate = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_I], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + token * D + cols, mask=cols < D, other=0.0).to(tl.float32)
        mask = (rows[:, None] < I) & (cols[None, :] < D)
        gate = tl.load(base + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + (I + rows[:, None]) * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            if ALIGNED:  # the tile lies in one scale block: one scalar each
                gate *= tl.load(s_base + (pid_i * BLOCK_I // BN) * S_COLS + d0 // BK)
                up *= tl.load(s_base + ((I + pid_i * BLOCK_I) // BN) * S_COLS + d0 // BK)
            else:
                gate *= tl.load(s_base + (rows[:, None] // BN) * S_COLS + cols[None, :] // BK, mask=mask, other=0.0)
                up *= tl.load(s_base + ((I + rows[:, None]) // BN) * S_COLS + cols[None, :] // BK, mask=mask,
                              other=0.0)
        acc_gate += tl.sum(gate * x[None, :], axis=1)
        acc_up += tl.sum(up * x[None, :], axis=1)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(act_ptr + pair * I + rows, act, mask=rows < I)


@triton.jit
def _down_kernel(act_ptr, w2_ptr, s2_ptr, ids_ptr, weights_ptr, y_ptr, D: tl.constexpr, I: tl.constexpr,
                 SCALED: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pair = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    s_base = s2_ptr + expert * (S_ROWS * S_COLS)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + pair * I + cols, mask=cols < I, other=0.0)
        mask = (rows[:, None] < D) & (cols[None, :] < I)
        w = tl.load(w2_ptr + expert * (D * I) + rows[:, None] * I + cols[None, :], mask=mask, other=0.0)
        w = w.to(tl.float32)
        if SCALED:
            if ALIGNED:
                w *= tl.load(s_base + (pid_n * BLOCK_N // BN) * S_COLS + k0 // BK)
            else:
                w *= tl.load(s_base + (rows[:, None] // BN) * S_COLS + cols[None, :] // BK, mask=mask, other=0.0)
        acc += tl.sum(w * a[None, :], axis=1)
    tl.store(y_ptr + pair * D + rows, acc * tl.load(weights_ptr + pair), mask=rows < D)


def decode_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   w13_scale_inv: torch.Tensor | None = None, w2_scale_inv: torch.Tensor | None = None,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """Same contract as fused_experts: x [T, D], w13 [E, 2I, D], w2 [E, D, I], weights [T, k] f32, ids [T, k] ->
    [T, D] in x's dtype. With block scales (FP8 weights: float8_e4m3fn w13 and w2, scales [E, nb, kb], `block`
    (bn, bk)), the weights are multiplied by their scales as they are read: kernels.quant.experts'
    fp8_fused_experts contract."""
    T, k = ids.shape
    D, I = x.shape[1], w2.shape[2]
    pairs = T * k
    scaled = w13_scale_inv is not None
    if scaled:
        s13, s2 = w13_scale_inv.float().contiguous(), w2_scale_inv.float().contiguous()
        bn, bk = block
    else:  # the scale arguments are never read
        s13, s2, bn, bk = w13, w2, 1, 1
    act = torch.empty(pairs, I, dtype=torch.float32, device=x.device)
    # 16 rows of gate and of up a program: 512 programs for the 48B shape's 8 pairs (32 rows gave 256, measured
    # 46 us a call on an H200, 1.6 TB/s; the down kernel's 576 programs ran at 3.4 TB/s)
    _gate_up_kernel[(triton.cdiv(I, _BLOCK_I), pairs)](
        x.contiguous(), w13.contiguous(), s13, ids.contiguous(), act, K_SLOTS=k, D=D, I=I, SCALED=scaled,
        S_ROWS=s13.shape[1], S_COLS=s13.shape[2], BN=bn, BK=bk,
        ALIGNED=bn % _BLOCK_I == 0 and bk % _BLOCK_D == 0 and I % bn == 0, BLOCK_I=_BLOCK_I, BLOCK_D=_BLOCK_D,
        num_warps=4)
    y = torch.empty(pairs, D, dtype=torch.float32, device=x.device)
    _down_kernel[(triton.cdiv(D, _BLOCK_N), pairs)](
        act, w2.contiguous(), s2, ids.contiguous(), weights.float().contiguous(), y, D=D, I=I, SCALED=scaled,
        S_ROWS=s2.shape[1], S_COLS=s2.shape[2], BN=bn, BK=bk, ALIGNED=bn % _BLOCK_N == 0 and bk % _BLOCK_K == 0,
        BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4)
    return y.view(T, k, D).sum(1).to(x.dtype)
