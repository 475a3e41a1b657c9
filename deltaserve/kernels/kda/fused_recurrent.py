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
    """
    S = state.index_select(0, state_slots) * g.exp()[..., None]  # [B, H, K, V]
    predicted = (k[:, :, None, :] @ S)[:, :, 0]  # [B, H, V]
    S = S + k[..., None] * ((v - predicted) * beta[..., None])[:, :, None, :]
    state.index_copy_(0, state_slots, S)
    return ((q * scale)[:, :, None, :] @ S)[:, :, 0]
