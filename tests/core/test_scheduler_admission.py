"""Admission, the max_num_seqs limit, rejections and aborts."""

import pytest
from scheduler_harness import EOS, assert_pools_full, make_request, new_scheduler, run_to_completion, step

from deltaserve.core.scheduler import MAX_PASSED_OVER
from deltaserve.request import Request, RequestStatus
from deltaserve.runner_output import RunnerOutput
from deltaserve.sampling_params import SamplingParams


def test_new_request_is_sent_in_full_then_as_diffs(make_scheduler):
    sched = make_scheduler(block_size=4)
    req = make_request("a", prompt_len=6, max_tokens=8)
    sched.add_request(req)
    out, _ = step(sched)
    [new] = out.new_reqs
    assert (new.req_id, new.token_ids, new.num_prompt_tokens) == ("a", req.prompt_token_ids, 6)
    assert new.num_computed_tokens == 0
    assert len(new.block_ids) == 2 and new.state_slot is not None
    assert out.num_scheduled_tokens == {"a": 6} and out.cached_reqs == []
    out, _ = step(sched)  # token 7 of 8 fits in the second page
    assert out.new_reqs == []
    assert [(c.req_id, c.new_block_ids, c.num_computed_tokens) for c in out.cached_reqs] == [("a", [], 6)]
    out, _ = step(sched)
    out, _ = step(sched)  # computes token 9: needs a third page
    assert len(out.cached_reqs[0].new_block_ids) == 1 and out.num_scheduled_tokens == {"a": 1}


def test_max_num_seqs_limits_running_and_admits_fifo_as_slots_free(make_scheduler):
    sched = make_scheduler(max_num_seqs=2)
    for i, max_tokens in enumerate([1, 5, 5]):
        sched.add_request(make_request(f"r{i}", max_tokens=max_tokens))
    out, _ = step(sched)
    assert [n.req_id for n in out.new_reqs] == ["r0", "r1"] and sched.num_waiting == 1
    assert sched.requests.get("r0") is None  # finished after its single token, so its slot is free
    out, _ = step(sched)
    assert [n.req_id for n in out.new_reqs] == ["r2"] and sched.num_running == 2
    run_to_completion(sched)
    assert_pools_full(sched)


def test_waiting_head_that_lacks_pages_blocks_later_requests(make_scheduler):
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    sched.add_request(make_request("big1", prompt_len=12, max_tokens=2))
    sched.add_request(make_request("big2", prompt_len=12, max_tokens=2))
    sched.add_request(make_request("small", prompt_len=2, max_tokens=2))
    out, _ = step(sched)
    assert [n.req_id for n in out.new_reqs] == ["big1"]  # small would fit but must not overtake big2
    assert [r.req_id for r in sched.waiting] == ["big2", "small"]


@pytest.mark.parametrize("prompt_len, match", [
    (0, "empty prompt"),
    (16, r"prompt of 16 tokens must be shorter than max_model_len=16"),
    (17, r"prompt of 17 tokens must be shorter than max_model_len=16"),
])
def test_rejects_empty_or_too_long_prompt(make_scheduler, prompt_len, match):
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match=match):
        sched.add_request(make_request("a", prompt_len=prompt_len))
    assert not sched.has_unfinished_requests()


def test_accepts_prompt_one_short_of_max_model_len(make_scheduler):
    sched = make_scheduler(max_model_len=16)
    req = make_request("a", prompt_len=15, max_tokens=10)
    sched.add_request(req)
    run_to_completion(sched)
    assert req.output_token_ids == [1000] and req.finish_reason == "length"  # 16 tokens: the model's length


def test_rejects_request_larger_than_whole_cache(make_scheduler):
    sched = make_scheduler(num_blocks=3, block_size=4)
    with pytest.raises(ValueError, match=r"may cache up to 13 tokens .* 4 pages, but the whole cache holds 3 pages"):
        sched.add_request(make_request("a", prompt_len=10, max_tokens=4))
    req = make_request("b", prompt_len=10, max_tokens=3)  # caches 12 tokens: exactly 3 pages
    sched.add_request(req)
    run_to_completion(sched)
    assert req.output_token_ids == [1000, 1001, 1002] and req.finish_reason == "length"


def test_rejects_duplicate_request_id(make_scheduler):
    sched = make_scheduler()
    sched.add_request(make_request("a"))
    with pytest.raises(ValueError, match="'a' is already in the engine"):
        sched.add_request(make_request("a"))


def test_abort_waiting_running_and_unknown(make_scheduler):
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run"))
    sched.add_request(make_request("wait"))
    step(sched)
    sched.abort_request("wait")
    sched.abort_request("nobody")
    assert sched.num_waiting == 0 and sched.num_running == 1
    run_req = sched.requests["run"]
    sched.abort_request("run")
    assert run_req.status == RequestStatus.FINISHED_ABORTED and run_req.finish_reason == "abort"
    assert run_req.block_ids == [] and run_req.state_slot is None
    assert_pools_full(sched)
    assert sched.schedule().finished_req_ids == {"run"}  # only the one the runner holds


def test_abort_between_schedule_and_update_is_skipped(make_scheduler):
    sched = make_scheduler()
    req = make_request("a")
    sched.add_request(req)
    out = sched.schedule()
    sched.abort_request("a")
    updates = sched.update_from_output(out, RunnerOutput(["a"], {"a": [5]}))
    assert updates == [] and req.output_token_ids == [] and req.block_ids == [] and req.state_slot is None


def test_requests_waiting_for_a_running_prompt_are_passed_over_at_most_a_bounded_number_a_step():
    """A burst of one prompt waits for its first copy; a request of its own prompt behind fewer than MAX_PASSED_OVER
    of them is admitted in the same step, one behind more waits (each one passed over costs a cache lookup)."""
    sched = new_scheduler(num_blocks=512, max_num_seqs=4, max_num_batched_tokens=64, num_snapshot_slots=8)
    burst = [make_request(f"r{i}", prompt_len=12) for i in range(MAX_PASSED_OVER + 4)]
    near, far = (Request(name, [200 + i, 201 + i, 202 + i], SamplingParams(max_tokens=4), eos_token_ids=(EOS,))
                 for i, name in ((0, "near"), (50, "far")))
    for req in [*burst[:3], near, *burst[3:], far]:
        sched.add_request(req)
    out = sched.schedule()
    assert [n.req_id for n in out.new_reqs] == ["r0", "near"]
    assert far in sched.waiting and len(sched.waiting) == len(burst)
