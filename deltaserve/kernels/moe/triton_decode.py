"""Routed experts (and the shared expert) for a few tokens on the GPU: one GEMV kernel per projection reading only
the chosen experts.

Three launches where fused_experts' grouped GEMM spends ~20 on sorting and gathering: (1) per (token, slot) pair,
silu(x W1^T) * (x W3^T); (2) per pair, the weighted down projection; (3) the sum of each token's slots, in x's
dtype. The shared expert (same intermediate size) is one more slot per token, weight 1. Each pair reads its
expert's weights, so this pays off only while pairs rarely share an expert (small T): the caller picks. FP8
weights with block scales (SCALED) are scaled per element, or once per tile inside one scale block (ALIGNED).

Tiles are autotuned per (D, I, pairs rounded up to a power of two) at first use; a CUDA graph's sizes are each
run eagerly before capture. Twin: kernels.moe.naive.naive_experts (FP8: on dequantized weights) plus the shared
expert's SwiGLU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.autotune import tile_configs, with_tile
from deltaserve.kernels.pdl import pdl_args, pdl_enter

# (rows, columns) of a program's tile, autotuned over these candidates (which trade rows, so programs, for columns, so
# bytes in flight per load): no one fixed tile streams both the gate/up and the down weights near the bandwidth.
_GATE_UP_TILES = ((4, 512), (8, 256), (8, 512), (16, 128), (16, 256), (32, 128))
_DOWN_TILES = ((8, 512), (16, 256), (16, 512), (32, 128), (32, 256), (64, 128))


_GATE_UP_NAMES, _DOWN_NAMES = ("BLOCK_I", "BLOCK_D"), ("BLOCK_N", "BLOCK_K")
_SUM_BLOCK_D = 512  # the slots' sum: columns a program (D = 2304: 5 programs a token)


@triton.autotune(configs=tile_configs(_GATE_UP_NAMES, _GATE_UP_TILES, _GATE_UP_TILES[3], warps=(4, 8)),
                 key=["D", "I", "PAIRS_BUCKET", "SCALED"])
@triton.heuristics({"ALIGNED": lambda a: a["BN"] % a["BLOCK_I"] == 0 and a["BK"] % a["BLOCK_D"] == 0
                    and a["I"] % a["BN"] == 0})
@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, s13_ptr, shared13_ptr, shared_s13_ptr, ids_ptr, act_ptr, PAIRS_BUCKET,
                    K_SLOTS: tl.constexpr, SLOTS: tl.constexpr, D: tl.constexpr, I: tl.constexpr, SCALED: tl.constexpr,
                    S_ROWS: tl.constexpr, S_COLS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    ALIGNED: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid_i, pair = tl.program_id(0), tl.program_id(1)
    token, slot = pair // SLOTS, pair % SLOTS
    expert = tl.load(ids_ptr + token * K_SLOTS + tl.minimum(slot, K_SLOTS - 1)).to(tl.int64)
    base, s_base = w13_ptr + expert * (2 * I * D), s13_ptr + expert * (S_ROWS * S_COLS)
    if SLOTS > K_SLOTS:  # the last slot is the shared expert
        if slot == K_SLOTS:
            base, s_base = shared13_ptr, shared_s13_ptr
    rows = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
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


@triton.autotune(configs=tile_configs(_DOWN_NAMES, _DOWN_TILES, _DOWN_TILES[3], warps=(4, 8)),
                 key=["D", "I", "PAIRS_BUCKET", "SCALED"])
@triton.heuristics({"ALIGNED": lambda a: a["BN"] % a["BLOCK_N"] == 0 and a["BK"] % a["BLOCK_K"] == 0})
@triton.jit
def _down_kernel(act_ptr, w2_ptr, s2_ptr, shared2_ptr, shared_s2_ptr, ids_ptr, weights_ptr, y_ptr, PAIRS_BUCKET,
                 K_SLOTS: tl.constexpr, SLOTS: tl.constexpr, D: tl.constexpr, I: tl.constexpr, SCALED: tl.constexpr,
                 S_ROWS: tl.constexpr, S_COLS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 ALIGNED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid_n, pair = tl.program_id(0), tl.program_id(1)
    token, slot = pair // SLOTS, pair % SLOTS
    routed = token * K_SLOTS + tl.minimum(slot, K_SLOTS - 1)
    expert = tl.load(ids_ptr + routed).to(tl.int64)
    weight = tl.load(weights_ptr + routed)
    base, s_base = w2_ptr + expert * (D * I), s2_ptr + expert * (S_ROWS * S_COLS)
    if SLOTS > K_SLOTS:  # the shared expert: weight 1
        weight = tl.where(slot == K_SLOTS, 1.0, weight)
        if slot == K_SLOTS:
            base, s_base = shared2_ptr, shared_s2_ptr
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + pair * I + cols, mask=cols < I, other=0.0)
        mask = (rows[:, None] < D) & (cols[None, :] < I)
        w = tl.load(base + rows[:, None] * I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            if ALIGNED:
                w *= tl.load(s_base + (pid_n * BLOCK_N // BN) * S_COLS + k0 // BK)
            else:
                w *= tl.load(s_base + (rows[:, None] // BN) * S_COLS + cols[None, :] // BK, mask=mask, other=0.0)
        acc += tl.sum(w * a[None, :], axis=1)
    tl.store(y_ptr + pair * D + rows, acc * weight, mask=rows < D)


def _shared_slot(shared, w13, w2, s13, s2, scaled: bool) -> tuple[torch.Tensor, ...]:
    """The shared expert's (gate_up, down, gate_up scales, down scales) as the kernels take them, checked against
    one routed expert; without a shared expert, stand-ins that are never read."""
    if shared is None:
        return w13, w2, s13, s2
    assert len(shared) == (4 if scaled else 2), "a shared expert has block scales exactly when the experts do"
    weights = shared[0].contiguous(), shared[1].contiguous()
    scales = (shared[2].float().contiguous(), shared[3].float().contiguous()) if scaled else ()
    for got, routed in zip(weights + scales, (w13, w2, s13, s2)):
        assert got.shape == routed.shape[1:] and got.dtype == routed.dtype, \
            f"the shared expert's {tuple(got.shape)} {got.dtype} does not match a routed expert's {routed.shape[1:]}"
    return (*weights, *(scales or (s13, s2)))


@triton.jit
def _sum_slots_kernel(y_ptr, out_ptr, SLOTS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out[t, cols] = y[t, 0, cols] + ... + y[t, SLOTS - 1, cols] in float32 (the order of y.sum(1)), in out's dtype."""
    pdl_enter(PDL)
    token, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for slot in tl.static_range(SLOTS):
        acc += tl.load(y_ptr + (token * SLOTS + slot) * D + cols, mask=cols < D, other=0.0)
    tl.store(out_ptr + token * D + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < D)


def _sum_slots(y: torch.Tensor, dtype: torch.dtype, pdl: bool = True) -> torch.Tensor:
    """[T, slots, D] float32 (contiguous) -> [T, D] in dtype: one launch. Twin: y.sum(1).to(dtype)."""
    T, slots, D = y.shape
    out = torch.empty(T, D, dtype=dtype, device=y.device)
    if T:
        _sum_slots_kernel[(T, triton.cdiv(D, _SUM_BLOCK_D))](y, out, SLOTS=slots, D=D, BLOCK_D=_SUM_BLOCK_D,
                                                              num_warps=4, **pdl_args(y.device, pdl))
    return out


def decode_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   w13_scale_inv: torch.Tensor | None = None, w2_scale_inv: torch.Tensor | None = None,
                   block: tuple[int, int] | None = None,
                   shared: tuple[torch.Tensor, ...] | None = None,
                   tiles: tuple[tuple[int, int], tuple[int, int]] | None = None, pdl: bool = True) -> torch.Tensor:
    """Same contract as fused_experts: x [T, D], w13 [E, 2I, D], w2 [E, D, I], weights [T, k] f32, ids [T, k] ->
    [T, D] in x's dtype. With block scales (FP8 weights: float8_e4m3fn w13 and w2, scales [E, nb, kb], `block`
    (bn, bk)), the weights are multiplied by their scales as they are read: kernels.quant.experts'
    fp8_fused_experts contract. shared: a shared expert's (gate_up [2I, D], down [D, I]) in w13's dtype, and with
    block scales their (gate_up_scale_inv, down_scale_inv) shaped as one expert's; added with weight 1 (its
    contribution summed in float32 with the routed ones). tiles: ((BLOCK_I, BLOCK_D), (BLOCK_N, BLOCK_K)) instead of
    the autotuned choice (tests check every candidate's values; benchmarks time them)."""
    T, k = ids.shape
    D, I = x.shape[1], w2.shape[2]
    scaled = w13_scale_inv is not None
    if scaled:
        s13, s2 = w13_scale_inv.float().contiguous(), w2_scale_inv.float().contiguous()
        bn, bk = block
    else:  # the scale arguments are never read
        s13, s2, bn, bk = w13, w2, 1, 1
    shared13, shared2, shared_s13, shared_s2 = _shared_slot(shared, w13, w2, s13, s2, scaled)
    slots = k + (shared is not None)
    pairs = T * slots
    ids, weights = ids.contiguous(), weights.float().contiguous()
    bucket = triton.next_power_of_2(pairs)
    gate_up, gate_up_tile = with_tile(_gate_up_kernel, _GATE_UP_NAMES, None if tiles is None else tiles[0])
    down, down_tile = with_tile(_down_kernel, _DOWN_NAMES, None if tiles is None else tiles[1])
    act = torch.empty(pairs, I, dtype=torch.float32, device=x.device)
    gate_up[lambda meta: (triton.cdiv(I, meta["BLOCK_I"]), pairs)](
        x.contiguous(), w13.contiguous(), s13, shared13, shared_s13, ids, act, bucket, K_SLOTS=k, SLOTS=slots, D=D, I=I,
        SCALED=scaled, S_ROWS=s13.shape[1], S_COLS=s13.shape[2], BN=bn, BK=bk, **pdl_args(x.device, pdl),
        **gate_up_tile)
    y = torch.empty(T, slots, D, dtype=torch.float32, device=x.device)
    down[lambda meta: (triton.cdiv(D, meta["BLOCK_N"]), pairs)](
        act, w2.contiguous(), s2, shared2, shared_s2, ids, weights, y, bucket, K_SLOTS=k, SLOTS=slots, D=D, I=I,
        SCALED=scaled, S_ROWS=s2.shape[1], S_COLS=s2.shape[2], BN=bn, BK=bk, **pdl_args(x.device, pdl), **down_tile)
    return _sum_slots(y, x.dtype, pdl)
