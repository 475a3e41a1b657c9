"""SchedulerOutput: what the scheduler sends the runner each step (core -> runner), data only, no tensors.

A ground-floor contract, so that the runner reads it without importing core."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must recompute after a preemption), sent in full."""

    req_id: str
    token_ids: list[int]  # prompt + outputs generated before a preemption; the runner computes from position 0...
    num_prompt_tokens: int  # ...of which the first num_prompt_tokens are the prompt
    sampling_params: SamplingParams
    block_ids: list[int]
    state_slot: int
    num_computed_tokens: int = 0  # > 0 only when a cached prefix was restored
    restore_snapshot_slot: int | None = None  # with a cached prefix: the KDA snapshot to copy into state_slot
    min_tokens_stop_ids: tuple[int, ...] = ()  # Request.min_tokens_stop_ids: masked until min_tokens outputs


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed since its last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> tokens to compute this step
    finished_req_ids: set[str] = field(default_factory=set)  # finished, aborted or preempted since the last step
    # req_id -> decode steps the runner runs after its scheduled token, each step's sampled token the next one's
    # input, without a host sync between them; their pages are allocated (a request listed here decodes: one
    # scheduled token, the last of its tokens). The runner returns 1 + this many sampled tokens for it.
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)
    # (state slot, snapshot slot, position): once the request in that state slot has computed `position` tokens
    # (after this step, or after one of its lookahead steps), copy its KDA state into the snapshot slot
    snapshot_saves: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def start_positions(self) -> dict[str, int]:
        """req_id -> tokens it had computed before this step (where its scheduled tokens start)."""
        return {data.req_id: data.num_computed_tokens for data in (*self.new_reqs, *self.cached_reqs)}
