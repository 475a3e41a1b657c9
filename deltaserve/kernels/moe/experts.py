"""Routed expert compute on the CPU: tokens grouped by expert, one pair of matmuls per expert that was hit.

Contributions are summed in ascending expert order, the order the reference uses, so float32 results match it.
"""

import torch
import torch.nn.functional as F


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x [T, D]; w13 [E, 2I, D] (gate rows, then up rows); w2 [E, D, I]; weights [T, k] float32; ids [T, k].

    Returns sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, D] in x's dtype.
    """
    out = torch.zeros_like(x)
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of = order // ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start: start + count]
        gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weights.flatten()[order[start: start + count], None]
        out.index_add_(0, rows, y.to(x.dtype))
        start += count
    return out
