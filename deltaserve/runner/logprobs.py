"""Tensors of log-probabilities -> the Logprobs records of RunnerOutput (host lists)."""

from __future__ import annotations

import torch

from deltaserve.core.outputs import Logprobs
from deltaserve.kernels.sampling import SampledLogprobs


def sampled_logprobs(result: SampledLogprobs, row: int, token_id: int, num: int) -> Logprobs:
    """The sampled token's logprob and rank, then the row's top `num`."""
    ids = result.top_token_ids[row, :num].tolist()
    return Logprobs(
        token_ids=[token_id] + ids,
        logprobs=[float(result.sampled_logprobs[row])] + result.top_logprobs[row, :num].tolist(),
        ranks=[int(result.sampled_ranks[row])] + list(range(1, len(ids) + 1)),
    )


def prompt_logprobs(logits: torch.Tensor, targets: list[int], num: int) -> list[Logprobs]:
    """logits [T, V] float32 at positions predicting `targets` (T ids) -> per position: target, then top `num`."""
    logprobs = logits.log_softmax(dim=-1)
    target = torch.tensor(targets, device=logits.device)[:, None]
    chosen = logprobs.gather(-1, target)  # [T, 1]
    ranks = (logprobs > chosen).sum(-1) + 1
    top_values, top_ids = logprobs.topk(min(num, logits.shape[-1]), dim=-1)
    return [
        Logprobs([t] + ids, [c] + values, [r] + list(range(1, len(ids) + 1)))
        for t, c, r, ids, values in zip(targets, chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(),
                                        top_values.tolist())
    ]
