"""Routed experts for a decode batch on the GPU: the (token, slot) pairs sorted by expert and cut into blocks of
BLOCK_M rows of one expert, then two Triton kernels whose programs each take one block and one tile of output
columns, reading that tile of the block's expert once for all its rows (tensor-core products over the rows).

This sits between kernels.moe.triton_decode (a GEMV per pair: every pair reads its expert, right for a few pairs)
and torch._grouped_mm (experts.grouped_experts: GEMM tiles built for many rows an expert, where a decode batch of
64-256 tokens gives each of the ~200-256 chosen experts 2-8). The blocks are laid out on the device with shape-only
bounds, so the path is CUDA-graph safe. Twin: kernels.moe.naive.naive_experts."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.moe.experts import sort_by_expert
from deltaserve.kernels.moe.triton_combine import rows_of_pairs, weighted_sum
from deltaserve.kernels.pdl import pdl_args, pdl_enter

BLOCK_M = 16  # rows (pairs) a block: tl.dot's smallest; a decode batch gives an expert a few
GATE_UP_TILE = (64, 128)  # (output columns, reduction columns) a program's step: benchmarks/gpu/kernels_bench.py
DOWN_TILE = (64, 128)
NUM_STAGES = 4  # software pipelining of the weight tiles' loads


MOST_SORTED_PAIRS = 4096  # up to this many pairs, Triton programs place them (expert_blocks); past it, the torch twin
SORT_CHUNK = 32  # pairs a program of expert_blocks places (kernels_bench's bookkeeping part swept 32-256 and one sort)
_PAIR_SIZES = (256, 512, 1024, 2048, MOST_SORTED_PAIRS)  # expert_blocks' compiled pair counts (padded up to one)


def expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M, chunk: int = SORT_CHUNK,
                  num_warps: int = 4):
    """ids [T, k] in [0, num_experts) (the router's; not checked) -> (order: the flat pairs sorted by expert,
    stably; per block, up to a bound that depends on the shapes only (min(E, T*k) + T*k // block_m): its expert,
    its first row in sorted order, its rows, 0 for the blocks past the last; and where: each pair's row in sorted
    order, order's inverse, for the weighted sum). One Triton launch, a program a chunk of pairs (a decode step's
    few thousand pairs: the ~15 small torch ops of the twin, a radix sort among them, cost more than the whole
    launch). The pair count is padded to a power of two of at least 256 and passed unspecialised, so the CUDA
    graphs' 13 batch sizes compile four variants, not one each. The twin, torch_expert_blocks, past
    MOST_SORTED_PAIRS."""
    pairs = ids.numel()
    if pairs > MOST_SORTED_PAIRS or num_experts > MOST_SORTED_PAIRS:
        return torch_expert_blocks(ids, num_experts, block_m)
    num_blocks = min(num_experts, pairs) + pairs // block_m
    order, where = (torch.empty(pairs, dtype=torch.int64, device=ids.device) for _ in range(2))
    expert, first, rows = (torch.empty(num_blocks, dtype=torch.int32, device=ids.device) for _ in range(3))
    if pairs:
        padded = next(size for size in _PAIR_SIZES if size >= pairs)
        programs, e_pad = triton.cdiv(pairs, chunk), triton.next_power_of_2(num_experts + 1)
        places = torch.empty(programs, e_pad, dtype=torch.int32, device=ids.device)
        _expert_blocks_kernel[(programs,)](
            ids.contiguous(), order, where, expert, first, rows, places, pairs, num_blocks, E=num_experts,
            P_PAD=padded, E_PAD=e_pad, NB_PAD=triton.next_power_of_2(min(num_experts, padded) + padded // block_m),
            BLOCK_M=block_m, CHUNK=chunk, num_warps=num_warps)
    return order, expert, first, rows, where


@triton.jit(do_not_specialize=["P", "NB"])
def _expert_blocks_kernel(ids_ptr, order_ptr, where_ptr, expert_ptr, first_ptr, rows_ptr, places_ptr, P, NB,
                          E: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr, NB_PAD: tl.constexpr,
                          BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """torch_expert_blocks in Triton, a program a CHUNK of pairs. Each program counts every pair's expert (a
    histogram; the padding counted as expert E, in a bin of its own: E_PAD > E) and those of the chunks before its
    own, so each expert's first place for this chunk is its run's start plus those earlier pairs (written to this
    program's row of places, to look up by expert); a pair goes there plus the pairs of its expert ahead of it in
    the chunk: a stable sort by expert, stored both ways (order and where). Program 0 also writes every block past
    the last as the twin writes it (the last expert's, no rows) and, after a barrier, each expert's blocks over
    those places, the b-th of all experts at once."""
    c = tl.program_id(0)
    idx = tl.arange(0, P_PAD)
    e = tl.load(ids_ptr + idx, mask=idx < P, other=E).to(tl.int32)
    experts = tl.arange(0, E_PAD)
    counts = tl.where(experts < E, tl.histogram(e, E_PAD), 0)
    starts = tl.cumsum(counts, 0) - counts
    earlier = tl.histogram(tl.where(idx < c * CHUNK, e, E), E_PAD)
    tl.store(places_ptr + c * E_PAD + experts, starts + earlier)
    tl.debug_barrier()  # this program's places, written above, read below by other threads
    i = c * CHUNK + tl.arange(0, CHUNK)
    mine = tl.load(ids_ptr + i, mask=i < P, other=E).to(tl.int32)
    ahead = tl.sum(((mine[None, :] == mine[:, None]) & (i[None, :] < i[:, None])).to(tl.int32), 1)
    place = tl.load(places_ptr + c * E_PAD + mine, mask=i < P, other=0) + ahead
    tl.store(order_ptr + place, i.to(tl.int64), mask=i < P)
    tl.store(where_ptr + i, place.to(tl.int64), mask=i < P)
    if c == 0:
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        block_starts = tl.cumsum(blocks, 0) - blocks
        last = experts == E - 1
        last_start = tl.sum(tl.where(last, starts, 0), 0)
        last_block_start = tl.sum(tl.where(last, block_starts, 0), 0)
        j = tl.arange(0, NB_PAD)
        tl.store(expert_ptr + j, tl.full([NB_PAD], E - 1, tl.int32), mask=j < NB)
        tl.store(first_ptr + j, last_start + (j - last_block_start) * BLOCK_M, mask=j < NB)
        tl.store(rows_ptr + j, tl.zeros([NB_PAD], tl.int32), mask=j < NB)
        tl.debug_barrier()  # the blocks' own values below land after those
        for b in range(0, tl.max(blocks, 0)):
            has = b < blocks
            tl.store(expert_ptr + block_starts + b, experts, mask=has)
            tl.store(first_ptr + block_starts + b, starts + b * BLOCK_M, mask=has)
            tl.store(rows_ptr + block_starts + b, tl.minimum(counts - b * BLOCK_M, BLOCK_M), mask=has)


def torch_expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """expert_blocks in torch ops (its twin)."""
    pairs = ids.numel()
    order, _, ends = sort_by_expert(ids, num_experts)
    counts = ends.diff(prepend=ends.new_zeros(1))
    blocks = (counts + block_m - 1) // block_m
    block_ends = blocks.cumsum(0)
    index = torch.arange(min(num_experts, pairs) + pairs // block_m, device=ids.device)
    found = torch.searchsorted(block_ends, index, right=True)  # the block's expert; num_experts past the last block
    expert = found.clamp(max=num_experts - 1)
    first = ends[expert] - counts[expert] + (index - (block_ends[expert] - blocks[expert])) * block_m
    rows = torch.where(found < num_experts, (ends[expert] - first).clamp(0, block_m), 0)
    where = rows_of_pairs(order)
    return order, expert.to(torch.int32), first.to(torch.int32), rows.to(torch.int32), where


@triton.jit
def _block_rows(order_ptr, expert_ptr, first_ptr, rows_ptr, blk, K_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """A block's expert (int64), its rows' positions in sorted order, their mask and their tokens."""
    expert = tl.load(expert_ptr + blk).to(tl.int64)
    sorted_rows = tl.load(first_ptr + blk) + tl.arange(0, BLOCK_M)
    mask = tl.arange(0, BLOCK_M) < tl.load(rows_ptr + blk)
    token = tl.load(order_ptr + sorted_rows, mask=mask, other=0) // K_SLOTS
    return expert, sorted_rows.to(tl.int64), mask, token


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, order_ptr, expert_ptr, first_ptr, rows_ptr, act_ptr, K_SLOTS: tl.constexpr,
                    D: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """act[row, cols] = silu(x W1^T) * (x W3^T) for one block's rows (sorted order) and BLOCK_N intermediate columns."""
    pdl_enter(PDL)
    blk, pid_n = tl.program_id(0), tl.program_id(1)
    if tl.load(rows_ptr + blk) > 0:
        expert, sorted_rows, mr, token = _block_rows(order_ptr, expert_ptr, first_ptr, rows_ptr, blk, K_SLOTS, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = cols < I
        gate_rows = w13_ptr + expert * (2 * I * D) + cols[:, None].to(tl.int64) * D
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mk = ks < D
            x = tl.load(x_ptr + token[:, None].to(tl.int64) * D + ks[None, :], mask=mr[:, None] & mk[None, :],
                        other=0.0)
            gate = tl.load(gate_rows + ks[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            up = tl.load(gate_rows + I * D + ks[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            if IEEE:
                acc_gate = tl.dot(x, tl.trans(gate), acc_gate, input_precision="ieee")
                acc_up = tl.dot(x, tl.trans(up), acc_up, input_precision="ieee")
            else:
                acc_gate = tl.dot(x, tl.trans(gate), acc_gate)
                acc_up = tl.dot(x, tl.trans(up), acc_up)
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(act_ptr + sorted_rows[:, None] * I + cols[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=mr[:, None] & mn[None, :])


@triton.jit
def _down_kernel(act_ptr, w2_ptr, order_ptr, expert_ptr, first_ptr, rows_ptr, y_ptr, K_SLOTS: tl.constexpr,
                 D: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """y[row, cols] = act[row] W2^T for one block's rows (sorted order) and BLOCK_N output columns, float32."""
    pdl_enter(PDL)
    blk, pid_n = tl.program_id(0), tl.program_id(1)
    if tl.load(rows_ptr + blk) > 0:
        expert, sorted_rows, mr, _ = _block_rows(order_ptr, expert_ptr, first_ptr, rows_ptr, blk, K_SLOTS, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mn = cols < D
        w_rows = w2_ptr + expert * (D * I) + cols[:, None].to(tl.int64) * I
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mk = ks < I
            a = tl.load(act_ptr + sorted_rows[:, None] * I + ks[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        tl.store(y_ptr + sorted_rows[:, None] * D + cols[None, :], acc, mask=mr[:, None] & mn[None, :])


def block_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  gate_up_tile: tuple[int, int] = GATE_UP_TILE, down_tile: tuple[int, int] = DOWN_TILE,
                  num_warps: int = 4, num_stages: int = NUM_STAGES, pdl: bool = True) -> torch.Tensor:
    """Same contract as fused_experts: x [T, D], w13 [E, 2I, D], w2 [E, D, I], weights [T, k] float32, ids [T, k] ->
    [T, D] in x's dtype. The intermediate activations are rounded to x's dtype once (the products' inputs), the
    expert outputs kept in float32 until the weighted sum. The tiles (output columns, reduction columns a step),
    warps and stages are launch knobs that kernels_bench sweeps."""
    T, k = ids.shape
    E, D, I = w13.shape[0], x.shape[1], w2.shape[2]
    order, expert, first, rows, where = expert_blocks(ids, E)
    act = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    y = torch.empty(T * k, D, dtype=torch.float32, device=x.device)
    blocks, ieee, launch = rows.numel(), x.dtype == torch.float32, pdl_args(x.device, pdl)
    if not blocks:  # no tokens
        return torch.zeros_like(x)
    tables = (order, expert, first, rows)
    _gate_up_kernel[(blocks, triton.cdiv(I, gate_up_tile[0]))](
        x.contiguous(), w13.contiguous(), *tables, act, K_SLOTS=k, D=D, I=I, BLOCK_M=BLOCK_M,
        BLOCK_N=gate_up_tile[0], BLOCK_K=gate_up_tile[1], IEEE=ieee, num_warps=num_warps, num_stages=num_stages,
        **launch)
    _down_kernel[(blocks, triton.cdiv(D, down_tile[0]))](
        act, w2.contiguous(), *tables, y, K_SLOTS=k, D=D, I=I, BLOCK_M=BLOCK_M, BLOCK_N=down_tile[0],
        BLOCK_K=down_tile[1], IEEE=ieee, num_warps=num_warps, num_stages=num_stages, **launch)
    return weighted_sum(y, order, weights, x.dtype, where)
