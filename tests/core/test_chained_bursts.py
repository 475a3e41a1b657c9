"""Chained decode bursts (asynchronous scheduling): the scheduler plans the next burst before the one in flight is
applied, and the outcome is that of unchained bursts (scheduler with a fake runner that, like the real one, fixes
a burst's tokens when it is queued; the model's tokens in test_engine_bursts.py)."""

from scheduler_harness import EOS, assert_pools_full, make_request, new_scheduler
from test_decode_bursts import run, stream

from deltaserve.runner_output import RunnerOutput


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
    # the prefill, then chained bursts only: a's 11th token ends the third (1 + 4 + 4 + 2), and the chain goes on
    # without it
    assert [(o.num_decode_steps, o.chained) for o in outs[:5]] == [(1, False), (4, True), (4, True), (2, True),
                                                                    (4, True)]
    assert "a" in outs[3].num_scheduled_tokens and "a" not in outs[4].num_scheduled_tokens
    assert all(o.chained for o in outs[1:])
    assert results[1][0] == (stream(11, 1000), "length")


def test_a_chained_burst_gets_the_pages_after_both_steps_and_starts_where_the_first_ends():
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


def test_a_chain_that_cannot_have_all_its_pages_takes_none():
    """Pages given to some requests of a chain that is then dropped would never reach the runner, whose block tables
    would fall behind the scheduler's (found in review: an IndexError, or writes to another page)."""
    sched = new_scheduler(num_decode_steps=4, block_size=4, num_blocks=5)
    reqs = [greedy(r, prompt_len=4, max_tokens=12, ignore_eos=True) for r in "ab"]
    for req in reqs:
        sched.add_request(req)
    told = {}  # the block tables the runner has been sent

    def tell(out):
        told.update((new.req_id, list(new.block_ids)) for new in out.new_reqs)
        for cached in out.cached_reqs:
            told[cached.req_id].extend(cached.new_block_ids)

    prompt = sched.schedule()
    tell(prompt)
    burst = sched.schedule_chained(prompt)  # pages for 4 tokens each: one more page each, 4 of 5 in use
    tell(burst)
    sched.update_from_output(prompt, RunnerOutput(["a", "b"], {"a": [1000], "b": [2000]}))
    free = sched.cache.num_free_blocks
    assert sched.schedule_chained(burst) is None  # the next 4 tokens need a page each, and one is free
    assert sched.cache.num_free_blocks == free
    sched.update_from_output(burst, RunnerOutput(["a", "b"], {"a": stream(4, 1001), "b": stream(4, 2001)}))
    tell(sched.schedule())  # a's pages at the cost of b's (preempted)
    assert all(told[r.req_id] == r.block_ids for r in reqs if r.block_ids)
    for req in reqs:
        sched.abort_request(req.req_id)
    assert_pools_full(sched)


def test_no_chain_after_a_prompt_chunk_short_of_its_end_nor_while_one_waits_and_none_for_who_ends_in_flight():
    sched = new_scheduler(num_decode_steps=4, block_size=4, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=8)
    a = greedy("a", prompt_len=10, max_tokens=20, ignore_eos=True)
    sched.add_request(a)
    chunk = sched.schedule()
    assert chunk.num_scheduled_tokens == {"a": 8}
    assert sched.schedule_chained(chunk) is None  # a has no token to feed a burst yet
    sched.update_from_output(chunk, RunnerOutput(["a"], {"a": []}))
    last_chunk = sched.schedule()
    chained = sched.schedule_chained(last_chunk)  # the prompt's end samples its first token: a burst may follow
    assert chained.chained and chained.num_decode_steps == 4 and chained.cached_reqs[0].num_computed_tokens == 10
    sched.update_from_output(last_chunk, RunnerOutput(["a"], {"a": [1000]}))
    sched.add_request(greedy("b", prompt_len=3, max_tokens=5, ignore_eos=True))
    assert sched.schedule_chained(chained) is None  # b waits: it gets in at the next step
    sched.update_from_output(chained, RunnerOutput(["a"], {"a": stream(4, 1001)}))
    both = sched.schedule()  # a decodes, b's prompt: both sample
    burst = sched.schedule_chained(both)
    assert burst.num_decode_steps == 4 and set(burst.num_scheduled_tokens) == {"a", "b"}
    sched.update_from_output(both, RunnerOutput(["a", "b"], {"a": [1005], "b": [2000]}))
    without_b = sched.schedule_chained(burst)  # b reaches max_tokens 5 at that burst's end: a goes on alone
    assert without_b.num_scheduled_tokens == {"a": 1} and without_b.cached_reqs[0].num_computed_tokens == 19
    sched.update_from_output(burst, RunnerOutput(["a", "b"], {"a": stream(4, 1006), "b": stream(4, 2001)}))
    assert "b" not in sched.requests and a.output_token_ids == stream(10, 1000)
    sched.update_from_output(without_b, RunnerOutput(["a"], {"a": stream(4, 1010)}))
    assert a.output_token_ids == stream(14, 1000)
    sched.abort_request("a")
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
        slots = [o.snapshot_saves[0][1] for o in outs]
        assert slots[0] not in slots[1:], "the prompt-end snapshot is never rewritten"
        assert len(set(slots[1:])) == 1, "one rolling slot, rewritten"
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
