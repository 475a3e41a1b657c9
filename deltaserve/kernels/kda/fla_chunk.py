"""Prefill through fla-core's chunk_kda (the kernel vLLM and SGLang run), reading and writing pooled states."""

import torch
from fla.ops.kda import chunk_kda

from deltaserve.forward_batch import PackedSeqs
from deltaserve.kernels.tuning_cache import restore_imported_tuning

restore_imported_tuning(("fla.",))  # fla-core's kernels are imported (here) by the first long prefill


def fla_chunk_kda(q, k, v, g_raw, b_raw, dt_bias, a_log, scale, state, packed: PackedSeqs) -> torch.Tensor:
    """q, k, v [N, H, K] (raw: fla l2-normalises q and k in float32 inside), g_raw [N, H*K] (f_b_proj's output),
    b_raw [N, H] (before the sigmoid), dt_bias [H*K] and a_log [H] float32: kernels.kda.kda_decode's inputs. The
    forget gate -exp(A_log) * softplus(g_raw + dt_bias) (softplus linear above 20, as kernels.kda.kda_gate) is formed
    in float32 inside fla's chunk cumsum kernel, and beta's sigmoid in float32 in its own: the [N, H, K] float32 gate
    is never written out (three elementwise passes and a cumsum over it, a layer, otherwise). state [S, H, K, V]
    float32, in place, at packed.state_slots; packed.cu_seqlens on the device and the host (so fla derives its chunk
    indices without a sync, once a step). Returns o [N, H, V] in q's dtype (bfloat16 for float32 inputs)."""
    dtype = q.dtype if q.dtype != torch.float32 else torch.bfloat16
    N, H, K = q.shape
    o, final = chunk_kda(q[None].to(dtype), k[None].to(dtype), v[None].to(dtype), g_raw.reshape(1, N, H, K),
                         b_raw[None], scale=scale, initial_state=state.index_select(0, packed.state_slots),
                         output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                         use_beta_sigmoid_in_kernel=True, A_log=a_log.float(), dt_bias=dt_bias.float(),
                         cu_seqlens=packed.cu_seqlens, cu_seqlens_cpu=packed.cu_seqlens_cpu)
    state.index_copy_(0, packed.state_slots, final.float())
    return o[0]
