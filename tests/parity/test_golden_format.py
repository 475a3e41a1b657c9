"""The golden file `parity capture` writes: the issue's JSON format, and what its numbers mean."""

import math

import pytest
import torch
from helpers.reference import reference_greedy, reference_logits

from deltaserve.parity.golden import load_golden


@pytest.fixture(scope="module")
def reference(captured):
    from transformers import KimiLinearForCausalLM

    return KimiLinearForCausalLM.from_pretrained(captured.model, dtype=torch.float32).eval()


def test_golden_has_the_issue_format(captured):
    raw = captured.load()
    assert isinstance(raw["model"], str) and raw["reference"] == "transformers" and raw["dtype"] == "float32"
    assert len(raw["prompts"]) == captured.num_prompts
    for p in raw["prompts"]:
        assert len(p["prompt_token_ids"]) == captured.prompt_len
        assert len(p["output_token_ids"]) == len(p["top2"]) == captured.max_tokens
        for token, (id1, id2, margin) in zip(p["output_token_ids"], p["top2"]):
            assert isinstance(id1, int) and isinstance(id2, int) and isinstance(margin, float)
            assert id1 == token != id2 and margin >= 0


def test_golden_tokens_and_margins_are_the_references(captured, reference):
    """Output tokens are transformers' own greedy generate; margins and log-probabilities its logits'."""
    for p in load_golden(captured.golden).prompts:
        assert p.output_token_ids == reference_greedy(reference, p.prompt_token_ids, captured.max_tokens)
        logits = reference_logits(reference, p.prompt_token_ids + p.output_token_ids[:-1])[captured.prompt_len - 1:]
        top = logits.topk(2, dim=-1).values
        assert [m for _, _, m in p.top2] == pytest.approx((top[:, 0] - top[:, 1]).tolist(), abs=1e-4)
        logprobs = logits.log_softmax(-1)
        for ids, lps, row in zip(p.ref_topk_ids, p.ref_topk_logprobs, logprobs):
            assert lps == pytest.approx(row[ids].tolist(), abs=1e-4)
            assert math.fsum(math.exp(v) for v in lps) == pytest.approx(1.0, abs=1e-4)  # topk = the whole vocab


def test_random_prompts_are_reproducible_from_the_seed(captured, tmp_path):
    from deltaserve.parity.prompts import random_prompts

    first = [p.prompt_token_ids for p in load_golden(captured.golden).prompts]
    assert random_prompts(captured.num_prompts, captured.prompt_len, 256, seed=0) == first
    assert random_prompts(captured.num_prompts, captured.prompt_len, 256, seed=1) != first
