"""The token budget: chunked prefill across steps, mixed decode and prefill, chunk sizes."""

import pytest
from scheduler_harness import assert_pools_full, make_request, run_to_completion, step


def scheduled_chunks(outputs, req_id):
    return [o.num_scheduled_tokens[req_id] for o in outputs if req_id in o.num_scheduled_tokens]


@pytest.mark.parametrize("budget, prompt_len, chunks", [
    (4, 10, [4, 4, 2]),
    (4, 8, [4, 4]),  # the last chunk is exactly the remaining size
    (4, 4, [4]),
    (4, 5, [4, 1]),
    (1, 3, [1, 1, 1]),
])
def test_long_prompt_is_chunked_then_decodes(make_scheduler, budget, prompt_len, chunks):
    sched = make_scheduler(max_num_batched_tokens=budget)
    req = make_request("a", prompt_len=prompt_len, max_tokens=3)
    sched.add_request(req)
    outputs = run_to_completion(sched)
    assert scheduled_chunks(outputs, "a") == chunks + [1, 1]
    assert req.output_token_ids == [1000, 1001, 1002]
    assert_pools_full(sched)


def test_only_the_last_chunk_samples_and_pages_grow_with_chunks(make_scheduler):
    sched = make_scheduler(block_size=4, max_num_batched_tokens=5)
    sched.add_request(make_request("a", prompt_len=12))
    out, updates = step(sched)
    assert updates == [] and len(out.new_reqs[0].block_ids) == 2  # 5 tokens -> 2 pages
    out, updates = step(sched)
    assert updates == [] and len(out.cached_reqs[0].new_block_ids) == 1  # 10 tokens -> 3 pages
    assert out.cached_reqs[0].num_computed_tokens == 5
    out, updates = step(sched)
    assert out.num_scheduled_tokens == {"a": 2} and [tokens for _, tokens in updates] == [[1000]]


def test_decode_and_prefill_chunk_share_a_step(make_scheduler):
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("dec", prompt_len=3, max_tokens=10))
    step(sched)
    sched.add_request(make_request("pre", prompt_len=20))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"dec": 1, "pre": 7}
    assert [c.req_id for c in out.cached_reqs] == ["dec"] and [n.req_id for n in out.new_reqs] == ["pre"]
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"dec": 1, "pre": 7}


def test_budget_is_never_exceeded_and_running_requests_go_first(make_scheduler):
    sched = make_scheduler(max_num_batched_tokens=6, max_num_seqs=4)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", prompt_len=5, max_tokens=4))
    outputs = run_to_completion(sched)
    assert all(0 < o.total_num_scheduled_tokens <= 6 for o in outputs)
    first = outputs[0].num_scheduled_tokens
    assert first == {"r0": 5, "r1": 1}
    assert outputs[1].num_scheduled_tokens == {"r0": 1, "r1": 4, "r2": 1}
    assert_pools_full(sched)


def test_a_request_left_without_budget_is_not_scheduled(make_scheduler):
    """Running requests are served in order while budget is left: when those before it take it all (three requests
    decode, and the budget is lowered to 2 under them), the next sits the step out rather than being sent with 0
    tokens, and is served in the steps after."""
    sched = make_scheduler(max_num_batched_tokens=3)
    for req_id in "abc":
        sched.add_request(make_request(req_id, prompt_len=1, max_tokens=3))
    assert step(sched)[0].num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    sched.max_num_batched_tokens = 2
    outputs = run_to_completion(sched)
    assert [o.num_scheduled_tokens for o in outputs] == [
        {"a": 1, "b": 1}, {"a": 1, "b": 1}, {"c": 1}, {"c": 1}]
