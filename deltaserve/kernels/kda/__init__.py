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
    leaves its final state there. The kernel is prefill_path's choice for the step's longest sequence, so a
    sequence's last bits in half precision depend on what shares its step (as chunk boundaries do). Returns o [N,
    H, V]: float32 from the torch path, v's dtype from the GPU kernels."""
    path = prefill_path(q.device, q.dtype, cu_seqlens, packed)
    if path == "recurrent":
        from deltaserve.kernels.kda.triton_decode import kda_recurrent_varlen

        packed = packed or pack_seqs(state_slots, cu_seqlens, q.device)
        return kda_recurrent_varlen(q, k, v, g_raw, b_raw, dt_bias, a_log, state, packed, scale, pdl)
    if path == "fla":  # the gate and beta's sigmoid formed inside fla-core's kernels
        from deltaserve.kernels.kda.fla_chunk import fla_chunk_kda

        packed = packed or pack_seqs(state_slots, cu_seqlens, q.device)
        return fla_chunk_kda(q, k, v, g_raw, b_raw, dt_bias, a_log, scale, state, packed)
    g, beta = kda_gate(g_raw, dt_bias, a_log), torch.sigmoid(b_raw).float()
    return chunk_kda(l2norm(q), l2norm(k), v.float(), g, beta, scale, state, state_slots, cu_seqlens)


def prefill_path(device: torch.device, dtype: torch.dtype, cu_seqlens: list[int],
                 packed: PackedSeqs | None = None) -> str:
    """Which kernel runs a prefill step of the sequences at cu_seqlens (packed: the same, with their longest):
    "torch" (our chunked torch path: the CPU, and float32 anywhere, exact), "recurrent" (our Triton recurrence,
    half precision on a GPU while the longest sequence has at most RECURRENT_PREFILL_MAX_LEN tokens: one launch,
    faster there) or "fla" (fla-core's chunked kernel, longer ones; "torch" where fla-core is not installed).
    fla-core is imported here, only when a step needs it (seconds)."""
    if device.type != "cuda" or dtype == torch.float32:
        return "torch"
    longest = packed.max_len if packed else max((b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])), default=0)
    if longest <= RECURRENT_PREFILL_MAX_LEN:
        return "recurrent"
    return "fla" if _fla_available() else "torch"


def _fla_available() -> bool:
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError:
        return False
    return True
