"""Routed expert compute on the CPU: tokens grouped by expert, one pair of matmuls per expert that was hit.

Contributions are summed in ascending expert order, the order the reference uses, so float32 results match it.
"""

from collections.abc import Iterator

import torch
import torch.nn.functional as F

_FEW_ASSIGNMENTS = 64  # up to this many (token, expert) pairs, group on the host: fewer ops for decode steps


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x [T, D]; w13 [E, 2I, D] (gate rows, then up rows); w2 [E, D, I]; weights [T, k] float32; ids [T, k].

    Returns sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, D] in x's dtype.
    """
    out = torch.zeros_like(x)
    flat_weights = weights.flatten()
    for expert, rows, positions in _group_by_expert(ids):
        gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * flat_weights[positions, None]
        out.index_add_(0, rows, y.to(x.dtype))
    return out


def _group_by_expert(ids: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each expert hit, ascending: (expert, its token rows [n], their flat positions in ids [n])."""
    k, flat = ids.shape[1], ids.flatten()
    if flat.numel() <= _FEW_ASSIGNMENTS:
        by_expert: dict[int, list[int]] = {}
        for position, expert in enumerate(flat.tolist()):
            by_expert.setdefault(expert, []).append(position)
        for expert in sorted(by_expert):
            positions = torch.tensor(by_expert[expert], device=ids.device)
            yield expert, positions // k, positions
        return
    order = flat.argsort(stable=True)
    start = 0
    for expert, count in enumerate(torch.bincount(flat).tolist()):
        if count:
            positions = order[start: start + count]
            yield expert, positions // k, positions
            start += count
