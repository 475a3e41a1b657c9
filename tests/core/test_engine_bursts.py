"""Lookahead decode steps (bursts) give the tokens of one decode step at a time: in float32 on the CPU, greedy and
seeded sampled requests (together, with stop tokens inside lookahead, with and without prefix caching) produce the
same outputs with num_decode_steps 1, 3 and 8, and the lookahead did run."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers.engine import as_inputs, assert_same_outputs, random_prompts, record_steps, token_ids

from deltaserve import SamplingParams

LENGTHS = (1, 5, 16, 17, 40, 63, 100)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_bursts_give_the_tokens_of_single_steps(make_llm, prefix_caching):
    prompts = random_prompts(LENGTHS, seed=3)
    params = [SamplingParams(max_tokens=20 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    outputs = {}
    for steps in (1, 3, 8):
        llm = make_llm(num_decode_steps=steps, enable_prefix_caching=prefix_caching, max_num_seqs=8)
        seen = record_steps(llm)
        outputs[steps] = llm.generate(as_inputs(prompts), params, use_tqdm=False)
        assert max(steps for steps, _ in seen) == steps
        assert [len(t) for t in token_ids(outputs[steps])] == [p.max_tokens for p in params]
    assert_same_outputs(outputs[3], outputs[1], "bursts of 3 vs single steps")
    assert_same_outputs(outputs[8], outputs[1], "bursts of 8 vs single steps")


def test_a_stop_token_inside_a_burst_ends_the_request_there(make_llm):
    (prompt,) = random_prompts((30,), seed=5)
    single = make_llm(num_decode_steps=1).generate(
        as_inputs([prompt]), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    stop = single.outputs[0].token_ids[5]  # the 6th token: inside the first burst of 8
    first = single.outputs[0].token_ids.index(stop)
    params = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop])
    for steps in (1, 8):
        out = make_llm(num_decode_steps=steps).generate(as_inputs([prompt]), params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == single.outputs[0].token_ids[:first + 1]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_min_tokens_lifts_its_mask_at_the_right_lookahead_step(make_llm):
    """A greedy and a seeded request whose stop tokens fall inside the first burst: with min_tokens = i the stop at
    output i still ends the greedy one there (its mask covers outputs 0..i-1 only), with more it is masked; bursts
    give the tokens of single steps, and min_tokens keeps the lookahead on."""
    prompts = random_prompts((30, 9), seed=5)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)]
    single, bursts = make_llm(num_decode_steps=1), make_llm(num_decode_steps=8)
    free = token_ids(single.generate(as_inputs(prompts), params, use_tqdm=False))
    stops = [ids[5] for ids in free]  # the 6th tokens: inside the first burst of 8
    first = free[0].index(stops[0])
    seen = record_steps(bursts)
    for min_tokens in (first, first + 1, first + 4):
        limited = [replace(p, stop_token_ids=[stop], min_tokens=min_tokens) for p, stop in zip(params, stops)]
        expected = single.generate(as_inputs(prompts), limited, use_tqdm=False)
        got = bursts.generate(as_inputs(prompts), limited, use_tqdm=False)
        assert token_ids(got) == token_ids(expected), min_tokens
        assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
        for out, stop in zip(token_ids(got), stops):
            assert stop not in out[:min_tokens]
        assert (token_ids(got)[0] == free[0][: first + 1]) == (min_tokens == first)
    assert max(steps for steps, _ in seen) == 8


def test_streaming_a_burst_yields_its_tokens_together(make_llm):
    (prompt,) = random_prompts((12,), seed=6)
    llm = make_llm(num_decode_steps=4, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    counts = [len(o.outputs[0].token_ids) for o in llm.stream(as_inputs([prompt]), params)]
    assert counts == [1, 5, 9]  # the prefill's token, then two bursts of 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_follow_up_finds_the_rolling_snapshot_a_burst_saved(make_llm, async_scheduling):
    """A chat's next turn extends prompt + output: with bursts it restores from the same block boundary (the rolling
    KDA snapshot saved inside lookahead steps; with asynchronous scheduling, inside steps in flight, which rewrite the
    rolling slot in place) and gives the same tokens as with single steps."""
    (prompt,) = random_prompts((37,), seed=7)
    results = {}
    for steps in (1, 8):
        llm = make_llm(num_decode_steps=steps, async_scheduling=async_scheduling and steps > 1)
        first = llm.generate(as_inputs([prompt]), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0]
        follow_up = prompt + first.outputs[0].token_ids + [3, 4, 5]
        second = llm.generate(as_inputs([follow_up]), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0]
        results[steps] = (first.outputs[0].token_ids, second.outputs[0].token_ids, second.num_cached_tokens)
    assert results[8] == results[1]
    assert results[8][2] == (37 + 30 - 1) // 16 * 16  # the last boundary the first turn's tokens reached


def test_seeded_sampling_in_bursts_gives_the_tokens_of_single_steps(make_llm):
    prompts = random_prompts((3, 20, 41, 64), seed=8)
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=19, temperature=1.2, top_k=20, min_p=0.05, seed=12, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=17, temperature=0.5, seed=13, ignore_eos=True)]
    outputs = {}
    for steps in (1, 8):
        llm = make_llm(num_decode_steps=steps)
        seen = record_steps(llm)
        outputs[steps] = llm.generate(as_inputs(prompts), params, use_tqdm=False)
        assert max(steps for steps, _ in seen) == steps
    assert_same_outputs(outputs[8], outputs[1], "seeded sampling: bursts of 8 vs single steps")
