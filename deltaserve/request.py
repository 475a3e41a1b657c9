"""Request: one prompt's life in the engine; the scheduler's bookkeeping, no tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from deltaserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed from its tokens
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


def ending_ids(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> set[int]:
    """The token ids that end a request when sampled: its eos ids (unless ignore_eos) and stop_token_ids."""
    return set(params.stop_token_ids).union(() if params.ignore_eos else eos_token_ids)


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # tokens whose MLA latents and KDA state are in the cache or being computed by a step already scheduled
    num_computed_tokens: int = 0
    # tokens that scheduled steps will sample for it and update_from_output has not appended yet: the scheduler plans
    # a step while the one before it still runs, so a decode's input may be a token only the device knows
    num_pending_outputs: int = 0
    block_ids: list[int] = field(default_factory=list)  # MLA pages, in order: the block table
    state_slot: int | None = None  # KDA conv + recurrent state slot while running
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at its first admission
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks of tokens
    num_indexed_blocks: int = 0  # leading block_ids already entered in the prefix cache's index
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def __post_init__(self):
        # looked up for every sampled token; a list of thousands of ids cost each step milliseconds a request
        self.stop_token_set = frozenset(self.sampling_params.stop_token_ids)

    @property
    def min_tokens_stop_ids(self) -> tuple[int, ...]:
        """The ids its first min_tokens outputs may not be (the sampler masks them): ending_ids; () without
        min_tokens."""
        params = self.sampling_params
        return tuple(sorted(ending_ids(params, self.eos_token_ids))) if params.min_tokens else ()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_from(self, start: int) -> list[int]:
        """all_token_ids[start:], without copying the tokens before start (a long prompt's, every step)."""
        return self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - len(self.prompt_token_ids)):]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Its tokens once the steps in flight have sampled theirs: what the next step computes up to."""
        return self.num_tokens + self.num_pending_outputs

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
