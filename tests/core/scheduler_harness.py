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
    """schedule() then a fake runner: for each request whose scheduled chunk ends its tokens, its sampled tokens
    sample(req) + i for i in 0..lookahead."""
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_runner_output(sched, out, sample))


def fake_runner_output(sched: Scheduler, out, sample=next_output_token) -> RunnerOutput:
    """What a runner returns for `out` when the steps before it have been applied (a synchronous step)."""
    starts, sampled = out.start_positions(), {}
    for req_id, num_tokens in out.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        done = starts[req_id] + num_tokens == req.num_tokens
        steps = 1 + out.num_lookahead_tokens.get(req_id, 0)
        sampled[req_id] = [sample(req) + i for i in range(steps)] if done else []
    return RunnerOutput(list(out.num_scheduled_tokens), sampled)


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list:
    """Step until no request is left; returns every step's SchedulerOutput."""
    outputs = []
    while sched.has_unfinished_requests():
        assert len(outputs) < max_steps, "the scheduler made no progress"
        outputs.append(step(sched)[0])
    return outputs
