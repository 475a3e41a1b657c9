"""What parity reads off logits: top-2 margins, top-k log-probabilities, the KL to a stored reference."""

from __future__ import annotations

import torch


def top2(logits: torch.Tensor) -> list[tuple[int, int, float]]:
    """logits [M, V] -> per row (best id, runner-up id, logit gap between them >= 0)."""
    values, ids = logits.float().topk(2, dim=-1)
    margins = (values[:, 0] - values[:, 1]).tolist()
    return [(a, b, _round(m)) for (a, b), m in zip(ids.tolist(), margins)]


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """logits [M, V] -> per row the top min(k, V) token ids and their log-probabilities (descending)."""
    values, ids = logits.float().log_softmax(dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return ids.tolist(), [[_round(v) for v in row] for row in values.tolist()]


def coarse_kl(ref_ids: list[list[int]], ref_logprobs: list[list[float]], logits: torch.Tensor) -> list[float]:
    """Per row, KL(reference || ours) over the reference's top-k tokens plus one bucket for all the others.

    ref_ids / ref_logprobs: M rows of k; logits [M, V] (ours). Exact when k = V; otherwise a lower bound of
    the full KL that misses only how the tail's mass is spread. Computed in float64."""
    ours = logits.double().log_softmax(dim=-1)  # [M, V]
    ids = torch.tensor(ref_ids, device=logits.device)
    p_log = torch.tensor(ref_logprobs, dtype=torch.float64, device=logits.device)  # [M, k]
    q_log = ours.gather(1, ids)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    if ids.shape[1] < logits.shape[1]:
        p_tail = (1 - p_log.exp().sum(-1)).clamp_min(0)
        q_tail = (1 - q_log.exp().sum(-1)).clamp_min(1e-300)
        kl = kl + torch.where(p_tail > 0, p_tail * (p_tail.clamp_min(1e-300).log() - q_tail.log()), 0.0)
    return kl.clamp_min(0).tolist()


def logit_gap(entry_ids: list[int], entry_logprobs: list[float], best: int, other: int) -> float | None:
    """The reference's logit(best) - logit(other) from one row of its top-k; None when `other` is not in it."""
    if other not in entry_ids or best not in entry_ids:
        return None
    return entry_logprobs[entry_ids.index(best)] - entry_logprobs[entry_ids.index(other)]


def _round(x: float) -> float:
    """9 significant digits: any float32 reads back exactly, without float64 noise digits."""
    return float(f"{x:.9g}")
