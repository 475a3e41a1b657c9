"""Continuous batching changes no request's tokens: in float32, a request gives the same tokens (and logprobs, to
rounding) whatever else runs beside it, for every kind of sampling: a seeded request draws from its own generator,
and batching changes its logits by rounding only."""

from __future__ import annotations

import pytest
from helpers.engine import (
    PROMPT_LENS,
    as_inputs,
    assert_same_outputs,
    generate_alone,
    mixed_params,
    random_prompts,
    token_ids,
)

from deltaserve import SamplingParams


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENS, seed=0)


@pytest.fixture(scope="module")
def params():
    return mixed_params(len(PROMPT_LENS))


def test_sixteen_mixed_requests_together_give_what_each_gives_alone(make_llm, prompts, params):
    llm = make_llm(max_num_seqs=16)
    together = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    alone = generate_alone(llm, prompts, params)
    assert_same_outputs(together, alone, "together vs alone")
    assert [len(t) for t in token_ids(together)] == [sp.max_tokens for sp in params]
    assert [o.prompt_token_ids for o in together] == prompts
    assert [o.prompt_logprobs is not None for o in together] == [sp.prompt_logprobs is not None for sp in params]


def test_batch_order_and_slot_reuse_change_nothing(make_llm, prompts, params):
    """Reversed order, max_num_seqs 5 (slots and pages reused as requests finish), several calls in a row."""
    llm = make_llm(max_num_seqs=16)
    expected = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    small = make_llm(max_num_seqs=5, max_num_batched_tokens=256)
    reversed_outputs = small.generate(as_inputs(prompts[::-1]), params[::-1], use_tqdm=False)[::-1]
    assert_same_outputs(reversed_outputs, expected, "reversed, 5 at a time")
    again = small.generate(as_inputs(prompts), params, use_tqdm=False)
    assert_same_outputs(again, expected, "second call on a reused engine")


def test_seeded_request_same_alone_and_in_any_batch(make_llm):
    llm = make_llm(max_num_seqs=8)
    target, *others = random_prompts((37, 1, 90, 150, 12), seed=3)
    seeded = SamplingParams(temperature=1.5, seed=1234, max_tokens=24, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.5, max_tokens=20, ignore_eos=True)
    alone = token_ids(llm.generate(as_inputs([target]), seeded, use_tqdm=False))[0]

    first = llm.generate(as_inputs([target] + others), [seeded] + [unseeded] * 4, use_tqdm=False)
    last = llm.generate(as_inputs(others + [target, target]), [unseeded] * 4 + [seeded, seeded], use_tqdm=False)
    assert token_ids(first)[0] == alone
    assert token_ids(last)[-2:] == [alone, alone]

    other_seed = SamplingParams(temperature=1.5, seed=4321, max_tokens=24, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    controls = llm.generate(as_inputs([target, target]), [other_seed, greedy], use_tqdm=False)
    assert alone not in token_ids(controls), "the seed should decide the tokens; this test would prove nothing"
