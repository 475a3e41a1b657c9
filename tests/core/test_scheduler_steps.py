"""One kind of step, at the scheduler with a fake runner (the model's tokens: test_engine_bursts.py and
test_engine_async.py). Lookahead: when every running request decodes, the scheduler gives each the pages of several
decode steps and the runner returns that many tokens. A step in flight: schedule() runs before the step before it is
applied (asynchronous scheduling), and the outcome is that of synchronous steps."""

import pytest
from scheduler_harness import EOS, assert_pools_full, make_request, new_scheduler

from deltaserve.runner_output import RunnerOutput


def launch(sched, out, tokens: dict[str, list[int]]) -> dict[str, list[int]]:
    """What the fake runner samples for `out` when it is queued (right after schedule()): for each request whose
    chunk reaches the end of its tokens (it has pending outputs now), its next 1 + lookahead tokens from `tokens`,
    after those of the steps before, applied or in flight. Checks, as the runner does, that each snapshot save lies
    where the step reaches: inside its request's chunk (one at most), at its end, or at one of its lookahead steps."""
    starts, request_of = out.start_positions(), {sched.requests[r].state_slot: r for r in out.num_scheduled_tokens}
    inside = []
    for state_slot, _, position in out.snapshot_saves:
        req_id = request_of[state_slot]
        chunk_end = starts[req_id] + out.num_scheduled_tokens[req_id]
        assert starts[req_id] < position <= chunk_end + out.num_lookahead_tokens.get(req_id, 0), (req_id, position)
        inside += [req_id] if position < chunk_end else []
    assert len(inside) == len(set(inside)), out.snapshot_saves
    sampled = {}
    for req_id in out.num_scheduled_tokens:
        req = sched.requests[req_id]
        if req.num_pending_outputs:
            steps = 1 + out.num_lookahead_tokens.get(req_id, 0)
            done = len(req.output_token_ids) + req.num_pending_outputs - steps
            sampled[req_id] = tokens[req_id][done: done + steps]
    return sampled


def run(sched, reqs, tokens, ahead: bool = False, between=None):
    """The engine's loop: take the step in flight or schedule one; with `ahead`, schedule and queue the next before
    applying this one. between(step index) runs after each step, where a caller of Engine.step() could abort.
    Returns every step's SchedulerOutput, in the order they were applied."""
    for req in reqs:
        sched.add_request(req)
    outs, inflight = [], None
    while sched.has_unfinished_requests() or inflight is not None:
        assert len(outs) < 500, "no progress"
        if inflight is not None:
            (out, sampled), inflight = inflight, None
        else:
            out = sched.schedule()
            sampled = launch(sched, out, tokens)
        if ahead and sched.has_unfinished_requests():
            nxt = sched.schedule()
            if nxt.num_scheduled_tokens:
                inflight = nxt, launch(sched, nxt, tokens)
        sched.update_from_output(out, RunnerOutput(list(out.num_scheduled_tokens), sampled))
        outs.append(out)
        if between is not None:
            between(len(outs) - 1)
    assert_pools_full(sched)
    snapshots = sched.cache.snapshots
    if snapshots is not None:  # every snapshot slot is free or committed: none held by a departed request
        assert snapshots.pool.num_free_slots + snapshots.num_committed == snapshots.num_slots
    return outs


def greedy(req_id: str, **params):
    return make_request(req_id, **{"temperature": 0, **params})


def stream(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def steps_of(out) -> int:
    return 1 + max(out.num_lookahead_tokens.values(), default=0)


@pytest.mark.parametrize("ahead", [False, True])
def test_greedy_decodes_look_ahead_within_max_tokens(ahead):
    sched = new_scheduler(num_decode_steps=4, block_size=4, num_blocks=64)
    req = greedy("a", prompt_len=6, max_tokens=11, ignore_eos=True)
    outs = run(sched, [req], {"a": stream(11)}, ahead)
    # prefill (first token), then 4, 4 and the last 2: never past max_tokens
    assert [steps_of(o) for o in outs] == [1, 4, 4, 2]
    assert req.output_token_ids == stream(11) and req.finish_reason == "length"


def test_lookahead_gets_the_pages_of_all_its_steps_at_once():
    sched = new_scheduler(num_decode_steps=8, block_size=4, num_blocks=64)
    req = greedy("a", prompt_len=4, max_tokens=20, ignore_eos=True)
    sched.add_request(req)
    prompt = sched.schedule()
    sched.update_from_output(prompt, RunnerOutput(["a"], {"a": [1000]}))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1} and out.num_lookahead_tokens == {"a": 7}
    # 1 page for the prompt; the step computes positions 4..11 and ends with 12 computed tokens: 3 pages in all
    assert len(req.block_ids) == 3 and out.cached_reqs[0].new_block_ids == req.block_ids[1:]
    assert req.num_computed_tokens == 12 and req.num_pending_outputs == 8
    sched.update_from_output(out, RunnerOutput(["a"], {"a": stream(8, 1001)}))
    assert req.num_tokens == 13 and req.num_pending_outputs == 0


@pytest.mark.parametrize("ahead", [False, True])
def test_a_stop_token_inside_lookahead_finishes_there(ahead):
    sched = new_scheduler(num_decode_steps=8)
    req = greedy("a", max_tokens=30)
    outs = run(sched, [req], {"a": [1000, 1001, 1002, EOS] + stream(20, 2000)}, ahead)
    assert steps_of(outs[1]) == 8
    assert req.output_token_ids == [1000, 1001, 1002, EOS] and req.finish_reason == "stop"


def test_sampling_looks_ahead_but_penalties_logprobs_stop_strings_and_waiting_requests_do_not():
    sched = new_scheduler(num_decode_steps=8)
    outs = run(sched, [greedy("a", max_tokens=6, ignore_eos=True, temperature=0.7, seed=1)], {"a": stream(6)})
    assert [steps_of(o) for o in outs] == [1, 5]
    for params in (dict(logprobs=2), dict(stop=["x"]), dict(repetition_penalty=1.2), dict(presence_penalty=0.5)):
        sched = new_scheduler(num_decode_steps=8)
        outs = run(sched, [greedy("a", max_tokens=6, ignore_eos=True, **params)], {"a": stream(6)})
        assert all(steps_of(o) == 1 for o in outs), params
    # a waiting request (no slot free: max_num_seqs 1) keeps the running one to single steps
    sched = new_scheduler(num_decode_steps=8, max_num_seqs=1)
    outs = run(sched, [greedy("a", max_tokens=5, ignore_eos=True), greedy("b", max_tokens=5)],
               {"a": stream(5), "b": stream(5)})
    assert [steps_of(o) for o in outs] == [1] * 5 + [1, 4]


@pytest.mark.parametrize("ahead", [False, True])
def test_every_request_stops_at_its_own_limit(ahead):
    sched = new_scheduler(num_decode_steps=8, max_model_len=12)
    a = greedy("a", prompt_len=4, max_tokens=3, ignore_eos=True)
    b = greedy("b", prompt_len=4, max_tokens=50, ignore_eos=True)
    run(sched, [a, b], {"a": stream(3), "b": stream(50)}, ahead)
    assert a.output_token_ids == stream(3) and a.finish_reason == "length"
    assert b.num_tokens == 12 and b.finish_reason == "length"  # max_model_len


@pytest.mark.parametrize("ahead", [False, True])
def test_the_rolling_snapshot_is_saved_at_the_last_boundary_a_step_reaches(ahead):
    sched = new_scheduler(num_decode_steps=8, block_size=4, num_snapshot_slots=4)
    req = greedy("a", prompt_len=5, max_tokens=22, ignore_eos=True)
    outs = run(sched, [req], {"a": stream(22)}, ahead)
    # the prompt in one step, then 8, 8 and the last 5 decode steps
    assert [steps_of(o) for o in outs] == [1, 8, 8, 5]
    # computed 5 -> 13 -> 21 -> 26: saves at 4 (the prompt-end one, inside the prompt's chunk), 12, 20 and 24
    assert [[save[2] for save in o.snapshot_saves] for o in outs] == [[4], [12], [20], [24]]
    slots = [o.snapshot_saves[0][1] for o in outs if o.snapshot_saves]
    assert slots[0] not in slots[1:], "the prompt-end snapshot is never rewritten"
    assert len(set(slots[1:])) == 1, "one rolling slot, rewritten"
    assert req.output_token_ids == stream(22)
    assert sched.cache.snapshots.num_committed == 2  # the prompt-end one, and the rolling one at the finish


@pytest.mark.parametrize("ahead", [False, True])
def test_a_save_past_a_stop_token_is_dropped_with_the_rolling_snapshot_it_overwrites(ahead):
    sched = new_scheduler(num_decode_steps=8, block_size=4, num_snapshot_slots=4)
    req = greedy("a", prompt_len=5, max_tokens=30)
    outs = run(sched, [req], {"a": stream(10) + [EOS] + stream(19, 2000)}, ahead)
    assert req.output_token_ids == stream(10) + [EOS] and req.finish_reason == "stop"
    assert [save[2] for save in outs[2].snapshot_saves] == [20]  # after the stop (token 15), from dropped inputs
    # the prompt-end one only: the rolling one at 12 was being overwritten by the save at 20
    assert sched.cache.snapshots.num_committed == 1


@pytest.mark.parametrize("ahead", [False, True])
def test_pools_refill_after_lookahead_aborts_and_tight_pages(ahead):
    sched = new_scheduler(num_decode_steps=8, block_size=4, num_blocks=9, max_num_seqs=4, num_snapshot_slots=4)
    reqs = [greedy(str(i), prompt_len=5 + i, max_tokens=9, ignore_eos=True) for i in range(3)]
    tokens = {str(i): stream(9) for i in range(3)}
    run(sched, reqs, tokens, ahead, between=lambda i: i == 0 and sched.abort_request("1"))
    assert reqs[0].output_token_ids == stream(9) == reqs[2].output_token_ids
    assert reqs[1].finish_reason == "abort"


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("snapshots, shared", [(0, True), (8, False), (8, True)])
def test_steps_in_flight_give_the_outcome_of_synchronous_steps(steps, snapshots, shared):
    """Mixed prompts (chunked by the budget), stops, limits, more requests than slots, aborts, and a cache small
    enough to preempt: the same tokens, finish reasons and full pools, with or without a step in flight. shared:
    the prompts are 1..len, each beginning with the shorter ones, so that with prefix caching (snapshots) a request
    waits for a running one's prompt; else each request has prompt ids of its own (nothing waits, and the cache
    preempts)."""
    def requests():
        reqs = [greedy("a", prompt_len=6, max_tokens=11, ignore_eos=True),
                greedy("b", prompt_len=19, max_tokens=30),
                greedy("c", prompt_len=9, max_tokens=17, ignore_eos=True),
                greedy("d", prompt_len=3, max_tokens=25, ignore_eos=True),
                greedy("e", prompt_len=14, max_tokens=20, ignore_eos=True)]
        for i, req in enumerate(reqs if not shared else ()):
            req.prompt_token_ids = [t + 100 * (i + 1) for t in req.prompt_token_ids]  # never EOS (99)
        return reqs

    tokens = {r: stream(40, 1000 * (i + 1)) for i, r in enumerate("abcde")}
    tokens["b"][13] = EOS
    results = []
    for ahead in (False, True):
        sched = new_scheduler(num_decode_steps=steps, block_size=4, num_blocks=16, max_num_seqs=3,
                              max_num_batched_tokens=8, num_snapshot_slots=snapshots)
        reqs = requests()
        run(sched, reqs, tokens, ahead, between=lambda i: i == 9 and sched.abort_request("d"))
        results.append([(r.output_token_ids, r.finish_reason) for r in reqs])
        if snapshots and shared:
            assert sum(r.num_cached_tokens for r in reqs) > 0
        else:
            assert sched.num_preemptions > 0
    assert results[0] == results[1]


def test_a_request_that_ends_in_the_step_in_flight_is_not_scheduled_again():
    sched = new_scheduler(num_decode_steps=1)
    a = greedy("a", prompt_len=4, max_tokens=2, ignore_eos=True)
    b = greedy("b", prompt_len=4, max_tokens=5, ignore_eos=True)
    for req in (a, b):
        sched.add_request(req)
    first = sched.schedule()  # both prompts
    second = sched.schedule()  # ahead: both decode their first token
    assert set(second.num_scheduled_tokens) == {"a", "b"}
    assert second.cached_reqs[0].num_computed_tokens == 4  # it starts where the step in flight ends
    third = sched.schedule()  # a's second token (its last) is in flight: b alone
    assert third.num_scheduled_tokens == {"b": 1}
    for out, sampled in ((first, {"a": [1], "b": [2]}), (second, {"a": [3], "b": [4]}), (third, {"b": [5]})):
        sched.update_from_output(out, RunnerOutput(list(out.num_scheduled_tokens), sampled))
    assert a.output_token_ids == [1, 3] and a.finish_reason == "length"
    assert b.output_token_ids == [2, 4, 5] and b.num_pending_outputs == 0
    sched.abort_request("b")
    assert_pools_full(sched)


def test_a_request_whose_sampling_reads_its_outputs_is_scheduled_ahead_without_lookahead():
    """(The runner samples it once the step before is applied.)"""
    sched = new_scheduler(num_decode_steps=8)
    sched.add_request(greedy("a", max_tokens=5, ignore_eos=True, repetition_penalty=1.2))
    sched.add_request(greedy("b", max_tokens=5, ignore_eos=True))
    first = sched.schedule()
    ahead = sched.schedule()
    assert ahead.num_scheduled_tokens == {"a": 1, "b": 1} and not ahead.num_lookahead_tokens
    sched.update_from_output(first, RunnerOutput(["a", "b"], {"a": [1000], "b": [2000]}))
    sched.update_from_output(ahead, RunnerOutput(["a", "b"], {"a": [1001], "b": [2001]}))
    for req_id in "ab":
        sched.abort_request(req_id)


def test_a_request_preempted_with_a_step_in_flight_gets_its_tokens_and_waits_for_them():
    sched = new_scheduler(num_decode_steps=1, block_size=4, num_blocks=3, max_num_seqs=2)
    a = greedy("a", prompt_len=4, max_tokens=8, ignore_eos=True)
    b = greedy("b", prompt_len=4, max_tokens=8, ignore_eos=True)
    for req in (a, b):
        sched.add_request(req)
    first = sched.schedule()  # 2 pages for 2 prompts; 1 free
    second = sched.schedule()  # ahead: a takes the free page, b gets none and is preempted
    assert second.num_scheduled_tokens == {"a": 1} and b.status.value == "preempted"
    assert b.num_pending_outputs == 1
    sched.abort_request("a")
    assert not sched.schedule().new_reqs  # pages to spare, but b waits for its token in flight
    sched.update_from_output(first, RunnerOutput(["a", "b"], {"a": [1000], "b": [2000]}))
    assert b.output_token_ids == [2000] and b.num_pending_outputs == 0
    sched.update_from_output(second, RunnerOutput(["a"], {"a": [1001]}))
    readmitted = sched.schedule()
    assert readmitted.new_reqs[0].token_ids == [1, 2, 3, 4, 2000]  # recomputed from all its tokens
    sched.abort_request("b")
    assert_pools_full(sched)


def test_a_runner_that_returns_the_wrong_number_of_tokens_is_caught():
    sched = new_scheduler(num_decode_steps=4)
    sched.add_request(greedy("a", max_tokens=9, ignore_eos=True))
    out = sched.schedule()
    sched.update_from_output(out, RunnerOutput(["a"], {"a": [1000]}))
    out = sched.schedule()
    assert out.num_lookahead_tokens == {"a": 3}
    with pytest.raises(RuntimeError, match="owed 4"):
        sched.update_from_output(out, RunnerOutput(["a"], {"a": [1001]}))


@pytest.mark.parametrize("ahead", [False, True])
def test_snapshot_slots_freed_by_preemptions_keep_every_save_where_its_step_reaches(ahead):
    """Found in review (when chunks were cut at snapshot positions): a preemption in the same step freed a snapshot
    slot after a recomputed prompt's chunk had been planned without a save, and a save was then planned inside the
    chunk. launch() checks every save's position: inside its chunk (one at most), at its end, or in its lookahead."""
    sched = new_scheduler(block_size=2, num_blocks=13, max_num_seqs=3, max_num_batched_tokens=9, num_snapshot_slots=2)
    reqs = [greedy("1", prompt_len=3, max_tokens=6, ignore_eos=True),
            greedy("2", prompt_len=19, max_tokens=6, ignore_eos=True),
            greedy("4", prompt_len=10, max_tokens=6, ignore_eos=True)]
    run(sched, reqs, {r.req_id: stream(10) for r in reqs}, ahead)
    assert sched.num_preemptions > 0 and all(r.output_token_ids == stream(6) for r in reqs)


@pytest.mark.parametrize("new_prompt_len", [6, 5])
def test_an_id_given_again_while_the_old_request_has_a_step_in_flight_names_a_new_request(new_prompt_len):
    """Found in review: the old request's next step, applied after the id was given to a new request, credited its
    token to the new one (same length) or failed the step (another length)."""
    sched = new_scheduler()
    sched.add_request(greedy("a", prompt_len=4, max_tokens=10))
    first = sched.schedule()  # a's prompt: samples its first token
    second = sched.schedule()  # ahead: a decodes its second
    sched.update_from_output(first, RunnerOutput(["a"], {"a": [EOS]}))  # a stops
    new = greedy("a", prompt_len=new_prompt_len, max_tokens=10, ignore_eos=True)
    sched.add_request(new)  # the id is free again
    assert sched.update_from_output(second, RunnerOutput(["a"], {"a": [1234]})) == []
    assert new.output_token_ids == [] and new.num_pending_outputs == 0
    run(sched, [], {"a": stream(10)})
    assert new.output_token_ids == stream(10)


def test_steps_are_applied_once_each_in_the_order_they_were_scheduled():
    sched = new_scheduler()
    sched.add_request(greedy("a", max_tokens=4, ignore_eos=True))
    first = sched.schedule()  # a's prompt
    sched.add_request(greedy("b", max_tokens=4, ignore_eos=True))
    second = sched.schedule()  # a decodes, b's prompt
    with pytest.raises(RuntimeError, match="not the oldest one scheduled"):
        sched.update_from_output(second, RunnerOutput(["a", "b"], {"a": [2], "b": [1]}))
    sched.update_from_output(first, RunnerOutput(["a"], {"a": [1]}))
    sched.update_from_output(second, RunnerOutput(["a", "b"], {"a": [2], "b": [1]}))
    with pytest.raises(RuntimeError, match="not the oldest one scheduled"):
        sched.update_from_output(second, RunnerOutput(["a", "b"], {"a": [2], "b": [1]}))
    for req_id in "ab":
        sched.abort_request(req_id)


def test_a_step_never_applied_whose_requests_were_aborted_is_set_aside():
    """A step that failed on the runner is never applied; once its requests are aborted, the next steps apply."""
    sched = new_scheduler()
    sched.add_request(greedy("a", max_tokens=4, ignore_eos=True))
    sched.schedule()  # the runner fails it
    sched.abort_request("a")
    run(sched, [greedy("b", max_tokens=4, ignore_eos=True)], {"b": stream(4)}, ahead=True)
    assert sched.requests == {}
