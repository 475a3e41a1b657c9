"""Prefix caching on a GPU: float32 gives the tokens of no caching over a multi-turn chat (snapshots saved and
restored on the device, fla-free exact path); in bfloat16 (fla prefill, CUDA-graph decode) a turn with nothing
cached gives the tokens of no caching up to near ties, and later turns hit. Skipped without CUDA."""

import pytest
import torch
from helpers.engine import assert_same_up_to_near_ties

from deltaserve import LLM, SamplingParams
from deltaserve.entrypoints.make_tiny import make_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def chat(llm, num_turns=5, logprobs=None):
    """Two conversations in lockstep: 48-token openings (whole blocks), then 21 new tokens a turn after 12-token
    answers. Returns each turn's (answers, cached tokens), and with logprobs the first turn's outputs."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 512, (48,), generator=gen).tolist() for _ in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=logprobs)
    turns, first = [], None
    for _ in range(num_turns):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        first = first or [o.outputs[0] for o in outs]
        turns.append(([o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]))
        prompts = [o.prompt_token_ids + o.outputs[0].token_ids + torch.randint(5, 512, (21,), generator=gen).tolist()
                   for o in outs]
    return (turns, first) if logprobs else turns


def test_float32_prefix_caching_matches_no_caching(tiny):
    torch.backends.cuda.matmul.allow_tf32 = False
    off = chat(LLM(tiny, device="cuda", dtype="float32", max_model_len=512, enable_prefix_caching=False))
    on = chat(LLM(tiny, device="cuda", dtype="float32", max_model_len=512, enable_prefix_caching=True))
    assert [answers for answers, _ in on] == [answers for answers, _ in off]
    assert all(cached > 0 for _, hits in on[1:] for cached in hits)


def test_bfloat16_first_turn_matches_up_to_near_ties_and_later_turns_hit(tiny):
    """With caching on, the 48-token prompts are computed as 32 + 16 (a snapshot at the last block boundary before
    the prompt's last token, which a hit leaves to compute): fla's chunked prefill then rounds otherwise in bf16, so
    the first turn equals no caching only up to near ties (float32 above checks the states bit for bit)."""
    _, off = chat(LLM(tiny, device="cuda", dtype="bfloat16", max_model_len=512, enable_prefix_caching=False), 1, 8)
    on, first = chat(LLM(tiny, device="cuda", dtype="bfloat16", max_model_len=512, enable_prefix_caching=True),
                     logprobs=8)
    for got, expected in zip(first, off):
        assert_same_up_to_near_ties(got, expected, TIE=0.3)
    assert all(cached > 0 for _, hits in on[1:] for cached in hits)
