"""One fused Triton kernel for KDA's recurrence on the GPU: l2norm of q and k, the gate, beta, and the delta rule on
each sequence's pooled state, updated in place. A decode step is one launch per layer instead of ~15; a short
prefill (kda_recurrent_varlen) walks each sequence's tokens in one launch.

Twin: l2norm + kda_gate + sigmoid + fused_recurrent_kda (the torch path), tested against it."""

import torch
import triton
import triton.language as tl

from deltaserve.forward_batch import PackedSeqs
from deltaserve.kernels.pdl import pdl_args, pdl_enter


@triton.jit
def _kda_token(S, q_ptr, k_ptr, v_ptr, graw_ptr, braw_ptr, o_ptr, row, dt_bias, neg_a, offs_k, offs_v, mk, mv,
               qkv_stride, g_stride, b_stride, scale, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """One token of one sequence and head: S [BK, BV] (its state tile) decayed and updated by the delta rule, the
    token's output tile stored; returns the new S."""
    i_h = tl.program_id(1)
    q = tl.load(q_ptr + row * qkv_stride + i_h * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * qkv_stride + i_h * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * qkv_stride + i_h * V + offs_v, mask=mv, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    g = tl.load(graw_ptr + row * g_stride + i_h * K + offs_k, mask=mk, other=0.0).to(tl.float32) + dt_bias
    softplus = tl.where(g > 20.0, g, tl.log(1.0 + tl.exp(g)))
    decay = tl.exp(neg_a * softplus)  # [K]
    beta = tl.sigmoid(tl.load(braw_ptr + row * b_stride + i_h).to(tl.float32))
    S = S * decay[:, None]
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(o_ptr + (row * H + i_h) * V + offs_v, o.to(o_ptr.dtype.element_ty), mask=mv)
    return S


@triton.jit
def _kda_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, graw_ptr, braw_ptr, dt_bias_ptr, a_log_ptr, state_ptr, slots_ptr, cu_ptr, o_ptr,
    qkv_stride, g_stride, b_stride, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (V tile, head, sequence). VARLEN: the sequence's tokens are rows cu[b] to cu[b+1], walked in order
    with the state tile held in registers; else (a decode step) the sequence is the one row b. BK: K rounded up to a
    power of two (tl.arange needs one; the demo model's heads are 48 wide), lanes past K masked to zero; likewise
    lanes past V in the last BV tile. PDL: kernels.pdl."""
    pdl_enter(PDL)
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + i_b).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mk, mv = offs_k < K, offs_v < V
    dt_bias = tl.load(dt_bias_ptr + i_h * K + offs_k, mask=mk, other=0.0)
    neg_a = -tl.exp(tl.load(a_log_ptr + i_h))
    s_ptrs = state_ptr + ((slot * H + i_h) * K + offs_k[:, None]) * V + offs_v[None, :]
    s_mask = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=s_mask, other=0.0)  # [BK, BV]
    if VARLEN:
        for row in range(tl.load(cu_ptr + i_b).to(tl.int64), tl.load(cu_ptr + i_b + 1).to(tl.int64)):
            S = _kda_token(S, q_ptr, k_ptr, v_ptr, graw_ptr, braw_ptr, o_ptr, row, dt_bias, neg_a, offs_k, offs_v,
                           mk, mv, qkv_stride, g_stride, b_stride, scale, H, K, V)
    else:
        S = _kda_token(S, q_ptr, k_ptr, v_ptr, graw_ptr, braw_ptr, o_ptr, i_b.to(tl.int64), dt_bias, neg_a, offs_k,
                       offs_v, mk, mv, qkv_stride, g_stride, b_stride, scale, H, K, V)
    tl.store(s_ptrs, S, mask=s_mask)


def kda_decode(q, k, v, g_raw, b_raw, dt_bias, a_log, state, state_slots, scale: float,
               pdl: bool = True) -> torch.Tensor:
    """q, k, v: [B, H*K] views (after conv + SiLU, any float dtype; rows may be strided); g_raw: [B, H*K] (f_b_proj
    output, before dt_bias); b_raw: [B, H] (b_proj output, before sigmoid); dt_bias [H*K] f32; a_log [H] f32; state [S,
    H, K, V] f32 (in place); state_slots [B] int64. Returns o [B, H, V] in v's dtype: rounded in the kernel, as the
    reference's kernel rounds its output (a cast of a float32 result was a launch of its own, and torch.compile may drop
    a round-trip cast fused into the next kernel)."""
    return _launch(q, k, v, g_raw, b_raw, dt_bias, a_log, state, state_slots, None, q.shape[0], scale, pdl)


def kda_recurrent_varlen(q, k, v, g_raw, b_raw, dt_bias, a_log, state, packed: PackedSeqs, scale: float,
                         pdl: bool = True) -> torch.Tensor:
    """kda_decode for packed sequences of any length: q, k, v [N, H, K] (rows of one qkv), g_raw [N, H*K], b_raw
    [N, H]; sequence b is rows packed.cu_seqlens[b] to [b+1], starting from state[packed.state_slots[b]] and
    leaving its final state there. One launch, each program walking its sequence's tokens in order: for short
    prefills (fla-core's chunked kernel launches many kernels and works in chunks of 64 tokens)."""
    return _launch(q, k, v, g_raw, b_raw, dt_bias, a_log, state, packed.state_slots, packed.cu_seqlens,
                   len(packed.cu_seqlens_cpu) - 1, scale, pdl)


def _launch(q, k, v, g_raw, b_raw, dt_bias, a_log, state, state_slots, cu_seqlens, B: int, scale: float,
            pdl: bool) -> torch.Tensor:
    H, K, V = state.shape[1:]
    BV = min(triton.next_power_of_2(V), 32)
    o = torch.empty(q.shape[0], H, V, dtype=v.dtype, device=q.device)
    assert q.stride(2) == 1 and q.stride(1) == K and k.stride(0) == q.stride(0) == v.stride(0)  # rows of one qkv
    assert g_raw.stride(1) == 1
    _kda_recurrent_kernel[(triton.cdiv(V, BV), H, B)](
        q, k, v, g_raw, b_raw, dt_bias, a_log, state, state_slots, state_slots if cu_seqlens is None else cu_seqlens,
        o, q.stride(0), g_raw.stride(0), b_raw.stride(0), scale, H=H, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        VARLEN=cu_seqlens is not None, num_warps=4, **pdl_args(q.device, pdl),
    )
    return o
