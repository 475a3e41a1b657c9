"""SchedulerOutput: what the scheduler sends the runner each step (core -> runner), data only, no tensors.

A ground-floor contract, so that the runner reads it without importing core.
"""

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
    # (state slot, snapshot slot): copy the KDA state into the snapshot slot after this step's forward pass
    snapshot_saves: list[tuple[int, int]] = field(default_factory=list)
    # in a decode burst, per save: the burst step after which the runner copies (else after the step)
    snapshot_save_steps: list[int] = field(default_factory=list)
    # > 1: a decode burst: every scheduled request decodes this many tokens, each step's sampled token the next
    # one's input, with one sync at the end; the runner returns that many sampled tokens per request
    num_decode_steps: int = 1
    # a decode burst scheduled while the step before it runs (Scheduler.schedule_chained): its first step's inputs
    # are the tokens that step samples, on the device; the runner returns num_decode_steps tokens per request
    chained: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())
