"""Prefill through fla-core's chunk_kda (the kernel vLLM and SGLang run), reading and writing pooled states."""

import torch
from fla.ops.kda import chunk_kda


def fla_chunk_kda(q, k, v, g, beta, scale, state, state_slots: list[int], cu_seqlens: list[int]) -> torch.Tensor:
    """q, k, v [N, H, K] (raw: fla l2-normalises q and k in float32 inside), g [N, H, K] float32 log decay,
    beta [N, H] float32; state [S, H, K, V] float32, in place. Returns o [N, H, V] float32."""
    slots = torch.tensor(state_slots, dtype=torch.int64, device=q.device)
    cu = torch.tensor(cu_seqlens, dtype=torch.int64, device=q.device)
    dtype = q.dtype if q.dtype != torch.float32 else torch.bfloat16
    o, final = chunk_kda(q[None].to(dtype), k[None].to(dtype), v[None].to(dtype), g[None], beta[None].to(dtype),
                         scale=scale, initial_state=state.index_select(0, slots), output_final_state=True,
                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    state.index_copy_(0, slots, final.float())
    return o[0].float()
