"""Routed experts with FP8 weights for a few tokens on a GPU: kernels.moe.triton_decode's two GEMV kernels, reading
FP8 weights and their block scales. Twin: kernels.moe.naive.naive_experts on the dequantized weights."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, s13_ptr, ids_ptr, act_ptr, K_SLOTS: tl.constexpr, D: tl.constexpr,
                    I: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    ALIGNED: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
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
        if ALIGNED:  # the tile lies in one scale block: one scalar each
            gate *= tl.load(s_base + (pid_i * BLOCK_I // BN) * S_COLS + d0 // BK)
            up *= tl.load(s_base + ((I + pid_i * BLOCK_I) // BN) * S_COLS + d0 // BK)
        else:
            gate *= tl.load(s_base + (rows[:, None] // BN) * S_COLS + cols[None, :] // BK, mask=mask, other=0.0)
            up *= tl.load(s_base + ((I + rows[:, None]) // BN) * S_COLS + cols[None, :] // BK, mask=mask, other=0.0)
        acc_gate += tl.sum(gate * x[None, :], axis=1)
        acc_up += tl.sum(up * x[None, :], axis=1)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(act_ptr + pair * I + rows, act, mask=rows < I)


@triton.jit
def _down_kernel(act_ptr, w2_ptr, s2_ptr, ids_ptr, weights_ptr, y_ptr, D: tl.constexpr, I: tl.constexpr,
                 S_ROWS: tl.constexpr, S_COLS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 ALIGNED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pair = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + pair * I + cols, mask=cols < I, other=0.0)
        mask = (rows[:, None] < D) & (cols[None, :] < I)
        w = tl.load(w2_ptr + expert * (D * I) + rows[:, None] * I + cols[None, :], mask=mask, other=0.0)
        if ALIGNED:
            s = tl.load(s2_ptr + expert * (S_ROWS * S_COLS) + (pid_n * BLOCK_N // BN) * S_COLS + k0 // BK)
        else:
            s = tl.load(s2_ptr + expert * (S_ROWS * S_COLS) + (rows[:, None] // BN) * S_COLS + cols[None, :] // BK,
                        mask=mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * s * a[None, :], axis=1)
    tl.store(y_ptr + pair * D + rows, acc * tl.load(weights_ptr + pair), mask=rows < D)


def fp8_decode_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                       w2_scale_inv: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       block: tuple[int, int]) -> torch.Tensor:
    """Same contract as kernels.quant.experts.fp8_fused_experts: x [T, D], w13 [E, 2I, D] and w2 [E, D, I]
    float8_e4m3fn with block scales [E, nb, kb], weights [T, k] float32, ids [T, k] -> [T, D] in x's dtype."""
    T, k = ids.shape
    D, I = x.shape[1], w2.shape[2]
    pairs = T * k
    act = torch.empty(pairs, I, dtype=torch.float32, device=x.device)
    s13, s2 = w13_scale_inv.float().contiguous(), w2_scale_inv.float().contiguous()
    bn, bk = block
    # as kernels.moe.triton_decode: 16 rows of gate and of up a program; tiles inside one scale block when aligned
    _gate_up_kernel[(triton.cdiv(I, 16), pairs)](
        x.contiguous(), w13.contiguous(), s13, ids.contiguous(), act, K_SLOTS=k, D=D, I=I, S_ROWS=s13.shape[1],
        S_COLS=s13.shape[2], BN=bn, BK=bk, ALIGNED=bn % 16 == 0 and bk % 128 == 0 and I % bn == 0, BLOCK_I=16,
        BLOCK_D=128, num_warps=4)
    y = torch.empty(pairs, D, dtype=torch.float32, device=x.device)
    _down_kernel[(triton.cdiv(D, 32), pairs)](
        act, w2.contiguous(), s2, ids.contiguous(), weights.float().contiguous(), y, D=D, I=I, S_ROWS=s2.shape[1],
        S_COLS=s2.shape[2], BN=bn, BK=bk, ALIGNED=bn % 32 == 0 and bk % 128 == 0, BLOCK_N=32, BLOCK_K=128,
        num_warps=4)
    return y.view(T, k, D).sum(1).to(x.dtype)
