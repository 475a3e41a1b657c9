"""KDA ops by mode. Each takes the raw projections (after the short conv) and picks the fastest implementation
for the device: on the CPU the torch kernels of this package, on a GPU our fused Triton decode step and
fla-core's chunked prefill (the `gpu` extra). naive.py is the spec all of them are tested against."""

import torch

from deltaserve.kernels.conv1d import causal_conv1d_update
from deltaserve.kernels.kda.chunk import chunk_kda
from deltaserve.kernels.kda.fused_recurrent import fused_recurrent_kda
from deltaserve.kernels.kda.gate import kda_gate, l2norm
from deltaserve.kernels.norm import gated_rms_norm

__all__ = ["chunk_kda", "fused_recurrent_kda", "kda_decode", "kda_decode_step", "kda_gate", "kda_prefill", "l2norm"]


def kda_decode_step(qkv, conv_weight, conv_state, g_raw, b_raw, gate, dt_bias, a_log, norm_weight, eps: float,
                    state, state_slots: torch.Tensor, scale: float) -> torch.Tensor:
    """One token per sequence, from the raw projections to the gated norm (o_proj's input).

    qkv [B, 2HK + HV]: in_proj's q, k, v before the short conv; conv_weight [2HK + HV, W]; conv_state
    [S, 2HK + HV, W-1] and state [S, H, K, V] float32, both updated in place at state_slots [B]; g_raw [B, HK]
    (f_b_proj output), b_raw [B, H] (before sigmoid), gate [B, HV] (g_b_proj output); norm_weight [V].
    Returns gated_rms_norm(o) [B, H*V] in qkv's dtype, o rounded to that dtype first as the reference rounds its
    kernel's output. On a GPU one Triton kernel (triton_decode.py); this torch path is its twin."""
    if qkv.is_cuda:
        from deltaserve.kernels.kda.triton_decode import kda_decode_step as triton_kda_decode_step

        return triton_kda_decode_step(qkv, conv_weight, conv_state, g_raw, b_raw, gate, dt_bias, a_log, norm_weight,
                                      eps, state, state_slots, scale)
    B, (_, H, K, V) = qkv.shape[0], state.shape
    q, k, v = causal_conv1d_update(qkv, conv_weight, conv_state, state_slots).split([H * K, H * K, H * V], dim=-1)
    o = kda_decode(q.view(B, H, K), k.view(B, H, K), v.view(B, H, V), g_raw, b_raw, dt_bias, a_log, state,
                   state_slots, scale)
    return gated_rms_norm(o.to(qkv.dtype), gate.view(B, H, V), norm_weight, eps).view(B, H * V)


def kda_decode(q, k, v, g_raw, b_raw, dt_bias, a_log, state, state_slots: torch.Tensor, scale: float):
    """One token per sequence, torch ops. q, k, v: [B, H, K] (post conv + SiLU); g_raw [B, H*K] (f_b_proj output);
    b_raw [B, H] (before sigmoid); state [S, H, K, V] float32 updated in place at state_slots [B].
    Returns o [B, H, V] float32."""
    beta = torch.sigmoid(b_raw).float()
    q, k = l2norm(torch.stack((q, k)))  # one normalisation for both: half the small ops of a decode step's norms
    return fused_recurrent_kda(q, k, v.float(), kda_gate(g_raw, dt_bias, a_log), beta, scale, state, state_slots)


def kda_prefill(q, k, v, g_raw, b_raw, dt_bias, a_log, state, state_slots: list[int], cu_seqlens: list[int],
                scale: float):
    """Packed sequences (cu_seqlens: B+1 host offsets). Same tensors as kda_decode with N tokens instead of B;
    sequence b starts from state[state_slots[b]] and leaves its final state there. Returns o [N, H, V] float32."""
    g, beta = kda_gate(g_raw, dt_bias, a_log), torch.sigmoid(b_raw).float()
    if q.is_cuda and q.dtype != torch.float32 and _fla_available():  # float32 keeps the exact torch path
        from deltaserve.kernels.kda.fla_chunk import fla_chunk_kda

        return fla_chunk_kda(q, k, v, g, beta, scale, state, state_slots, cu_seqlens)
    return chunk_kda(l2norm(q), l2norm(k), v.float(), g, beta, scale, state, state_slots, cu_seqlens)


def _fla_available() -> bool:
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError:
        return False
    return True
