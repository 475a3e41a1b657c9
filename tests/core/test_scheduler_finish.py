"""Finishing: max_tokens, eos, ignore_eos, stop_token_ids, max_model_len, stops found outside."""

import pytest
from scheduler_harness import EOS, assert_pools_full, make_request, run_to_completion, step

from deltaserve.request import RequestStatus
from deltaserve.runner_output import RunnerOutput


def emit(tokens):
    """A sampler that emits `tokens` in order, one per output position."""
    return lambda req: tokens[len(req.output_token_ids)]


def run_with(sched, req, tokens):
    sched.add_request(req)
    while sched.has_unfinished_requests():
        step(sched, emit(tokens))
    assert_pools_full(sched)


def test_max_tokens_finishes_with_length(make_scheduler):
    sched = make_scheduler()
    req = make_request("a", max_tokens=3)
    sched.add_request(req)
    run_to_completion(sched)
    assert req.output_token_ids == [1000, 1001, 1002] and req.finish_reason == "length"


def test_eos_stops_unless_ignored(make_scheduler):
    sched = make_scheduler()
    stopped = make_request("a", max_tokens=5)
    run_with(sched, stopped, [7, EOS, 8, 9, 10])
    assert stopped.output_token_ids == [7, EOS] and stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = make_request("b", max_tokens=5, ignore_eos=True)
    run_with(sched, ignored, [7, EOS, 8, 9, 10])
    assert ignored.output_token_ids == [7, EOS, 8, 9, 10] and ignored.finish_reason == "length"


def test_stop_token_ids_stop_even_with_ignore_eos(make_scheduler):
    sched = make_scheduler()
    req = make_request("a", max_tokens=5, stop_token_ids=[42], ignore_eos=True)
    run_with(sched, req, [7, 42, 8, 9, 10])
    assert req.output_token_ids == [7, 42] and req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 42


def test_stop_token_at_the_last_allowed_position_is_a_stop(make_scheduler):
    sched = make_scheduler()
    req = make_request("a", max_tokens=2)
    run_with(sched, req, [7, EOS])
    assert req.finish_reason == "stop"


def test_generation_is_capped_at_max_model_len(make_scheduler):
    sched = make_scheduler(max_model_len=8)
    req = make_request("a", prompt_len=5, max_tokens=100)
    sched.add_request(req)
    run_to_completion(sched)
    assert req.num_tokens == 8 and len(req.output_token_ids) == 3 and req.finish_reason == "length"


def test_max_tokens_zero_computes_the_prompt_and_outputs_nothing(make_scheduler):
    sched = make_scheduler()
    req = make_request("a", max_tokens=0)
    sched.add_request(req)
    _, updates = step(sched)
    assert updates == [(req, [])] and req.finish_reason == "length" and req.output_token_ids == []


def test_tokens_after_a_stop_in_one_runner_output_are_dropped(make_scheduler):
    sched = make_scheduler(num_decode_steps=3)
    req = make_request("a", max_tokens=5, temperature=0)
    sched.add_request(req)
    sched.update_from_output(sched.schedule(), RunnerOutput(["a"], {"a": [6]}))
    out = sched.schedule()
    assert out.num_lookahead_tokens == {"a": 2}
    updates = sched.update_from_output(out, RunnerOutput(["a"], {"a": [7, EOS, 8]}))
    assert updates == [(req, [7, EOS])] and req.status == RequestStatus.FINISHED_STOPPED
    assert sched.schedule().finished_req_ids == {"a"}


def test_finish_requests_from_outside(make_scheduler):
    sched = make_scheduler()
    req = make_request("a", max_tokens=10)
    sched.add_request(req)
    step(sched)
    sched.finish_requests(["a", "unknown"], RequestStatus.FINISHED_STOPPED)
    assert req.finish_reason == "stop" and sched.schedule().finished_req_ids == {"a"}
    with pytest.raises(ValueError, match="must be a finished status"):
        sched.finish_requests(["a"], RequestStatus.RUNNING)


def test_missing_token_after_the_last_chunk_is_a_runner_error(make_scheduler):
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt_len=4))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="returned 0 sampled tokens for request 'a', owed 1"):
        sched.update_from_output(out, RunnerOutput(["a"], {"a": []}))


def test_no_stop_token_ends_the_first_min_tokens_outputs(make_scheduler):
    sched = make_scheduler()
    req = make_request("a", max_tokens=8, min_tokens=3, stop_token_ids=[42])
    run_with(sched, req, [EOS, 42, EOS, 42, 8, 9, 10, 11])
    assert req.output_token_ids == [EOS, 42, EOS, 42] and req.finish_reason == "stop" and req.stop_reason == 42
    after = make_request("b", max_tokens=8, min_tokens=3)
    run_with(sched, after, [7, 8, 9, EOS, 10, 11, 12, 13])
    assert after.output_token_ids == [7, 8, 9, EOS] and after.finish_reason == "stop"


def test_min_tokens_yields_to_max_model_len(make_scheduler):
    sched = make_scheduler(max_model_len=8)
    req = make_request("a", prompt_len=5, max_tokens=10, min_tokens=10)
    sched.add_request(req)
    run_to_completion(sched)
    assert len(req.output_token_ids) == 3 and req.finish_reason == "length"


@pytest.mark.parametrize("params, banned", [
    (dict(min_tokens=2, stop_token_ids=[42, 7, 42]), (7, 42, EOS)),
    (dict(min_tokens=2, stop_token_ids=[42], ignore_eos=True), (42,)),
    (dict(min_tokens=2, ignore_eos=True), ()),
    (dict(min_tokens=0, stop_token_ids=[42]), ()),
])
def test_the_runner_is_sent_the_ids_min_tokens_masks(make_scheduler, params, banned):
    """The eos ids (unless ignore_eos) and stop_token_ids reach the runner with the request (and every
    tensor-parallel rank: they build their RequestStates from the same NewRequestData)."""
    sched = make_scheduler()
    sched.add_request(make_request("a", max_tokens=4, **params))
    assert sched.schedule().new_reqs[0].min_tokens_stop_ids == banned
