"""Preemption when pages run out: the victim, its resumption as a new request, and progress."""

from scheduler_harness import assert_pools_full, make_request, run_to_completion, step

from deltaserve.request import RequestStatus


def test_tail_is_preempted_and_resumed_with_prompt_plus_outputs(make_scheduler):
    sched = make_scheduler(num_blocks=4, block_size=2)
    a, b = make_request("a", prompt_len=3), make_request("b", prompt_len=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # each holds 2 pages: the cache is full
    step(sched)
    out, _ = step(sched)  # a's 5th token needs a page: b, the most recently admitted, gives its pages back
    assert out.num_scheduled_tokens == {"a": 1} and out.finished_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.state_slot is None
    assert list(sched.waiting) == [b] and b.output_token_ids == [1000, 1001]
    out, _ = step(sched)  # a finishes here; b still lacks pages
    assert out.new_reqs == [] and a.status == RequestStatus.FINISHED_LENGTH
    out, _ = step(sched)
    [resumed] = out.new_reqs
    assert resumed.token_ids == [1, 2, 3, 1000, 1001] and resumed.num_prompt_tokens == 3
    assert resumed.num_computed_tokens == 0 and out.num_scheduled_tokens == {"b": 5}
    run_to_completion(sched)
    assert b.output_token_ids == [1000, 1001, 1002, 1003] and b.status == RequestStatus.FINISHED_LENGTH
    assert_pools_full(sched)


def test_request_that_is_the_tail_preempts_itself(make_scheduler):
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add_request(make_request("a", prompt_len=3))
    sched.add_request(make_request("b", prompt_len=4))
    step(sched)
    out, _ = step(sched)  # a's 4th token fits its pages; b's 5th needs one and nothing is behind b
    assert out.num_scheduled_tokens == {"a": 1} and out.finished_req_ids == {"b"}
    assert sched.requests["b"].status == RequestStatus.PREEMPTED and sched.num_running == 1


def test_victim_is_the_most_recently_admitted_and_no_admission_that_step(make_scheduler):
    sched = make_scheduler(num_blocks=6, block_size=2)
    for req_id, prompt_len in (("a", 3), ("b", 4), ("c", 4)):
        sched.add_request(make_request(req_id, prompt_len=prompt_len))
    step(sched)
    sched.add_request(make_request("d", prompt_len=1))
    out, _ = step(sched)  # b needs a page: c, not a, is preempted; d is not admitted in this step
    assert out.finished_req_ids == {"c"} and out.new_reqs == []
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [r.req_id for r in sched.waiting] == ["c", "d"]


def test_every_request_finishes_in_a_cache_that_fits_one(make_scheduler):
    sched = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=5, max_num_seqs=4)
    reqs = [make_request(f"r{i}", prompt_len=3 + i % 4, max_tokens=6) for i in range(8)]
    for req in reqs:
        sched.add_request(req)
    run_to_completion(sched, max_steps=300)
    assert all(r.output_token_ids == list(range(1000, 1006)) for r in reqs)
    assert any(r.num_preemptions for r in reqs)
    assert_pools_full(sched)


def test_preempted_request_is_not_readmitted_in_the_same_step(make_scheduler):
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=5)
    sched.add_request(make_request("a", prompt_len=4))
    sched.add_request(make_request("b", prompt_len=8))
    step(sched)  # a: 4 tokens, b: a 1-token chunk; one page each
    out, _ = step(sched)  # a takes the last page; b's next chunk needs a second page, so b preempts itself
    assert out.finished_req_ids == {"b"} and out.new_reqs == [] and out.num_scheduled_tokens == {"a": 1}
    assert sched.cache.num_free_blocks == 1  # b's 4-token chunk would fit, yet it waits for the next step
    out, _ = step(sched)
    assert [n.req_id for n in out.new_reqs] == ["b"] and out.num_scheduled_tokens == {"a": 1, "b": 4}
