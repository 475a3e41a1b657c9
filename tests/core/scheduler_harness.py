"""Test harness for the scheduler: a scheduler over a small cache, requests, and a fake runner step (no model)."""

from __future__ import annotations

from deltaserve.cache.manager import CacheManager
from deltaserve.config import EngineConfig
from deltaserve.core.scheduler import Scheduler
from deltaserve.request import Request
from deltaserve.runner_output import RunnerOutput
from deltaserve.sampling_params import SamplingParams

EOS = 99


def new_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                  num_decode_steps=1, num_snapshot_slots=0):
    """num_decode_steps 1 (no decode bursts) unless a test is about them: the others count steps."""
    engine = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          block_size=block_size, num_cache_blocks=num_blocks, num_decode_steps=num_decode_steps)
    return Scheduler(engine, CacheManager(num_blocks, max_num_seqs, block_size, num_snapshot_slots), max_model_len)


def assert_pools_full(sched: Scheduler) -> None:
    assert not sched.has_unfinished_requests() and sched.num_running == 0 and sched.num_waiting == 0
    assert sched.cache.num_free_blocks == sched.cache.num_blocks
    assert sched.cache.num_free_slots == sched.cache.state_pool.num_slots
    assert sched.cache.usage == 0.0


def make_request(req_id: str, prompt_len: int = 4, **params) -> Request:
    """A request whose prompt is tokens 1..prompt_len, eos EOS, and SamplingParams(**params)."""
    params.setdefault("max_tokens", 4)
    return Request(req_id, list(range(1, prompt_len + 1)), SamplingParams(**params), eos_token_ids=(EOS,))


def next_output_token(req: Request) -> int:
    return 1000 + len(req.output_token_ids)


def step(sched: Scheduler, sample=next_output_token):
    """schedule() then a fake runner: one sampled token for each request whose scheduled chunk ends its tokens (in a
    decode burst, one a step: sample(req) + i for step i)."""
    out = sched.schedule()
    sampled = {}
    for req_id, num_tokens in out.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        done = req.num_computed_tokens + num_tokens == req.num_tokens
        sampled[req_id] = [sample(req) + i for i in range(out.num_decode_steps)] if done else []
    updates = sched.update_from_output(out, RunnerOutput(list(out.num_scheduled_tokens), sampled))
    return out, updates


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list:
    """Step until no request is left; returns every step's SchedulerOutput."""
    outputs = []
    while sched.has_unfinished_requests():
        assert len(outputs) < max_steps, "the scheduler made no progress"
        outputs.append(step(sched)[0])
    return outputs
