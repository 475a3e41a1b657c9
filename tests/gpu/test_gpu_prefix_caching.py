"""Prefix caching on a GPU: float32 gives the tokens of no caching over a multi-turn chat (snapshots saved and
restored on the device, fla-free exact path); in bfloat16 (fla prefill, CUDA-graph decode) a turn with nothing
cached gives the tokens of no caching computed in the same chunks, and later turns hit. Skipped without CUDA."""

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.entrypoints.make_tiny import make_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def chat(llm, num_turns=5):
    """Two conversations in lockstep: 48-token openings (whole blocks), then 21 new tokens a turn after 12-token
    answers. Returns each turn's (answers, cached tokens)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 512, (48,), generator=gen).tolist() for _ in range(2)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    turns = []
    for _ in range(num_turns):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        turns.append(([o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]))
        prompts = [o.prompt_token_ids + o.outputs[0].token_ids + torch.randint(5, 512, (21,), generator=gen).tolist()
                   for o in outs]
    return turns


def test_float32_prefix_caching_matches_no_caching(tiny):
    torch.backends.cuda.matmul.allow_tf32 = False
    off = chat(LLM(tiny, device="cuda", dtype="float32", max_model_len=512, enable_prefix_caching=False))
    on = chat(LLM(tiny, device="cuda", dtype="float32", max_model_len=512, enable_prefix_caching=True))
    assert [answers for answers, _ in on] == [answers for answers, _ in off]
    assert all(cached > 0 for _, hits in on[1:] for cached in hits)


def test_bfloat16_first_turn_matches_no_caching_and_later_turns_hit(tiny):
    """With caching on, a 48-token prompt is computed as 32 + 16 (its snapshot sits at the last block boundary
    before its last token). With a 32-token budget and one request at a time, no caching computes the same chunks,
    so bf16 (fla's chunked prefill, CUDA-graph decode) must give the same first turn bit for bit: saving the
    snapshot changes nothing. Later turns hit (with the default budget and batch: one request at a time leaves
    room for fewer KDA snapshots than two conversations keep)."""
    kwargs = dict(device="cuda", dtype="bfloat16", max_model_len=512)
    one_at_a_time = dict(max_num_batched_tokens=32, max_num_seqs=1)
    off = chat(LLM(tiny, enable_prefix_caching=False, **kwargs, **one_at_a_time), 1)
    on = chat(LLM(tiny, enable_prefix_caching=True, **kwargs, **one_at_a_time), 1)
    assert on[0][0] == off[0][0]
    turns = chat(LLM(tiny, enable_prefix_caching=True, **kwargs), 3)
    assert all(cached > 0 for _, hits in turns[1:] for cached in hits)
