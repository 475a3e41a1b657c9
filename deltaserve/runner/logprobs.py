"""Tensors of log-probabilities -> the Logprobs records of RunnerOutput (host lists)."""

from __future__ import annotations

import torch

from deltaserve.kernels.sampling import SampledLogprobs
from deltaserve.runner_output import Logprobs


def sampled_logprobs(result: SampledLogprobs, token_ids: list[int], nums: list[int | None]) -> list[Logprobs | None]:
    """Per row: the sampled token's logprob and rank, then the row's top nums[row]; None where nums[row] is None.
    Each tensor of result comes to the host once for the whole batch."""
    top_ids, top_values = result.top_token_ids.tolist(), result.top_logprobs.tolist()
    chosen, ranks = result.sampled_logprobs.tolist(), result.sampled_ranks.tolist()
    return [None if num is None else _entry(token, chosen[row], ranks[row], top_ids[row][:num], top_values[row][:num])
            for row, (token, num) in enumerate(zip(token_ids, nums))]


def prompt_logprobs(logits: torch.Tensor, targets: list[int], num: int) -> list[Logprobs]:
    """logits [T, V] float32 at positions predicting `targets` (T ids) -> per position: target, then top `num`."""
    logprobs = logits.log_softmax(dim=-1)
    target = torch.tensor(targets, device=logits.device)[:, None]
    chosen = logprobs.gather(-1, target)  # [T, 1]
    ranks = (logprobs > chosen).sum(-1) + 1
    top_values, top_ids = logprobs.topk(min(num, logits.shape[-1]), dim=-1)
    return [_entry(*row) for row in zip(targets, chosen[:, 0].tolist(), ranks.tolist(), top_ids.tolist(),
                                        top_values.tolist())]


def _entry(token_id: int, logprob: float, rank: int, top_ids: list[int], top_values: list[float]) -> Logprobs:
    """The chosen token first, then the top len(top_ids), ranked 1, 2, ..."""
    return Logprobs([token_id] + top_ids, [logprob] + top_values, [rank] + list(range(1, len(top_ids) + 1)))
