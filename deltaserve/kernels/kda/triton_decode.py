"""A KDA decode step on the GPU as one Triton kernel, from the raw projections to the gated norm: the short conv
(reading and shifting the request's conv-state slot) and SiLU, l2norm of q and k, the gate, beta, the delta rule on
the request's pooled state (updated in place), and the gated RMSNorm of the output. One launch per layer; the
decode step is bound by launches (it was three: conv, delta rule, gated norm).

One program per (head, sequence): it owns the head's q, k and v channels (so the conv state it shifts is its own)
and holds the head's whole [K, V] state as one tile, so it has the head's whole output row to normalise. A first version
swept the state in four tiles of 32 columns one after the other and took 11.8 us a layer on an H200 at batch 1
(32 programs), against 7.1 us for the three kernels it replaced. 16 warps: ptxas reports 128 registers and 72 B
of spills a thread for the 48B model's 128 x 128 tile (255 and 92 B at 8 warps); the state is read after the conv,
since reading it first kept the tile live through the conv (156 B of spills at 8 warps).

Twin: kernels.kda.kda_decode_step's torch path (causal_conv1d_update, the delta rule, rounding, gated_rms_norm),
tested against it.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_silu(x_row, w_ptr, state_row, ch, mask, W: tl.constexpr, BW: tl.constexpr):
    """silu(causal conv) of channels ch for one token, rounded to x's dtype as the conv's output is; shifts the
    channels' conv state (the last W-1 inputs; BW: W-1 rounded up to a power of two) by one, in place. A channel
    may live in several threads (a layout's replicas): all of them read the old state before any writes the new."""
    x = tl.load(x_row + ch, mask=mask, other=0.0)
    taps = tl.arange(0, BW)
    state = state_row + ch[:, None] * (W - 1) + taps[None, :]
    old = mask[:, None] & (taps[None, :] < W - 1)
    s = tl.load(state, mask=old, other=0.0)  # [C, BW]
    w = tl.load(w_ptr + ch[:, None] * W + taps[None, :], mask=old, other=0.0).to(tl.float32)
    acc = tl.sum(s.to(tl.float32) * w, axis=1)
    acc += x.to(tl.float32) * tl.load(w_ptr + ch * W + (W - 1), mask=mask, other=0.0).to(tl.float32)
    shifted = tl.load(state + 1, mask=mask[:, None] & (taps[None, :] < W - 2), other=0.0)
    new = tl.where(taps[None, :] == W - 2, x.to(state_row.dtype.element_ty)[:, None], shifted)
    tl.debug_barrier()
    tl.store(state, new, mask=old)
    return (acc * tl.sigmoid(acc)).to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _kda_decode_step_kernel(
    x_ptr, conv_w_ptr, conv_state_ptr, graw_ptr, braw_ptr, gate_ptr, dt_bias_ptr, a_log_ptr, norm_w_ptr,
    state_ptr, slots_ptr, o_ptr, x_stride, g_stride, b_stride, gate_stride, scale, eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BW: tl.constexpr,
):
    """BK, BV: K and V rounded up to powers of two (tl.arange needs them; the demo model's heads are 48 wide),
    lanes past them masked to zero. The head's whole [K, V] state is one tile, so its output row is whole for the
    norm."""
    i_h, i_b = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    row = i_b.to(tl.int64)
    x_row = x_ptr + row * x_stride
    conv_row = conv_state_ptr + slot * (2 * H * K + H * V) * (W - 1)
    offs_k, offs_v = tl.arange(0, BK), tl.arange(0, BV)
    mk, mv = offs_k < K, offs_v < V
    s_ptrs = state_ptr + ((slot * H + i_h) * K + offs_k[:, None]) * V + offs_v[None, :]
    s_mask = mk[:, None] & mv[None, :]
    q = _conv_silu(x_row, conv_w_ptr, conv_row, i_h * K + offs_k, mk, W, BW)
    k = _conv_silu(x_row, conv_w_ptr, conv_row, H * K + i_h * K + offs_k, mk, W, BW)
    v = _conv_silu(x_row, conv_w_ptr, conv_row, 2 * H * K + i_h * V + offs_v, mv, W, BW)
    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    g = tl.load(graw_ptr + row * g_stride + i_h * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    g = g + tl.load(dt_bias_ptr + i_h * K + offs_k, mask=mk, other=0.0)
    softplus = tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(g)))
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + i_h)) * softplus)  # [BK]
    beta = tl.sigmoid(tl.load(braw_ptr + row * b_stride + i_h).to(tl.float32))
    S = tl.load(s_ptrs, mask=s_mask, other=0.0) * decay[:, None]  # [BK, BV]
    # both reductions read the decayed state, so it is the one [K, V] tile live: o = (S + k delta^T)^T q
    # = S^T q + (k . q) delta
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
    o = tl.sum(S * q[:, None], axis=0) + tl.sum(k * q) * delta
    tl.store(s_ptrs, S + k[:, None] * delta[None, :], mask=s_mask)
    o = o.to(o_ptr.dtype.element_ty).to(tl.float32)  # the reference rounds its kernel's output here
    rstd = 1.0 / tl.sqrt(tl.sum(o * o) / V + eps)
    y = tl.load(norm_w_ptr + offs_v, mask=mv, other=0.0).to(tl.float32) * (o * rstd)
    gate = tl.load(gate_ptr + row * gate_stride + i_h * V + offs_v, mask=mv, other=0.0).to(tl.float32)
    tl.store(o_ptr + (row * H + i_h) * V + offs_v, (y * tl.sigmoid(gate)).to(o_ptr.dtype.element_ty), mask=mv)


def kda_decode_step(qkv, conv_weight, conv_state, g_raw, b_raw, gate, dt_bias, a_log, norm_weight, eps: float,
                    state, state_slots, scale: float) -> torch.Tensor:
    """kernels.kda.kda_decode_step's contract, on the GPU: qkv [B, 2HK + HV] raw (before the conv; rows may be
    strided), conv_weight [2HK + HV, W], conv_state [S, 2HK + HV, W-1] and state [S, H, K, V] float32 updated in
    place at state_slots [B]; g_raw, gate [B, HK], b_raw [B, H] (rows may be strided) -> [B, H*V] in qkv's dtype."""
    B = qkv.shape[0]
    _, H, K, V = state.shape
    W = conv_weight.shape[1]
    assert qkv.stride(1) == g_raw.stride(1) == gate.stride(1) == 1 and qkv.shape[1] == 2 * H * K + H * V
    assert conv_state.is_contiguous() and state.is_contiguous() and conv_weight.is_contiguous()
    o = torch.empty(B, H * V, dtype=qkv.dtype, device=qkv.device)
    _kda_decode_step_kernel[(H, B)](
        qkv, conv_weight, conv_state, g_raw, b_raw, gate, dt_bias, a_log, norm_weight, state, state_slots, o,
        qkv.stride(0), g_raw.stride(0), b_raw.stride(0), gate.stride(0), scale, eps,
        H=H, K=K, V=V, W=W, BK=triton.next_power_of_2(K), BV=triton.next_power_of_2(V),
        BW=triton.next_power_of_2(W - 1), num_warps=16,
    )
    return o
