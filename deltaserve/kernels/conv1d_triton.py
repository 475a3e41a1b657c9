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
def _conv_varlen_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, cu_ptr, tiles_ptr, y_ptr, x_stride, y_group_stride,
                        C: tl.constexpr, W: tl.constexpr, GROUP_C: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr, INTERIOR: tl.constexpr):
    """y[t] = silu(sum_j w[:, j] * input[t - (W-1) + j]) for a tile of one sequence's tokens (tiles_ptr: its
    sequence and first token), the inputs before the sequence's first token read from its state slot (which this
    kernel leaves as it was). Channel ch is stored in group ch // GROUP_C, each group a contiguous [N, GROUP_C] at
    y_group_stride elements from the one before (GROUP_C = C: one group, y [N, C]). INTERIOR: a tile whose taps all
    lie inside its sequence (all but a sequence's first) reads x alone, with no state addresses or masks."""
    pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    seq, first = tl.load(tiles_ptr + 2 * pid_t), tl.load(tiles_ptr + 2 * pid_t + 1)
    start, end = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
    t = start + first + tl.arange(0, BLOCK_T)
    ch = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    rows, cols = (t < end)[:, None], (ch < C)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if INTERIOR and first >= W - 1:
        for j in tl.static_range(W):
            src = t - (W - 1) + j
            value = tl.load(x_ptr + src[:, None].to(tl.int64) * x_stride + ch[None, :], mask=rows & cols,
                            other=0.0).to(tl.float32)
            acc += value * tl.load(w_ptr + ch * W + j, mask=ch < C, other=0.0).to(tl.float32)[None, :]
    else:
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        for j in tl.static_range(W):
            src = t - (W - 1) + j  # the input this tap reads: in the sequence, or the state's entry (W-1) + (src-start)
            inside = (src >= start)[:, None]
            value = tl.load(x_ptr + src[:, None].to(tl.int64) * x_stride + ch[None, :], mask=rows & cols & inside,
                            other=0.0).to(tl.float32)
            value += tl.load(state_ptr + (slot * C + ch[None, :]) * (W - 1) + (W - 1 + src - start)[:, None],
                             mask=rows & cols & ~inside, other=0.0).to(tl.float32)
            acc += value * tl.load(w_ptr + ch * W + j, mask=ch < C, other=0.0).to(tl.float32)[None, :]
    if GROUP_C % BLOCK_C == 0:  # the program's channels lie in one group: its offset a scalar, the store contiguous
        group = (pid_c * BLOCK_C) // GROUP_C
        out = group.to(tl.int64) * y_group_stride + t[:, None].to(tl.int64) * GROUP_C + (ch - group * GROUP_C)[None, :]
    else:
        out = (ch // GROUP_C).to(tl.int64)[None, :] * y_group_stride + t[:, None].to(tl.int64) * GROUP_C \
            + (ch % GROUP_C)[None, :]
    tl.store(y_ptr + out, acc * tl.sigmoid(acc), mask=rows & cols)


# unspecialised: a prefill's ends (cu_seqlens[1:]) and a snapshot's cuts differ in alignment; one variant serves both
@triton.jit(do_not_specialize=["starts_ptr", "ends_ptr"])
def _conv_state_kernel(x_ptr, state_ptr, slots_ptr, out_ptr, out_slots_ptr, starts_ptr, ends_ptr, x_stride,
                       C: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    """The state a sequence reaches after its inputs x[start:end], continuing state slot slots[seq]: its last W-1
    inputs, those before its first from that state; written to out's slot out_slots[seq] (the same slot of the
    same tensor after a prefill; a snapshot slot for prefix caching's saves partway). The whole [BLOCK_C, W-1] tile
    is loaded before any of it is stored (a barrier between), since a sequence shorter than W-1 keeps part of the
    old state."""
    pid_c, seq = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(starts_ptr + seq), tl.load(ends_ptr + seq)
    slot, out_slot = tl.load(slots_ptr + seq).to(tl.int64), tl.load(out_slots_ptr + seq).to(tl.int64)
    ch = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, BLOCK_W)
    src = end - (W - 1) + j  # the input that becomes entry j
    inside = (src >= start)[None, :]
    mask = (ch < C)[:, None] & (j < W - 1)[None, :]
    values = tl.load(x_ptr + src[None, :].to(tl.int64) * x_stride + ch[:, None], mask=mask & inside, other=0.0)
    values += tl.load(state_ptr + (slot * C + ch[:, None]) * (W - 1) + (W - 1 + src - start)[None, :],
                      mask=mask & ~inside, other=0.0)
    tl.debug_barrier()
    tl.store(out_ptr + (out_slot * C + ch[:, None]) * (W - 1) + j[None, :], values.to(out_ptr.dtype.element_ty),
             mask=mask)


_VARLEN_BLOCK_C = 128


def conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, packed: PackedSeqs,
                  groups: int = 1, interior: bool = True, *, block_c: int = _VARLEN_BLOCK_C,
                  num_warps: int = 4) -> torch.Tensor:
    """Packed sequences: x [N, C] (rows may be strided), weight [C, W], conv_state [S, C, W-1] in place, packed: the
    sequences' state slots, offsets and token tiles on x's device -> silu(conv) in x's dtype: [N, C], or with groups
    > 1 [N, groups, C / groups], each group's [N, C / groups] contiguous (stored group by group). Two launches: the
    conv (reading the old states), then the states. Twin: kernels.conv1d.causal_conv1d_varlen's torch path.
    interior False: every tile through the general path; block_c (channels a program, a power of two) and num_warps:
    the launch (kernels_bench's comparisons)."""
    N, C = x.shape
    W, B = weight.shape[1], packed.state_slots.shape[0]
    _check(x, conv_state)
    assert weight.is_contiguous() and weight.shape == (C, conv_state.shape[2] + 1), \
        f"weight {tuple(weight.shape)} does not fit conv state {tuple(conv_state.shape)}"
    assert C % groups == 0, f"{C} channels do not split into {groups} groups"
    assert int(packed.cu_seqlens_cpu[-1]) == N and packed.cu_seqlens.shape[0] == B + 1, "cu_seqlens must cover x"
    G = C // groups
    y = torch.empty(groups, N, G, dtype=x.dtype, device=x.device)
    if N:
        grid = (packed.token_tiles.shape[0], triton.cdiv(C, block_c))
        _conv_varlen_kernel[grid](x, weight, conv_state, packed.state_slots, packed.cu_seqlens, packed.token_tiles,
                                  y, x.stride(0), N * G, C=C, W=W, GROUP_C=G, BLOCK_T=TOKEN_TILE,
                                  BLOCK_C=block_c, INTERIOR=interior, num_warps=num_warps)
        _states(x, conv_state, packed.state_slots, conv_state, packed.state_slots, packed.cu_seqlens[:-1],
                packed.cu_seqlens[1:])
    return y[0] if groups == 1 else y.transpose(0, 1)


def conv1d_states_at(x: torch.Tensor, conv_state: torch.Tensor, snapshots: torch.Tensor, state_slots: torch.Tensor,
                     snapshot_slots: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> None:
    """kernels.conv1d.conv_states_at on the GPU, one launch (its torch path is the twin)."""
    _check(x, conv_state, snapshots)
    if state_slots.numel():
        _states(x, conv_state, state_slots, snapshots, snapshot_slots, starts, ends)


def _check(x: torch.Tensor, *states: torch.Tensor) -> None:
    """x [N, C] of unit column stride; each state tensor contiguous [S, C, W-1] of one W."""
    assert x.stride(1) == 1 and all(s.is_contiguous() for s in states), "contiguous rows expected"
    assert all(s.shape[1:] == states[0].shape[1:] and s.shape[1] == x.shape[1] for s in states), \
        f"conv states {[tuple(s.shape) for s in states]} do not fit {x.shape[1]} channels"


def _states(x, state, slots, out, out_slots, starts, ends) -> None:
    """_conv_state_kernel over len(slots) sequences."""
    C, W = state.shape[1], state.shape[2] + 1
    _conv_state_kernel[(triton.cdiv(C, 256), slots.shape[0])](
        x, state, slots, out, out_slots, starts, ends, x.stride(0), C=C, W=W,
        BLOCK_W=triton.next_power_of_2(W - 1), BLOCK_C=256, num_warps=4)
