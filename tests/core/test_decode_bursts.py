"""Decode bursts: when the scheduler runs several decode steps at once, and that the tokens are those of one step
at a time (scheduler with a fake runner here; the model's tokens in test_engine_bursts.py)."""

from scheduler_harness import EOS, assert_pools_full, make_request, new_scheduler

from deltaserve.runner_output import RunnerOutput


def burst_step(sched, tokens: dict[str, list[int]]):
    """schedule() then a fake runner that emits each request's next tokens from `tokens`, one per decode step."""
    out = sched.schedule()
    sampled = {}
    for req_id, n in out.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        if req.num_computed_tokens + n == req.num_tokens:
            done = len(req.output_token_ids)
            sampled[req_id] = tokens[req_id][done: done + out.num_decode_steps]
    sched.update_from_output(out, RunnerOutput(list(out.num_scheduled_tokens), sampled))
    return out


def run(sched, reqs, tokens):
    for req in reqs:
        sched.add_request(req)
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < 500
        outs.append(burst_step(sched, tokens))
    assert_pools_full(sched)
    return outs


def greedy_request(req_id: str, **params):
    return make_request(req_id, **{"temperature": 0, **params})


def stream(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_greedy_decodes_run_in_bursts_within_max_tokens():
    sched = new_scheduler(num_decode_steps=4, block_size=4, num_blocks=64)
    req = greedy_request("a", prompt_len=6, max_tokens=11, ignore_eos=True)
    outs = run(sched, [req], {"a": stream(11)})
    # prefill (first token), then bursts of 4, 4 and the last 2: never past max_tokens
    assert [o.num_decode_steps for o in outs] == [1, 4, 4, 2]
    assert req.output_token_ids == stream(11) and req.finish_reason == "length"


def test_a_burst_gets_the_pages_of_all_its_steps_at_once():
    sched = new_scheduler(num_decode_steps=8, block_size=4, num_blocks=64)
    req = greedy_request("a", prompt_len=4, max_tokens=20, ignore_eos=True)
    sched.add_request(req)
    burst_step(sched, {"a": stream(20)})  # the prompt: 1 page
    out = burst_step(sched, {"a": stream(20)})
    assert out.num_decode_steps == 8
    # 1 page for the prompt; the burst computes positions 4..11 and ends with 12 computed tokens: 3 pages in all
    assert len(req.block_ids) == 3 and out.cached_reqs[0].new_block_ids == req.block_ids[1:]
    assert req.num_computed_tokens == 12 and req.num_tokens == 13


def test_a_stop_token_inside_a_burst_finishes_there():
    sched = new_scheduler(num_decode_steps=8)
    req = greedy_request("a", max_tokens=30)
    tokens = [1000, 1001, 1002, EOS, 1004, 1005, 1006, 1007, 1008]
    outs = run(sched, [req], {"a": tokens})
    assert outs[1].num_decode_steps == 8
    assert req.output_token_ids == [1000, 1001, 1002, EOS] and req.finish_reason == "stop"


def test_sampling_bursts_but_penalties_logprobs_stop_strings_and_waiting_requests_do_not():
    sched = new_scheduler(num_decode_steps=8)
    outs = run(sched, [greedy_request("a", max_tokens=6, ignore_eos=True, temperature=0.7, seed=1)],
               {"a": stream(6)})
    assert [o.num_decode_steps for o in outs] == [1, 5]
    for params in (dict(logprobs=2), dict(stop=["x"]), dict(repetition_penalty=1.2), dict(presence_penalty=0.5)):
        sched = new_scheduler(num_decode_steps=8)
        req = greedy_request("a", max_tokens=6, ignore_eos=True, **params)
        outs = run(sched, [req], {"a": stream(6)})
        assert all(o.num_decode_steps == 1 for o in outs), params
    # a waiting request (no slot free: max_num_seqs 1) keeps the running one to single steps
    sched = new_scheduler(num_decode_steps=8, max_num_seqs=1)
    outs = run(sched, [greedy_request("a", max_tokens=5, ignore_eos=True), greedy_request("b", max_tokens=5)],
               {"a": stream(5), "b": stream(5)})
    assert [o.num_decode_steps for o in outs] == [1] * 5 + [1, 4]


def test_every_request_of_a_burst_stops_at_its_own_limit():
    sched = new_scheduler(num_decode_steps=8, max_model_len=12)
    a = greedy_request("a", prompt_len=4, max_tokens=3, ignore_eos=True)
    b = greedy_request("b", prompt_len=4, max_tokens=50, ignore_eos=True)
    run(sched, [a, b], {"a": stream(3), "b": stream(50)})
    assert len(a.output_token_ids) == 3 and a.finish_reason == "length"
    assert b.num_tokens == 12 and b.finish_reason == "length"  # max_model_len


def test_with_prefix_caching_a_burst_saves_the_rolling_snapshot_where_single_steps_last_would():
    sched = new_scheduler(num_decode_steps=8, block_size=4, num_snapshot_slots=4)
    req = greedy_request("a", prompt_len=4, max_tokens=14, ignore_eos=True)
    outs = run(sched, [req], {"a": stream(14)})
    assert [o.num_decode_steps for o in outs] == [1, 8, 5]
    # computed 4 -> 12: the last boundary is 12, after burst step 7; computed 12 -> 17: boundary 16, after step 3
    assert [o.snapshot_save_steps for o in outs[1:]] == [[7], [3]]
    assert outs[1].snapshot_saves[0][1] == outs[2].snapshot_saves[0][1], "one rolling slot, rewritten"
    assert req.output_token_ids == stream(14)
    assert sched.cache.snapshots.num_committed == 2  # the prompt-end one, and the rolling one at the finish


def test_a_burst_save_past_a_stop_token_is_dropped():
    sched = new_scheduler(num_decode_steps=8, block_size=4, num_snapshot_slots=4)
    req = greedy_request("a", prompt_len=4, max_tokens=14)
    outs = run(sched, [req], {"a": [1000, EOS] + stream(12, 2000)})
    assert outs[1].snapshot_save_steps == [7] and req.output_token_ids == [1000, EOS]
    assert sched.cache.snapshots.num_committed == 1  # the prompt-end one only: the save at 12 came after the stop


def test_pools_refill_after_bursts_aborts_and_tight_pages():
    sched = new_scheduler(num_decode_steps=8, block_size=4, num_blocks=9, max_num_seqs=4)
    reqs = [greedy_request(str(i), prompt_len=5 + i, max_tokens=9, ignore_eos=True) for i in range(3)]
    tokens = {str(i): stream(9) for i in range(3)}
    for req in reqs:
        sched.add_request(req)
    burst_step(sched, tokens)
    sched.abort_request("1")
    while sched.has_unfinished_requests():
        burst_step(sched, tokens)
    assert_pools_full(sched)
    assert reqs[0].output_token_ids == stream(9) == reqs[2].output_token_ids
