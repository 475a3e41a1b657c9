"""Engine.step_totals: every step counted once by kind (decode: one token a request; prefill: with a prompt chunk),
its tokens exactly those computed (each request's prompt, then its outputs but the last, lookahead included), in
every step mode, and time counted only while a step runs."""

from __future__ import annotations

import time

import pytest
from helpers.engine import as_inputs, random_prompts

from deltaserve import SamplingParams

LENGTHS = (1, 7, 16, 33)


@pytest.mark.parametrize("steps,async_scheduling", [(1, False), (3, False), (8, True)])
def test_step_totals_count_each_step_and_its_tokens_by_kind(make_llm, steps, async_scheduling):
    prompts = random_prompts(LENGTHS, seed=11)
    params = [SamplingParams(max_tokens=4 + 5 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    llm = make_llm(num_decode_steps=steps, async_scheduling=async_scheduling, max_num_batched_tokens=24)
    llm.generate(as_inputs(prompts), params, use_tqdm=False)
    decode, prefill = llm.engine.step_totals["decode"], llm.engine.step_totals["prefill"]
    # a 1-token prompt computes like a decode: its step may count as one
    assert prefill.tokens + decode.tokens == sum(LENGTHS) + sum(p.max_tokens - 1 for p in params)
    assert prefill.tokens >= sum(LENGTHS) - 1 and prefill.steps >= 3  # 57 prompt tokens, 24 a step
    assert decode.steps >= (max(p.max_tokens for p in params) - 1) // steps
    assert decode.seconds > 0 and prefill.seconds > 0


def test_idle_time_between_steps_is_not_counted(make_llm):
    llm = make_llm()
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate(as_inputs(random_prompts((5,), seed=1)), params, use_tqdm=False)
    busy = llm.engine.step_totals["decode"].seconds + llm.engine.step_totals["prefill"].seconds
    time.sleep(0.5)
    llm.generate(as_inputs(random_prompts((5,), seed=2)), params, use_tqdm=False)
    both = llm.engine.step_totals["decode"].seconds + llm.engine.step_totals["prefill"].seconds
    assert both - busy < 0.5, "the idle half second went into a step's time"
