"""What the engine returns to its callers: per request, its outputs so far. Plain dataclasses, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Logprob(NamedTuple):
    """One token's log-probability as users see it (vLLM's fields): logprob, rank, decoded text. A named tuple, not a
    dataclass: no instance dict, so smaller and quicker to unpickle and for the garbage collector to walk; a response
    may hold millions, and the collector's full collections hold the GIL (and the server's event loop with it)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, Logprob]] | None = None  # per generated token when asked for
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """What generate() returns per prompt and what streaming yields as a request progresses (cumulative)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # None at position 0, as vLLM
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first_token and finish times (monotonic)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (prefill skipped)


@dataclass
class StepTotals:
    """An engine's steps of one kind since it started: "decode" steps (every scheduled request computes one token,
    the steps CUDA graphs replay, with their lookahead steps) or "prefill" steps (at least one prompt chunk)."""

    steps: int = 0
    # wall time to each step's end from its submission, or from the end of the step before when that is later (with
    # a step in flight the two overlap): what a step adds to the engine's time, idle time between steps excluded
    seconds: float = 0.0
    tokens: int = 0  # tokens computed: scheduled tokens plus lookahead tokens
