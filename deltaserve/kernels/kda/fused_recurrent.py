"""Recurrent KDA for decode: one token per sequence, pooled states updated in place. O(1) work per token."""

import torch


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """One KDA step for B sequences.

    q, k, g: [B, H, K] float32 (q, k l2-normalised); v: [B, H, V] float32; beta: [B, H] float32
    state: [S, H, K, V] float32; state_slots: [B] int64 (distinct). Returns o [B, H, V] float32.
    The batched form (the GPU's, and the CPU's under torch.compile) gathers the states, updates and scatters them."""
    if not state.is_cuda and not torch.compiler.is_compiling():  # traced (compile_decode): the batched form below
        return _in_place(q * scale, k, v, g.exp(), beta, state, state_slots.tolist())
    S = state.index_select(0, state_slots) * g.exp()[..., None]  # [B, H, K, V]
    predicted = (k[:, :, None, :] @ S)[:, :, 0]  # [B, H, V]
    S = S + k[..., None] * ((v - predicted) * beta[..., None])[:, :, None, :]
    state.index_copy_(0, state_slots, S)
    return ((q * scale)[:, :, None, :] @ S)[:, :, 0]


def _in_place(q, k, v, decay, beta, state, slots: list[int]) -> torch.Tensor:
    """The CPU path: each sequence's state updated where it lies, with no state-sized temporaries (on the CPU
    those cost more than the arithmetic). Same maths as the batched path above."""
    o = torch.empty_like(v)
    for b, slot in enumerate(slots):
        S = state[slot]  # [H, K, V], a view
        S.mul_(decay[b, :, :, None])
        predicted = torch.bmm(k[b, :, None, :], S)[:, 0]  # [H, V]; bmm, not @: matmul's kernel without its checks
        S.baddbmm_(k[b, :, :, None], ((v[b] - predicted) * beta[b, :, None])[:, None, :])
        torch.bmm(q[b, :, None, :], S, out=o[b, :, None, :])
    return o
