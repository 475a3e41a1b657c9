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
    # caching off: its snapshot saves split the KDA layers' pass inside each prompt, and the reference is whole
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


def test_a_long_contexts_prefill_in_key_blocks_gives_the_tokens_of_the_whole(make_llm, prompts, params, monkeypatch):
    """Past EXPANDED_PREFILL_MAX_KEYS of context, MLA's prefill expands and attends its keys a block at a time (a
    1M-token context would not fit expanded at once); scaled down here so chunks of 64 reach it at 48 keys with
    blocks of 16: blocks wholly before a chunk, straddling its start and inside it. The same tokens, and logprobs
    to rounding (the blocks' softmaxes are merged by their log-sum-exps, in another order of sums)."""
    from deltaserve.layers import mla

    whole = make_llm(max_num_seqs=len(prompts), max_num_batched_tokens=64, enable_prefix_caching=False)
    expected = whole.generate(as_inputs(prompts), params, use_tqdm=False)
    monkeypatch.setattr(mla, "EXPANDED_PREFILL_MAX_KEYS", 48)
    monkeypatch.setattr(mla, "PREFILL_KEY_BLOCK", 16)
    blocks = []  # (keys of the block, its first position)
    attend = mla.mla_prefill_block
    monkeypatch.setattr(mla, "mla_prefill_block", lambda *args: blocks.append((args[2].shape[0], args[-1]))
                        or attend(*args))
    llm = make_llm(max_num_seqs=len(prompts), max_num_batched_tokens=64, enable_prefix_caching=False)
    assert_same_outputs(llm.generate(as_inputs(prompts), params, use_tqdm=False), expected, "key blocks vs whole")
    assert max(n for n, _ in blocks) == 16 and max(pos for _, pos in blocks) >= 256  # the 300-token prompt's
