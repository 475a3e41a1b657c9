"""Preemption by recompute changes no request's tokens: with a cache far smaller than the batch needs, requests are
preempted (some after they have generated tokens), recomputed from prompt + outputs, and finish with exactly the
tokens and logprobs they give alone; every page and slot is back in its pool at the end."""

from __future__ import annotations

from helpers.engine import PROMPT_LENS, assert_same_outputs, generate_alone, mixed_params, random_prompts, token_ids

from deltaserve import SamplingParams

BLOCK_SIZE = 16
NUM_BLOCKS = 24  # 384 tokens: the longest request (300 + 18) fits alone, the 16 prompts' 2,000 tokens do not


def run_engine(engine, prompts, params):
    """Add every request, step until all finish; returns (final outputs in order, the preemptions seen in flight:
    (request id, outputs it had generated when preempted))."""
    req_ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final, preempted = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        for req in engine.scheduler.waiting:
            if req.num_preemptions:
                preempted.add((req.req_id, len(req.output_token_ids)))
    return [final[r] for r in req_ids], preempted


def test_preempted_requests_finish_with_the_tokens_they_give_alone(make_llm):
    """Longest prompts first: the short ones admitted last are decoding when the long ones need pages."""
    prompts, params = random_prompts(PROMPT_LENS[::-1], seed=0), mixed_params(len(PROMPT_LENS))
    alone = generate_alone(make_llm(max_num_seqs=1), prompts, params)

    llm = make_llm(max_num_seqs=16, block_size=BLOCK_SIZE, num_cache_blocks=NUM_BLOCKS, max_num_batched_tokens=128)
    engine = llm.engine
    outputs, preempted = run_engine(engine, prompts, params)

    assert engine.scheduler.num_preemptions >= len(preempted) > 0
    assert any(num_outputs > 0 for _, num_outputs in preempted), "no request was preempted while decoding"
    assert_same_outputs(outputs, alone, "preempted vs alone")
    assert [len(t) for t in token_ids(outputs)] == [sp.max_tokens for sp in params]


def test_request_preempted_while_decoding_resumes_its_seeded_sampling(make_llm):
    """Four 30-token prompts fill 8 of 10 pages; at output 3 each needs a third page, so the tail requests are
    preempted after they have sampled tokens, and recomputed from prompt + outputs."""
    prompts = random_prompts((30, 30, 30, 30), seed=1)
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(4)]
    alone = generate_alone(make_llm(max_num_seqs=1), prompts, params)
    llm = make_llm(max_num_seqs=4, block_size=BLOCK_SIZE, num_cache_blocks=10)
    outputs, preempted = run_engine(llm.engine, prompts, params)
    assert {req_id for req_id, num_outputs in preempted if num_outputs > 0}, preempted
    assert token_ids(outputs) == token_ids(alone)


def test_one_chunk_per_step_budget_under_preemption(make_llm):
    """The smallest cache that admits the longest request, and a budget of one 16-token chunk a step."""
    prompts, params = random_prompts((300, 150, 64, 1, 17), seed=5), mixed_params(5, min_tokens=10)
    alone = generate_alone(make_llm(max_num_seqs=1), prompts, params)
    most_pages = max(-(-(len(p) + sp.max_tokens - 1) // BLOCK_SIZE) for p, sp in zip(prompts, params))
    llm = make_llm(max_num_seqs=4, block_size=BLOCK_SIZE, num_cache_blocks=most_pages, max_num_batched_tokens=16)
    outputs, _ = run_engine(llm.engine, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same_outputs(outputs, alone, "tightest cache vs alone")


def test_request_preempted_mid_prompt_keeps_its_prompt_logprobs_in_order(make_llm):
    """A decode that needs a page preempts the tail request part-way through its prompt, after some of its prompt
    logprobs were returned; its recompute from position 0 must not append those positions a second time."""
    prompts = random_prompts((31, 100), seed=7)
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=1)]
    alone = generate_alone(make_llm(max_num_seqs=1), prompts, params)
    llm = make_llm(max_num_seqs=2, block_size=BLOCK_SIZE, num_cache_blocks=7, max_num_batched_tokens=16)
    outputs, preempted = run_engine(llm.engine, prompts, params)
    assert ("1", 0) in preempted, preempted
    assert len(outputs[1].prompt_logprobs) == len(prompts[1])
    assert_same_outputs(outputs, alone, "preempted mid-prompt vs alone")
