"""KDA ops by mode. Each takes the raw projections (after the short conv) and picks the fastest implementation
for the device: on the CPU the torch kernels of this package, on a GPU our fused Triton recurrence (decode steps
and short prefills) and fla-core's chunked prefill (the `gpu` extra). naive.py is the spec all of them are tested
against."""

import torch

from deltaserve.forward_batch import PackedSeqs
from deltaserve.kernels.kda.chunk import chunk_kda
from deltaserve.kernels.kda.fused_recurrent import fused_recurrent_kda
from deltaserve.kernels.kda.gate import kda_gate, l2norm
from deltaserve.kernels.varlen import pack_seqs

RECURRENT_PREFILL_MAX_LEN = 32  # a step's longest prefill sequence: where our recurrent kernel stops winning

__all__ = ["chunk_kda", "fused_recurrent_kda", "kda_decode", "kda_gate", "kda_prefill", "l2norm"]


def kda_decode(q, k, v, g_raw, b_raw, dt_bias, a_log, state, state_slots: torch.Tensor, scale: float, pdl: bool = True):
    """One token per sequence. q, k, v: [B, H, K] (post conv + SiLU); g_raw [B, H*K] (f_b_proj output);
    b_raw [B, H] (before sigmoid); state [S, H, K, V] float32 updated in place at state_slots [B].
    Returns o [B, H, V]: float32 from the torch path, v's dtype from the GPU kernel (which rounds it)."""
    if q.is_cuda:
        from deltaserve.kernels.kda.triton_decode import kda_decode as triton_kda_decode

        return triton_kda_decode(q, k, v, g_raw, b_raw, dt_bias, a_log, state, state_slots, scale, pdl)
    beta = torch.sigmoid(b_raw).float()
    q, k = l2norm(torch.stack((q, k)))  # one normalisation for both: half the small ops of a decode step's norms
    return fused_recurrent_kda(q, k, v.float(), kda_gate(g_raw, dt_bias, a_log), beta, scale, state, state_slots)


def kda_prefill(q, k, v, g_raw, b_raw, dt_bias, a_log, state, state_slots: list[int], cu_seqlens: list[int],
                scale: float, packed: PackedSeqs | None = None, pdl: bool = True):
    """Packed sequences (cu_seqlens: B+1 host offsets; packed: the same as tensors, made here when needed and not
    given). Same tensors as kda_decode with N tokens instead of B; sequence b starts from state[state_slots[b]] and
    leaves its final state there. In half precision on a GPU, sequences of at most RECURRENT_PREFILL_MAX_LEN tokens
    go through our recurrent kernel (one launch, and no fla-core import for a short prompt), longer ones through
    fla-core's chunked kernel. Returns o [N, H, V]: float32 from the torch path, v's dtype from the GPU kernels."""
    if q.is_cuda and q.dtype != torch.float32:
        packed = packed or pack_seqs(state_slots, cu_seqlens, q.device)
        if packed.max_len <= RECURRENT_PREFILL_MAX_LEN:
            from deltaserve.kernels.kda.triton_decode import kda_recurrent_varlen

            return kda_recurrent_varlen(q, k, v, g_raw, b_raw, dt_bias, a_log, state, packed, scale, pdl)
    g, beta = kda_gate(g_raw, dt_bias, a_log), torch.sigmoid(b_raw).float()
    if fla_serves(q.device, q.dtype):
        from deltaserve.kernels.kda.fla_chunk import fla_chunk_kda

        return fla_chunk_kda(q, k, v, g, beta, scale, state, packed)
    return chunk_kda(l2norm(q), l2norm(k), v.float(), g, beta, scale, state, state_slots, cu_seqlens)


def fla_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether kda_prefill runs fla-core's chunk kernel for tensors on device in dtype: a GPU, half precision
    (float32 keeps the exact torch path) and fla-core installed (imported here, only then: seconds of imports)."""
    return device.type == "cuda" and dtype != torch.float32 and _fla_available()


def _fla_available() -> bool:
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError:
        return False
    return True
