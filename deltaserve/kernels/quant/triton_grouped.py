"""Routed experts with FP8 weights on a GPU, grouped by expert and CUDA-graph safe: the T*k (token, slot) pairs are
sorted by expert and cut into blocks of _BLOCK_M rows of one expert (kernels.moe.triton_blocks.expert_blocks, as
the bf16 experts are), so each block reads its expert's weights once
(one GEMV per pair re-reads them per pair: ~3.6 GB a layer for 64 tokens of top-8 of 256 experts). Two kernels:
(1) per (block, column tile of I), silu(x W1^T) * (x W3^T); (2) per (block, column tile of D), the weighted down
projection, written to the pair's (token, slot) row; the k rows of a token are then summed (no atomics, so
deterministic). Nothing syncs with the host: the launch covers the most blocks any routing can need, and blocks
past the real count exit at once. Weight tiles are dequantized in registers as kernels.quant.fp8.dequantize_fp8
does (float32 product, rounded to x's dtype). Twin: kernels.moe.naive.naive_experts on the dequantized weights."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.moe.triton_blocks import expert_blocks
from deltaserve.kernels.quant.triton_linear import _TORCH_TO_TL

_BLOCK_M, _BLOCK_N, _BLOCK_K = 16, 64, 128


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, s13_ptr, order_ptr, expert_ptr, first_ptr, rows_ptr, act_ptr, K_SLOTS: tl.constexpr,
                    D: tl.constexpr, I: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, ALIGNED: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act[sorted rows of block, column tile] = silu(gate) * up in float32."""
    pid_n, blk = tl.program_id(0), tl.program_id(1)
    start = tl.load(first_ptr + blk)
    end = start + tl.load(rows_ptr + blk)
    if start >= end:  # past the real blocks
        return
    expert = tl.load(expert_ptr + blk).to(tl.int64)
    rows_m = start + tl.arange(0, BLOCK_M)
    m_mask = rows_m < end
    token = tl.load(order_ptr + rows_m, mask=m_mask, other=0) // K_SLOTS
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_ptrs = w13_ptr + expert * (2 * I * D) + rows_n[:, None] * D
    s_base = s13_ptr + expert * (S_ROWS * S_COLS)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token[:, None] * D + cols[None, :], mask=m_mask[:, None] & (cols[None, :] < D), other=0.0)
        w_mask = (rows_n[:, None] < I) & (cols[None, :] < D)
        gate = tl.load(gate_ptrs + cols[None, :], mask=w_mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptrs + I * D + cols[None, :], mask=w_mask, other=0.0).to(tl.float32)
        if ALIGNED:  # each tile lies in one scale block: one scalar each
            gate *= tl.load(s_base + (pid_n * BLOCK_N // BN) * S_COLS + k0 // BK)
            up *= tl.load(s_base + ((I + pid_n * BLOCK_N) // BN) * S_COLS + k0 // BK)
        else:
            gate *= tl.load(s_base + (rows_n[:, None] // BN) * S_COLS + cols[None, :] // BK, mask=w_mask, other=0.0)
            up *= tl.load(s_base + ((I + rows_n[:, None]) // BN) * S_COLS + cols[None, :] // BK, mask=w_mask,
                          other=0.0)
        x = x.to(DOT_DTYPE)
        acc_gate += tl.dot(x, tl.trans(gate.to(DOT_DTYPE)), input_precision="ieee", out_dtype=tl.float32)
        acc_up += tl.dot(x, tl.trans(up.to(DOT_DTYPE)), input_precision="ieee", out_dtype=tl.float32)
    act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(act_ptr + rows_m[:, None] * I + rows_n[None, :], act, mask=m_mask[:, None] & (rows_n[None, :] < I))


@triton.jit
def _down_kernel(act_ptr, w2_ptr, s2_ptr, order_ptr, expert_ptr, first_ptr, rows_ptr, weights_ptr, y_ptr,
                 D: tl.constexpr, I: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, ALIGNED: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[pair of each row, column tile] = routing weight * act W2^T in float32, act rounded to x's dtype."""
    pid_n, blk = tl.program_id(0), tl.program_id(1)
    start = tl.load(first_ptr + blk)
    end = start + tl.load(rows_ptr + blk)
    if start >= end:  # past the real blocks
        return
    expert = tl.load(expert_ptr + blk).to(tl.int64)
    rows_m = start + tl.arange(0, BLOCK_M)
    m_mask = rows_m < end
    pair = tl.load(order_ptr + rows_m, mask=m_mask, other=0)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_ptrs = w2_ptr + expert * (D * I) + rows_n[:, None] * I
    s_base = s2_ptr + expert * (S_ROWS * S_COLS)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + rows_m[:, None] * I + cols[None, :], mask=m_mask[:, None] & (cols[None, :] < I),
                    other=0.0)
        w_mask = (rows_n[:, None] < D) & (cols[None, :] < I)
        w = tl.load(w_ptrs + cols[None, :], mask=w_mask, other=0.0).to(tl.float32)
        if ALIGNED:
            w *= tl.load(s_base + (pid_n * BLOCK_N // BN) * S_COLS + k0 // BK)
        else:
            w *= tl.load(s_base + (rows_n[:, None] // BN) * S_COLS + cols[None, :] // BK, mask=w_mask, other=0.0)
        acc += tl.dot(a.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision="ieee", out_dtype=tl.float32)
    acc *= tl.load(weights_ptr + pair, mask=m_mask, other=0.0)[:, None]
    tl.store(y_ptr + pair[:, None] * D + rows_n[None, :], acc, mask=m_mask[:, None] & (rows_n[None, :] < D))


def fp8_grouped_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale_inv: torch.Tensor, w2: torch.Tensor,
                        w2_scale_inv: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        block: tuple[int, int]) -> torch.Tensor:
    """Same contract as kernels.quant.experts.fp8_fused_experts: x [T, D] (float32, bfloat16 or float16), w13
    [E, 2I, D] and w2 [E, D, I] float8_e4m3fn with block scales [E, nb, kb], weights [T, k] float32, ids [T, k]
    -> [T, D] in x's dtype. No host sync and shapes that depend on T, k only, so a CUDA graph can capture it."""
    T, k = ids.shape
    E, D, I = w13.shape[0], x.shape[1], w2.shape[2]
    order, expert, first, rows, _ = expert_blocks(ids, E, _BLOCK_M)  # sorted row -> pair (token * k + slot)
    num_blocks, tables = expert.numel(), (order, expert, first, rows)
    s13, s2 = w13_scale_inv.float().contiguous(), w2_scale_inv.float().contiguous()
    bn, bk = block
    dot_dtype = _TORCH_TO_TL[x.dtype]
    act = torch.empty(T * k, I, dtype=torch.float32, device=x.device)
    _gate_up_kernel[(triton.cdiv(I, _BLOCK_N), num_blocks)](
        x.contiguous(), w13.contiguous(), s13, *tables, act, K_SLOTS=k, D=D, I=I,
        S_ROWS=s13.shape[1], S_COLS=s13.shape[2], BN=bn, BK=bk,
        ALIGNED=bn % _BLOCK_N == 0 and bk % _BLOCK_K == 0 and I % _BLOCK_N == 0, DOT_DTYPE=dot_dtype,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4)
    y = torch.empty(T * k, D, dtype=torch.float32, device=x.device)  # every pair's row is written once
    _down_kernel[(triton.cdiv(D, _BLOCK_N), num_blocks)](
        act, w2.contiguous(), s2, *tables, weights.float().contiguous(), y, D=D, I=I,
        S_ROWS=s2.shape[1], S_COLS=s2.shape[2], BN=bn, BK=bk, ALIGNED=bn % _BLOCK_N == 0 and bk % _BLOCK_K == 0,
        DOT_DTYPE=dot_dtype, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K, num_warps=4)
    return y.view(T, k, D).sum(1).to(x.dtype)
