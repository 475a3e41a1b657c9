"""Asynchronous scheduling (chained decode bursts) gives the tokens of one decode step at a time: in float32 on the
CPU, greedy and seeded sampled requests, stop tokens inside a burst and an abort while a chained burst is in flight,
against single steps; and the chained bursts did run. A chat's follow-up turn: test_engine_bursts.py."""

from __future__ import annotations

import pytest
from helpers.engine import as_inputs, assert_same_outputs, random_prompts

from deltaserve import SamplingParams


def count_chains(llm) -> list[int]:
    """Wrap the scheduler to record the steps of each chained burst it plans."""
    scheduler = llm.engine.scheduler
    seen, chain = [], scheduler.schedule_chained

    def recording(inflight):
        out = chain(inflight)
        if out is not None:
            seen.append(out.num_decode_steps)
        return out

    scheduler.schedule_chained = recording
    return seen


def test_async_scheduling_is_off_on_the_cpu_unless_asked(make_llm):
    assert not make_llm().engine.async_scheduling
    assert make_llm(async_scheduling=True).engine.async_scheduling


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_chained_bursts_give_the_tokens_of_single_steps(make_llm, prefix_caching):
    prompts = random_prompts((1, 5, 17, 40, 63, 100), seed=3)
    params = [SamplingParams(max_tokens=20 + 3 * i, temperature=0, ignore_eos=True) for i in range(3)]
    params += [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
               SamplingParams(max_tokens=19, temperature=1.2, top_k=20, min_p=0.05, seed=12, ignore_eos=True),
               SamplingParams(max_tokens=30, temperature=0.5, seed=13, ignore_eos=True)]
    single = make_llm(num_decode_steps=1, enable_prefix_caching=prefix_caching, max_num_seqs=8)
    expected = single.generate(as_inputs(prompts), params, use_tqdm=False)
    for steps in (3, 8):
        llm = make_llm(num_decode_steps=steps, enable_prefix_caching=prefix_caching, max_num_seqs=8,
                       async_scheduling=True)
        chains = count_chains(llm)
        got = llm.generate(as_inputs(prompts), params, use_tqdm=False)
        assert chains and max(chains) == steps
        assert_same_outputs(got, expected, f"chained bursts of {steps} vs single steps")


def test_a_stop_token_before_a_chained_burst_ends_the_request_there(make_llm):
    prompts = random_prompts((30, 9), seed=5)
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    single = make_llm(num_decode_steps=1).generate(as_inputs(prompts), free, use_tqdm=False)
    tokens = single[0].outputs[0].token_ids
    stop = tokens[12]  # in the second burst of 8, while the third is chained
    first = tokens.index(stop)
    params = [SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop]), free]
    llm = make_llm(num_decode_steps=8, async_scheduling=True)
    chains = count_chains(llm)
    out = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    assert chains
    assert out[0].outputs[0].token_ids == tokens[:first + 1]
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop
    assert out[1].outputs[0].token_ids == single[1].outputs[0].token_ids  # the other went on, exact


def test_an_abort_while_a_chained_burst_is_in_flight_leaves_the_others_exact(make_llm):
    prompts = random_prompts((12, 33, 20), seed=9)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = make_llm(num_decode_steps=1).generate(as_inputs(prompts), params, use_tqdm=False)
    llm = make_llm(num_decode_steps=4, async_scheduling=True)
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


def test_a_burst_chained_after_the_prompts_last_chunk_keeps_prompt_logprobs_and_chunked_prefill_exact(make_llm):
    """The burst after a step where every request samples (here prompts' last chunks, split by a small token budget,
    with prompt logprobs asked) is chained too, and changes nothing."""
    prompts = random_prompts((70, 23, 41), seed=12)
    params = [SamplingParams(max_tokens=21, temperature=0, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=17, temperature=0.9, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]
    expected = make_llm(num_decode_steps=1, max_num_batched_tokens=32).generate(
        as_inputs(prompts), params, use_tqdm=False)
    llm = make_llm(num_decode_steps=8, max_num_batched_tokens=32, async_scheduling=True)
    scheduler = llm.engine.scheduler
    after, chain = [], scheduler.schedule_chained
    scheduler.schedule_chained = lambda s: after.append((s.num_decode_steps > 1 or s.chained,
                                                          (out := chain(s)) is not None)) or out
    got = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    assert (False, True) in after  # a burst chained after a step that was not a burst
    assert_same_outputs(got, expected, "chained after the prompt vs single steps")


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
    """Found in review: a one-token-a-request step that is not a burst (one-token prompts) staged on side 0, and the
    burst chained after it, queued before the step's sync, staged on side 0 too: its copies could read the burst's
    positions. Steps and bursts alternate sides now."""
    from deltaserve.runner import model_runner

    submit, result = model_runner.ModelRunner.submit, model_runner.PendingOutput.result

    def recording_submit(self, sched, inflight=None):
        self.graphs.current += 1
        pending = submit(self, sched, inflight)
        pending.step = self.graphs.current
        pending.recorder = self.graphs
        return pending

    def recording_result(self):
        recorder = getattr(self, "recorder", None)
        if recorder is not None:  # every block filled by this step or one before it is free again
            recorder.held = {key: step for key, step in recorder.held.items() if step > self.step}
        return result(self)

    monkeypatch.setattr(model_runner.ModelRunner, "submit", recording_submit)
    monkeypatch.setattr(model_runner.PendingOutput, "result", recording_result)
    for steps in (1, 8):
        llm = make_llm(num_decode_steps=steps, async_scheduling=True, enable_prefix_caching=False)
        recorder = llm.engine.runner.graphs = StagingRecorder(llm.engine.runner)
        chains = count_chains(llm)
        llm.generate(as_inputs([[5 + i] for i in range(4)]), SamplingParams(max_tokens=20, temperature=0,
                                                                          ignore_eos=True), use_tqdm=False)
        assert chains
        assert not recorder.violations, recorder.violations[:3]
