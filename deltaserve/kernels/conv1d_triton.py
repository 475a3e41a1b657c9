"""The short conv on the GPU: the decode step as one Triton kernel (read the state slot, convolve, SiLU, shift the
state; twin: kernels.conv1d.causal_conv1d_update, six torch ops), and prefill over packed sequences as two (twin:
kernels.conv1d.causal_conv1d_varlen's torch path, which on a GPU runs a transposed copy, cuDNN's depthwise conv and
two more copies a layer)."""

import torch
import triton
import triton.language as tl

from deltaserve.forward_batch import PackedSeqs
from deltaserve.kernels.pdl import pdl_args, pdl_enter
from deltaserve.kernels.varlen import TOKEN_TILE


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, y_ptr, x_stride, C: tl.constexpr, W: tl.constexpr,
                        BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid_c, b = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    ch = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = ch < C
    x = tl.load(x_ptr + b * x_stride + ch, mask=mask, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + ch * W + (W - 1), mask=mask, other=0.0).to(tl.float32)
    state = state_ptr + (slot * C + ch) * (W - 1)
    for j in tl.static_range(W - 1):
        s = tl.load(state + j, mask=mask, other=0.0)
        acc += s.to(tl.float32) * tl.load(w_ptr + ch * W + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(state + (j - 1), s, mask=mask)
    tl.store(state + (W - 2), x.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + b * C + ch, acc * tl.sigmoid(acc), mask=mask)


def conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor,
                  pdl: bool = True):
    """x [B, C] (rows may be strided), weight [C, W], conv_state [S, C, W-1] in place -> silu(conv) [B, C]."""
    B, C = x.shape
    W = weight.shape[1]
    y = torch.empty(B, C, dtype=x.dtype, device=x.device)
    _conv_update_kernel[(triton.cdiv(C, 256), B)](x, weight, conv_state, state_slots, y, x.stride(0), C=C, W=W,
                                                   BLOCK_C=256, num_warps=4, **pdl_args(x.device, pdl))
    return y


@triton.jit
def _conv_varlen_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, cu_ptr, tiles_ptr, y_ptr, x_stride, C: tl.constexpr,
                        W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """y[t] = silu(sum_j w[:, j] * input[t - (W-1) + j]) for a tile of one sequence's tokens (tiles_ptr: its
    sequence and first token), the inputs before the sequence's first token read from its state slot (which this
    kernel leaves as it was)."""
    pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    seq, first = tl.load(tiles_ptr + 2 * pid_t), tl.load(tiles_ptr + 2 * pid_t + 1)
    start, end = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    t = start + first + tl.arange(0, BLOCK_T)
    ch = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    rows, cols = (t < end)[:, None], (ch < C)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(W):
        src = t - (W - 1) + j  # the input this tap reads: in the sequence, or the state's entry (W-1) + (src-start)
        inside = (src >= start)[:, None]
        value = tl.load(x_ptr + src[:, None].to(tl.int64) * x_stride + ch[None, :], mask=rows & cols & inside,
                        other=0.0).to(tl.float32)
        value += tl.load(state_ptr + (slot * C + ch[None, :]) * (W - 1) + (W - 1 + src - start)[:, None],
                         mask=rows & cols & ~inside, other=0.0).to(tl.float32)
        acc += value * tl.load(w_ptr + ch * W + j, mask=ch < C, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + t[:, None].to(tl.int64) * C + ch[None, :], acc * tl.sigmoid(acc), mask=rows & cols)


@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, slots_ptr, cu_ptr, x_stride, C: tl.constexpr, W: tl.constexpr,
                       BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    """A sequence's state slot after its tokens: its last W-1 inputs, those before its first token from the old
    state. The whole [BLOCK_C, W-1] tile is loaded before any of it is stored (a barrier between), since a sequence
    shorter than W-1 keeps part of the old state."""
    pid_c, seq = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    ch = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_W)
    src = end - (W - 1) + j  # the input that becomes entry j
    inside = (src >= start)[None, :]
    mask = (ch < C)[:, None] & (j < W - 1)[None, :]
    state = state_ptr + (slot * C + ch[:, None]) * (W - 1)
    values = tl.load(x_ptr + src[None, :].to(tl.int64) * x_stride + ch[:, None], mask=mask & inside, other=0.0)
    values += tl.load(state + (W - 1 + src - start)[None, :], mask=mask & ~inside, other=0.0)
    tl.debug_barrier()
    tl.store(state + j[None, :], values.to(state_ptr.dtype.element_ty), mask=mask)


_VARLEN_BLOCK_C = 128


def conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, packed: PackedSeqs) -> torch.Tensor:
    """Packed sequences: x [N, C] (rows may be strided), weight [C, W], conv_state [S, C, W-1] in place, packed: the
    sequences' state slots, offsets and token tiles on x's device -> silu(conv) [N, C] in x's dtype. Two launches:
    the conv (reading the old states), then the states. Twin: kernels.conv1d.causal_conv1d_varlen's torch path."""
    N, C = x.shape
    W, B = weight.shape[1], packed.state_slots.shape[0]
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_state.is_contiguous(), "contiguous rows expected"
    assert weight.shape[0] == C and conv_state.shape[1:] == (C, W - 1), \
        f"weight {tuple(weight.shape)} and conv state {tuple(conv_state.shape)} do not fit {C} channels"
    assert int(packed.cu_seqlens_cpu[-1]) == N and packed.cu_seqlens.shape[0] == B + 1, "cu_seqlens must cover x"
    y = torch.empty(N, C, dtype=x.dtype, device=x.device)
    if N == 0:
        return y
    grid = (packed.token_tiles.shape[0], triton.cdiv(C, _VARLEN_BLOCK_C))
    _conv_varlen_kernel[grid](x, weight, conv_state, packed.state_slots, packed.cu_seqlens, packed.token_tiles, y,
                              x.stride(0), C=C, W=W, BLOCK_T=TOKEN_TILE, BLOCK_C=_VARLEN_BLOCK_C, num_warps=4)
    _conv_state_kernel[(triton.cdiv(C, 256), B)](x, conv_state, packed.state_slots, packed.cu_seqlens, x.stride(0),
                                                  C=C, W=W, BLOCK_W=triton.next_power_of_2(W - 1), BLOCK_C=256,
                                                  num_warps=4)
    return y
