"""The short conv's decode step as one Triton kernel: read the state slot, convolve, SiLU, shift the state.
Twin: kernels.conv1d.causal_conv1d_update (six torch ops)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, y_ptr, x_stride, C: tl.constexpr, W: tl.constexpr,
                        BLOCK_C: tl.constexpr):
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


def conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, state_slots: torch.Tensor):
    """x [B, C] (rows may be strided), weight [C, W], conv_state [S, C, W-1] in place -> silu(conv) [B, C]."""
    B, C = x.shape
    W = weight.shape[1]
    y = torch.empty(B, C, dtype=x.dtype, device=x.device)
    _conv_update_kernel[(triton.cdiv(C, 256), B)](x, weight, conv_state, state_slots, y, x.stride(0), C=C, W=W,
                                                   BLOCK_C=256, num_warps=4)
    return y
