"""RunnerOutput: what the runner returns to the scheduler each step (runner -> core), data only, host lists.

A ground-floor contract, so that the runner builds it without importing core."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprobs:
    """Top-n log-probabilities at one position: the chosen token's first, then the top n (may repeat it)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class RunnerOutput:
    req_ids: list[str]  # in the order they were run
    sampled_token_ids: dict[str, list[int]]  # empty list while the prompt is still being prefilled
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)  # for prompt positions computed now
