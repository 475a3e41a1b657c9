"""Asynchronous scheduling (one step in flight while the next is scheduled and queued) gives the tokens of synchronous
steps: in float32 on the CPU, greedy and seeded sampled requests, with and without lookahead decode steps and prefix
caching, stop tokens and stop strings, an abort while a step is in flight, admissions and preemptions while one
is, prompt logprobs over chunked prefill, and penalties (whose requests wait for their tokens); and steps were in
fact scheduled ahead. A chat's follow-up turn: test_engine_bursts.py."""

from __future__ import annotations

import pytest
from helpers.engine import as_inputs, assert_same_outputs, random_prompts, record_steps

from deltaserve import SamplingParams


def ahead_steps(seen: list[tuple[int, bool]]) -> list[int]:
    """The decode steps (1 + lookahead) of each step scheduled while the one before it was in flight."""
    return [steps for steps, ahead in seen if ahead]


def test_async_scheduling_is_off_on_the_cpu_unless_asked(make_llm):
    assert not make_llm().engine.async_scheduling
    assert make_llm(async_scheduling=True).engine.async_scheduling


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_steps_in_flight_give_the_tokens_of_synchronous_steps(make_llm, prefix_caching):
    prompts = random_prompts((1, 5, 17, 40, 63, 100), seed=3)
    params = [SamplingParams(max_tokens=20 + 3 * i, temperature=0, ignore_eos=True) for i in range(3)]
    params += [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
               SamplingParams(max_tokens=19, temperature=1.2, top_k=20, min_p=0.05, seed=12, ignore_eos=True),
               SamplingParams(max_tokens=30, temperature=0.5, seed=13, ignore_eos=True)]
    single = make_llm(num_decode_steps=1, enable_prefix_caching=prefix_caching, max_num_seqs=8)
    expected = single.generate(as_inputs(prompts), params, use_tqdm=False)
    for steps in (1, 3, 8):
        llm = make_llm(num_decode_steps=steps, enable_prefix_caching=prefix_caching, max_num_seqs=8,
                       async_scheduling=True)
        seen = record_steps(llm)
        got = llm.generate(as_inputs(prompts), params, use_tqdm=False)
        assert ahead_steps(seen) and max(ahead_steps(seen)) == steps
        assert_same_outputs(got, expected, f"{steps} decode steps a step, one in flight, vs single steps")


def test_a_stop_token_while_the_next_step_is_in_flight_ends_the_request_there(make_llm):
    prompts = random_prompts((30, 9), seed=5)
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    single = make_llm(num_decode_steps=1).generate(as_inputs(prompts), free, use_tqdm=False)
    tokens = single[0].outputs[0].token_ids
    stop = tokens[12]  # with 8 decode steps a step: in the second, while the third is in flight
    first = tokens.index(stop)
    params = [SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop]), free]
    for steps in (1, 8):
        llm = make_llm(num_decode_steps=steps, async_scheduling=True)
        seen = record_steps(llm)
        out = llm.generate(as_inputs(prompts), params, use_tqdm=False)
        assert ahead_steps(seen)
        assert out[0].outputs[0].token_ids == tokens[:first + 1]
        assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop
        assert out[1].outputs[0].token_ids == single[1].outputs[0].token_ids  # the other went on, exact


def test_a_stop_string_with_a_step_in_flight_ends_the_text_where_synchronous_steps_do(make_llm):
    """A stop string is found by the detokenizer after its step is applied, while the next step (scheduled with
    logprobs and stop strings allowed: they need no token on the host to sample) computes one more token: dropped."""
    (prompt,) = random_prompts((25,), seed=14)
    llm = make_llm(num_decode_steps=4)
    free = llm.generate(as_inputs([prompt]), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = free.text[len(free.text) // 2:][:3]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop], logprobs=2)
    expected = llm.generate(as_inputs([prompt]), params, use_tqdm=False)[0].outputs[0]
    pipelined = make_llm(num_decode_steps=4, async_scheduling=True)
    seen = record_steps(pipelined)
    got = pipelined.generate(as_inputs([prompt]), params, use_tqdm=False)[0].outputs[0]
    assert ahead_steps(seen) and max(ahead_steps(seen)) == 1  # logprobs and stop strings: no lookahead
    assert expected.finish_reason == "stop" and expected.stop_reason == stop
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
        expected.text, expected.token_ids, expected.finish_reason, expected.stop_reason)
    assert [sorted(d) for d in got.logprobs] == [sorted(d) for d in expected.logprobs]


def test_an_abort_while_a_step_is_in_flight_leaves_the_others_exact(make_llm):
    prompts = random_prompts((12, 33, 20), seed=9)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = make_llm(num_decode_steps=1).generate(as_inputs(prompts), params, use_tqdm=False)
    for steps in (1, 4):
        llm = make_llm(num_decode_steps=steps, async_scheduling=True)
        engine = llm.engine
        ids = [engine.add_request(p, params) for p in prompts]
        final, aborted = {}, False
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            if engine._inflight is not None and not aborted:
                engine.abort(ids[1])
                aborted = True
        assert aborted and ids[1] not in final
        for i in (0, 2):
            assert final[ids[i]].outputs[0].token_ids == expected[i].outputs[0].token_ids
        # the engine is idle and takes new work: the same prompt again gives the same tokens
        again = llm.generate(as_inputs(prompts[:1]), params, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == expected[0].outputs[0].token_ids


def run_engine(engine) -> dict:
    """Step until idle; the final output of each request, by id."""
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    return final


def test_an_id_given_again_while_its_old_request_has_a_step_in_flight_gets_only_its_own_tokens(make_llm):
    """Found in review: the old request's next step, applied after the id went to a new request, gave the new one
    its token, or failed (and a prompt chunk's logprobs went to the new request's prompt)."""
    prompt, other = random_prompts((9, 40), seed=2)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=1)
    llm = make_llm(async_scheduling=True, num_decode_steps=1, max_num_batched_tokens=16)
    expected = llm.generate(as_inputs([other]), greedy, use_tqdm=False)[0]
    stop = llm.generate(as_inputs([prompt]), greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop]), request_id="x")
    while not any(o.finished for o in engine.step()):  # x stops at its first token, its next step in flight
        pass
    assert engine._inflight is not None
    engine.add_request(other, greedy, request_id="x")
    got = run_engine(engine)["x"]
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    # an abort while a prompt chunk (with prompt logprobs) is in flight, and the id given again at once
    engine.add_request(other, greedy, request_id="y")
    engine.step()
    assert engine._inflight is not None
    engine.abort("y")
    engine.add_request(other, greedy, request_id="y")
    got = run_engine(engine)["y"]
    assert_same_outputs([got], [expected], "an id given again")


def test_a_step_that_fails_on_the_runner_leaves_the_engine_serving(make_llm, monkeypatch):
    prompts = random_prompts((12, 30), seed=17)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm = make_llm(async_scheduling=True, num_decode_steps=4)
    expected = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    submit, calls = llm.engine.runner.submit, []

    def failing(sched):
        calls.append(1)
        if len(calls) == 3:  # a step scheduled ahead
            raise RuntimeError("device lost")
        return submit(sched)

    monkeypatch.setattr(llm.engine.runner, "submit", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(as_inputs(prompts), params, use_tqdm=False)
    assert_same_outputs(llm.generate(as_inputs(prompts), params, use_tqdm=False), expected, "after a failed step")


def test_prompt_logprobs_chunked_prefill_and_admissions_with_a_step_in_flight_stay_exact(make_llm):
    """Prompts split by a small token budget, more requests than sequences (later ones admitted while a step runs),
    prompt logprobs: the steps after prompt chunks and the admissions are scheduled ahead, and change nothing."""
    prompts = random_prompts((70, 23, 41, 9, 55), seed=12)
    params = [SamplingParams(max_tokens=21, temperature=0, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=17, temperature=0.9, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(max_tokens=15, temperature=0.7, seed=5, ignore_eos=True)]
    options = dict(max_num_batched_tokens=32, max_num_seqs=3)
    expected = make_llm(num_decode_steps=1, **options).generate(as_inputs(prompts), params, use_tqdm=False)
    llm = make_llm(num_decode_steps=8, async_scheduling=True, **options)
    scheduler, admitted_ahead = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        ahead = any(r.num_pending_outputs for r in scheduler.running)
        out = schedule()
        admitted_ahead.append(ahead and bool(out.new_reqs))
        return out

    scheduler.schedule = recording
    got = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    assert any(admitted_ahead)
    assert_same_outputs(got, expected, "steps in flight over chunked prefill vs single steps")


def test_preemptions_with_a_step_in_flight_keep_every_token(make_llm):
    """A cache of a few pages: requests are preempted while their last step runs; they get its tokens when it is
    applied, and are recomputed from all of them."""
    prompts = random_prompts((20, 31, 26, 14), seed=15)
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)] * 2
    options = dict(num_cache_blocks=12, max_num_seqs=4, enable_prefix_caching=False)
    sync = make_llm(num_decode_steps=1, **options)
    expected = sync.generate(as_inputs(prompts), params, use_tqdm=False)
    assert sync.engine.scheduler.num_preemptions > 0
    for steps in (1, 4):
        llm = make_llm(num_decode_steps=steps, async_scheduling=True, **options)
        got = llm.generate(as_inputs(prompts), params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        assert_same_outputs(got, expected, f"preempted with {steps} decode steps a step in flight")


def test_penalized_requests_are_sampled_once_the_step_before_is_applied_and_stay_exact(make_llm):
    """Penalties count the outputs on the host: a step scheduled ahead runs its forward pass at once and samples a
    penalised request only once the step before is applied (PendingOutput.launch); the tokens are those of
    synchronous steps, the steps were scheduled ahead, and none had lookahead. The penalties favour tokens already
    seen (below 1, negative), so that leaving out the token in flight changes what is sampled next."""
    prompts = random_prompts((18, 33, 25, 9), seed=16)
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=0.2),
              SamplingParams(max_tokens=40, temperature=0.6, seed=8, ignore_eos=True, frequency_penalty=-2.0),
              SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, presence_penalty=-2.0),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)]
    expected = make_llm(num_decode_steps=8).generate(as_inputs(prompts), params, use_tqdm=False)
    llm = make_llm(num_decode_steps=8, async_scheduling=True)
    seen = record_steps(llm)
    got = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    assert ahead_steps(seen) and max(ahead_steps(seen)) == 1
    assert_same_outputs(got, expected, "penalties, asynchronous vs synchronous")


class StagingRecorder:
    """Stands in for DecodeGraphs (computing eagerly) and records which staging block (side, stage) each replay would
    fill; a block may be filled again only after the step that filled it last has been waited for (result())."""

    def __init__(self, runner):
        self.runner, self.held, self.violations, self.current = runner, {}, [], 0

    def can_run(self, host):
        return all(n == 1 for n in host.query_lens)

    def run(self, host, input_ids=None, stage=0, side=0):
        if (side, stage) in self.held:
            self.violations.append((side, stage, self.held[side, stage], self.current))
        self.held[side, stage] = self.current
        ids, batch = host.to_device(self.runner.device)
        hidden = self.runner.model(ids if input_ids is None else input_ids, batch, self.runner.caches)
        return self.runner.model.compute_logits(hidden)


def test_graph_staging_blocks_are_refilled_only_after_the_step_that_used_them_was_waited_for(make_llm, monkeypatch):
    """Found in review: a one-token-a-request step staged on side 0, and the step queued after it before its sync
    staged on side 0 too: its copies could read the later step's positions. Steps alternate sides."""
    from deltaserve.runner import model_runner, step_sampler

    submit, result = model_runner.ModelRunner.submit, step_sampler.PendingOutput.result

    def recording_submit(self, sched):
        self.graphs.current += 1
        pending = submit(self, sched)
        pending.step = self.graphs.current
        pending.recorder = self.graphs
        return pending

    def recording_result(self):
        recorder = getattr(self, "recorder", None)
        if recorder is not None:  # every block filled by this step or one before it is free again
            recorder.held = {key: step for key, step in recorder.held.items() if step > self.step}
        return result(self)

    monkeypatch.setattr(model_runner.ModelRunner, "submit", recording_submit)
    monkeypatch.setattr(step_sampler.PendingOutput, "result", recording_result)
    for steps in (1, 8):
        llm = make_llm(num_decode_steps=steps, async_scheduling=True, enable_prefix_caching=False)
        recorder = llm.engine.runner.graphs = StagingRecorder(llm.engine.runner)
        seen = record_steps(llm)
        llm.generate(as_inputs([[5 + i] for i in range(4)]), SamplingParams(max_tokens=20, temperature=0,
                                                                          ignore_eos=True), use_tqdm=False)
        assert ahead_steps(seen)
        assert not recorder.violations, recorder.violations[:3]


def test_a_step_with_prompt_chunks_is_queued_only_once_the_step_before_is_applied(make_llm, monkeypatch):
    """Its eager launch would hold back the step before's tokens (the first tokens of a batch of prompts); decode
    steps are still queued while the step before is in flight. The tokens are those of synchronous steps."""
    prompts = random_prompts((40, 3, 27, 9, 50), seed=21)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = dict(max_num_batched_tokens=16, max_num_seqs=3)
    expected = make_llm(**options).generate(as_inputs(prompts), params, use_tqdm=False)
    llm = make_llm(async_scheduling=True, **options)
    runner, scheduler, queued = llm.engine.runner, llm.engine.scheduler, []
    submit, update = runner.submit, scheduler.update_from_output
    counts = {"submitted": 0, "applied": 0}

    def submitting(sched):
        if sched.num_scheduled_tokens:
            in_flight = counts["submitted"] - counts["applied"]
            queued.append((max(sched.num_scheduled_tokens.values()) > 1, in_flight))
            counts["submitted"] += 1
        return submit(sched)

    def applying(sched, out):
        counts["applied"] += bool(sched.num_scheduled_tokens)
        return update(sched, out)

    monkeypatch.setattr(runner, "submit", submitting)
    monkeypatch.setattr(scheduler, "update_from_output", applying)
    got = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    assert_same_outputs(got, expected, "one step in flight, prompt chunks queued after the step before")
    assert all(in_flight == 0 for chunks, in_flight in queued if chunks), queued
    assert sum(1 for chunks, in_flight in queued if chunks) >= 5 and (False, 1) in queued, queued


def test_a_failure_applying_a_step_still_queues_the_prompt_chunks_scheduled_ahead(make_llm, monkeypatch):
    """The scheduler counts a held step's tokens as computed when it schedules it, so the step is queued even when
    applying the step before fails (a detokenizer error here); the other request then finishes with its tokens."""
    llm = make_llm(async_scheduling=True, max_num_batched_tokens=16, max_num_seqs=4, num_decode_steps=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = random_prompts((5, 60), seed=1)
    expected = make_llm().generate(as_inputs(prompts[1:]), params, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request(prompts[0], params, request_id="a")
    engine.step()
    engine.step()
    engine.add_request(prompts[1], params, request_id="b")  # its 16-token chunks are scheduled ahead and held
    engine.step()
    detokenize, failed = engine._detokenize, []

    def failing(tracked, new_ids):
        if not failed and tracked.request.req_id == "a":
            failed.append(engine.scheduler.requests["b"].num_computed_tokens)
            raise RuntimeError("detokenizer failed")
        return detokenize(tracked, new_ids)

    monkeypatch.setattr(engine, "_detokenize", failing)
    with pytest.raises(RuntimeError, match="detokenizer failed"):
        engine.step()
    assert failed and failed[0] < 60, "it failed while b's prompt was still in chunks"
    engine.abort("a")
    done = {}
    for _ in range(100):
        done.update((out.request_id, out) for out in engine.step() if out.finished)
        if not engine.has_unfinished_requests():
            break
    assert done["b"].outputs[0].token_ids == expected
