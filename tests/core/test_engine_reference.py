"""Greedy requests served in a busy engine (sampled requests beside them, chunked prefill, a cache small enough to
preempt) give exactly the tokens of transformers' generate on the same checkpoint."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", minversion="5.23")

from helpers.engine import as_inputs, random_prompts, token_ids  # noqa: E402
from helpers.reference import SPECS, build_reference, reference_greedy  # noqa: E402

from deltaserve import SamplingParams  # noqa: E402

GREEDY_LENS = (1, 17, 64, 65, 150)
NUM_TOKENS = 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(transformers model, the folder save_pretrained wrote) of the hybrid KDA + MLA spec."""
    model = build_reference(SPECS["hybrid"], seed=7)
    folder = tmp_path_factory.mktemp("reference") / "hybrid"
    model.save_pretrained(folder)
    return model, folder


def test_greedy_in_a_mixed_preempting_batch_equals_transformers_generate(make_llm, reference):
    model, folder = reference
    vocab = model.config.vocab_size
    greedy_prompts = random_prompts(GREEDY_LENS, vocab_size=vocab, seed=8, low=3)
    sampled_prompts = random_prompts((90, 30, 120), vocab_size=vocab, seed=9, low=3)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    sampled = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=24, ignore_eos=True) for i in range(3)]
    requests = [(p, greedy) for p in greedy_prompts]
    for i, (prompt, sp) in enumerate(zip(sampled_prompts, sampled)):
        requests.insert(2 * i + 1, (prompt, sp))  # greedy, sampled, greedy, sampled, ...
    prompts, params = [r[0] for r in requests], [r[1] for r in requests]

    llm = make_llm(folder, max_num_seqs=8, block_size=8, num_cache_blocks=30, max_num_batched_tokens=40)
    outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, sp, tokens in zip(prompts, params, token_ids(outputs)):
        if sp is greedy:
            assert tokens == reference_greedy(model, prompt, NUM_TOKENS), f"prompt of {len(prompt)} tokens"
