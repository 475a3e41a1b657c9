"""The spec of the KDA ops: one token at a time, exactly DESIGN.md section 1. Test oracle; slow on purpose."""

import torch
import torch.nn.functional as F


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi Delta Attention, token by token.

    q, k, g: [B, T, H, K] (q, k already l2-normalised; g is the per-channel log decay, <= 0)
    v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] or None (zeros)
    Returns o [B, T, H, V] (float32) and the final state [B, H, K, V] (float32)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    B, T, H, K = k.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float().clone()
    o = q.new_zeros(B, T, H, v.shape[-1])
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        predicted = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + k[:, t, :, :, None] * ((v[:, t] - predicted) * beta[:, t, :, None])[:, :, None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o, S


def naive_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None = None):
    """Depthwise causal conv + SiLU over one sequence.

    x: [T, D]; weight: [D, W]; initial_state: [D, W-1] (the W-1 inputs before x) or None (zeros).
    Returns y [T, D] and the new state [D, W-1] (the last W-1 inputs)."""
    D, W = weight.shape
    state = x.new_zeros(D, W - 1) if initial_state is None else initial_state
    xx = torch.cat([state, x.t()], dim=1)  # [D, W-1+T]
    y = F.conv1d(xx[None], weight[:, None, :], groups=D)[0].t()  # [T, D]
    return F.silu(y), xx[:, -(W - 1):]
