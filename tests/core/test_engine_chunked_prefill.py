"""Chunked prefill carries the KDA state and the MLA cache across chunks exactly: with a token budget that cuts
prompts into chunks of 1, 7 or 64 tokens, every request gives the tokens (and prompt logprobs) of a prefill of
its whole prompt in one step."""

from __future__ import annotations

import pytest
from helpers.engine import as_inputs, assert_same_outputs, mixed_params, random_prompts

PROMPT_LENS = (300, 129, 65, 64, 63, 8, 7, 6, 1)  # the first admitted is served first: its chunks fill the budget


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(PROMPT_LENS, seed=2)


@pytest.fixture(scope="module")
def params():
    return mixed_params(len(PROMPT_LENS), min_tokens=4, prompt_logprobs=2)


def record_schedules(llm) -> list[dict[str, int]]:
    """Every step's {request id: scheduled tokens}, recorded from the engine's scheduler from now on."""
    scheduler, steps = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        steps.append(dict(out.num_scheduled_tokens))
        return out

    scheduler.schedule = recording
    return steps


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_gives_the_tokens_of_a_whole_prompt_prefill(make_llm, prompts, params, chunk):
    # caching off: it would end each prompt's first chunk at its last full block (see test_prefix_caching.py)
    whole = make_llm(max_num_seqs=len(prompts), max_num_batched_tokens=2048, enable_prefix_caching=False)
    steps_whole = record_schedules(whole)
    expected = whole.generate(as_inputs(prompts), params, use_tqdm=False)
    assert steps_whole[0] == {str(i): len(p) for i, p in enumerate(prompts)}, "every prompt in the first step"

    llm = make_llm(max_num_seqs=len(prompts), max_num_batched_tokens=chunk, enable_prefix_caching=False)
    steps = record_schedules(llm)
    outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    assert_same_outputs(outputs, expected, f"chunks of {chunk} vs whole prompts")
    assert max(sum(step.values()) for step in steps) == chunk
    first_len = len(prompts[0])
    first_chunks = [step["0"] for step in steps if "0" in step][: -(-first_len // chunk)]
    assert first_chunks == [chunk] * (first_len // chunk) + [first_len % chunk] * (first_len % chunk > 0)
