"""Chained decode bursts (asynchronous scheduling): the scheduler plans the next burst before the one in flight is
applied, and the outcome is that of unchained bursts (scheduler with a fake runner that, like the real one, fixes
a burst's tokens when it is queued; the model's tokens in test_engine_bursts.py)."""

from scheduler_harness import EOS, assert_pools_full, make_request, new_scheduler
from test_decode_bursts import run, stream

from deltaserve.core.outputs import RunnerOutput


def launch(sched, out, tokens, num_pending: int = 0) -> dict[str, list[int]]:
    """What the fake runner samples for `out` when it is queued: each finishing request's next tokens from `tokens`,
    one a step, after the num_pending that the burst in flight computes for it."""
    sampled = {}
    for req_id, n in out.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        if out.chained or req.num_computed_tokens + n == req.num_tokens:
            done = len(req.output_token_ids) + num_pending
            sampled[req_id] = tokens[req_id][done: done + out.num_decode_steps]
    return sampled


def run_chained(sched, reqs, tokens, between=None):
    """The engine's loop with asynchronous scheduling: take the burst in flight or schedule, chain the next burst
    (queued before this one's tokens are applied), then apply this one. between(step index) runs after each step,
    where a caller of Engine.step() could abort. Returns every step's SchedulerOutput."""
    for req in reqs:
        sched.add_request(req)
    outs, inflight = [], None
    while sched.has_unfinished_requests():
        assert len(outs) < 500
        if inflight is not None:
            (out, sampled), inflight = inflight, None
        else:
            out = sched.schedule()
            sampled = launch(sched, out, tokens)
        chained = sched.schedule_chained(out)
        if chained is not None:
            inflight = chained, launch(sched, chained, tokens, out.num_decode_steps)
        sched.update_from_output(out, RunnerOutput(list(out.num_scheduled_tokens), sampled))
        outs.append(out)
        if between is not None:
            between(len(outs) - 1)
    if inflight is not None:  # every request of it has left (the engine applies it at its next step)
        sched.update_from_output(inflight[0], RunnerOutput(list(inflight[0].num_scheduled_tokens), inflight[1]))
    assert_pools_full(sched)
    snapshots = sched.cache.snapshots
    if snapshots is not None:  # every snapshot slot is free or committed: none held by a departed request
        assert snapshots.pool.num_free_slots + snapshots.num_committed == snapshots.num_slots
    return outs


def greedy(req_id: str, **params):
    return make_request(req_id, **{"temperature": 0, **params})


def test_chained_bursts_follow_each_burst_and_give_the_unchained_outcome():
    lengths = {"a": (6, 11), "b": (3, 30), "c": (9, 17)}  # prompt, max_tokens
    tokens = {r: stream(n, 1000 * (i + 1)) for i, (r, (_, n)) in enumerate(lengths.items())}
    results = []
    for chained in (False, True):
        sched = new_scheduler(num_decode_steps=4, block_size=4, num_blocks=64)
        reqs = [greedy(r, prompt_len=p, max_tokens=n, ignore_eos=True) for r, (p, n) in lengths.items()]
        outs = (run_chained if chained else run)(sched, reqs, tokens)
        results.append([(r.output_token_ids, r.finish_reason) for r in reqs])
    assert results[0] == results[1]
    # prefill, one burst, then chained bursts until a request ends by length at the end of the one in flight
    assert [(o.num_decode_steps, o.chained) for o in outs[:4]] == [(1, False), (4, False), (4, True), (2, True)]
    assert results[1][0] == (stream(11, 1000), "length")


def test_a_chained_burst_gets_the_pages_after_both_bursts_and_starts_where_the_first_ends():
    sched = new_scheduler(num_decode_steps=8, block_size=4, num_blocks=64)
    req = greedy("a", prompt_len=4, max_tokens=40, ignore_eos=True)
    sched.add_request(req)
    tokens = {"a": stream(40)}
    first = sched.schedule()
    sched.update_from_output(first, RunnerOutput(["a"], launch(sched, first, tokens)))
    burst = sched.schedule()
    chained = sched.schedule_chained(burst)
    assert burst.num_decode_steps == 8 and chained.chained and chained.num_decode_steps == 8
    # the burst computes positions 4..11, the chained one 12..19: 20 computed tokens, 5 pages in all
    assert chained.cached_reqs[0].num_computed_tokens == 12 and len(req.block_ids) == 5
    assert chained.cached_reqs[0].new_block_ids == req.block_ids[3:]


def test_no_chain_when_a_request_waits_or_ends_in_the_burst_in_flight_or_the_step_is_not_a_burst():
    sched = new_scheduler(num_decode_steps=4, block_size=4, num_blocks=64, max_num_seqs=2)
    for req in (greedy("a", max_tokens=20, ignore_eos=True), greedy("b", max_tokens=5, ignore_eos=True)):
        sched.add_request(req)
    prefill = sched.schedule()
    assert sched.schedule_chained(prefill) is None  # a prefill step: its tokens are the next step's inputs
    sched.update_from_output(prefill, RunnerOutput(["a", "b"], {"a": [1], "b": [1]}))
    burst = sched.schedule()
    assert burst.num_decode_steps == 4
    assert sched.schedule_chained(burst) is None  # b reaches max_tokens 5 at the burst's end
    sched.update_from_output(burst, RunnerOutput(["a", "b"], {"a": stream(4), "b": stream(4)}))
    assert sched.requests.get("b") is None
    burst = sched.schedule()
    sched.add_request(greedy("c"))
    assert sched.schedule_chained(burst) is None  # c waits: it gets in at the next step
    sched.update_from_output(burst, RunnerOutput(["a"], {"a": stream(4)}))
    sched.abort_request("a")
    sched.abort_request("c")
    assert_pools_full(sched)


def test_a_stop_token_in_the_burst_in_flight_ends_the_request_and_drops_the_chained_tokens():
    sched = new_scheduler(num_decode_steps=4, block_size=4, num_blocks=64)
    a = greedy("a", max_tokens=30)
    b = greedy("b", prompt_len=7, max_tokens=30, ignore_eos=True)
    tokens = {"a": [1000, 1001, 1002, 1003, 1004, EOS] + stream(20, 2000), "b": stream(30, 3000)}
    outs = run_chained(sched, [a, b], tokens)
    assert a.output_token_ids == tokens["a"][:6] and a.finish_reason == "stop"
    assert b.output_token_ids == tokens["b"] and b.finish_reason == "length"
    assert any(o.chained and "a" in o.num_scheduled_tokens for o in outs[3:])  # computed past its stop, dropped


def test_aborts_while_a_chained_burst_is_in_flight_leave_the_others_exact_and_the_pools_full():
    sched = new_scheduler(num_decode_steps=4, block_size=4, num_blocks=64, num_snapshot_slots=8)
    reqs = [greedy(str(i), prompt_len=5 + i, max_tokens=24, ignore_eos=True) for i in range(3)]
    tokens = {str(i): stream(24, 1000 * i) for i in range(3)}

    def abort(index):
        if index == 3:
            sched.abort_request("1")

    outs = run_chained(sched, reqs, tokens, between=abort)
    assert reqs[0].output_token_ids == tokens["0"] and reqs[2].output_token_ids == tokens["2"]
    assert reqs[1].finish_reason == "abort"
    assert any(o.chained and "1" not in o.num_scheduled_tokens for o in outs[4:])  # the chain went on without it


def test_chained_bursts_save_the_rolling_snapshot_where_unchained_ones_do():
    runs = {}
    for chained in (False, True):
        sched = new_scheduler(num_decode_steps=8, block_size=4, num_snapshot_slots=4)
        req = greedy("a", prompt_len=4, max_tokens=22, ignore_eos=True)
        outs = (run_chained if chained else run)(sched, [req], {"a": stream(22)})
        runs[chained] = [(o.num_decode_steps, o.snapshot_save_steps) for o in outs], sched
    assert runs[True][0] == runs[False][0] == [(1, []), (8, [7]), (8, [7]), (5, [3])]
    for _, sched in runs.values():
        assert sched.cache.snapshots.num_committed == 2  # the prompt-end one, and the rolling one at the finish


def test_a_stop_before_a_chained_save_drops_the_rolling_snapshot_it_overwrites():
    """The chained burst rewrites the rolling slot (after the stop's position): it cannot be published."""
    sched = new_scheduler(num_decode_steps=8, block_size=4, num_snapshot_slots=4)
    req = greedy("a", prompt_len=4, max_tokens=30)
    tokens = {"a": stream(10) + [EOS] + stream(19, 2000)}
    outs = run_chained(sched, [req], tokens)
    assert req.output_token_ids == tokens["a"][:11] and req.finish_reason == "stop"
    assert outs[2].chained and outs[2].snapshot_save_steps  # the save in flight when the stop was read
    assert sched.cache.snapshots.num_committed == 1  # the prompt-end one only
