"""LLM calls that ask for several outputs at once, as vLLM's offline API takes them: SamplingParams(n=...) (n
requests a prompt, merged into one RequestOutput) and LLM.chat over a list of conversations."""

from __future__ import annotations

import pytest
from helpers.engine import assert_idle

from deltaserve import SamplingParams
from deltaserve.entrypoints.chat_tools import ChatCompletionOutput
from deltaserve.sampling_params import ParamError

PROMPTS = ["The quick brown fox", "Once upon a time"]


def test_n_outputs_are_the_seeded_single_requests_in_order(make_llm):
    """Completion i of a prompt with n and seed s is the single request with seed s + i (the server's choices
    too); the prompt's logprobs come once; every output carries its index."""
    llm = make_llm()
    params = SamplingParams(n=3, max_tokens=7, temperature=1.0, seed=11, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(outs) == 2 and len({o.request_id for o in outs}) == 2
    for prompt, out in zip(PROMPTS, outs):
        assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert set(out.metrics) == {"arrival_time", "first_token_time", "finish_time"}
        for i, completion in enumerate(out.outputs):
            single = llm.generate(prompt, SamplingParams(max_tokens=7, temperature=1.0, seed=11 + i, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0]
            assert (completion.token_ids, completion.text, completion.finish_reason) == (
                single.token_ids, single.text, single.finish_reason)
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1, "seeds s, s + 1, s + 2 drew the same tokens"
    assert llm._siblings == {}


def test_n_greedy_outputs_agree_and_mix_with_single_prompts(make_llm):
    llm = make_llm()
    params = [SamplingParams(n=2, max_tokens=5, temperature=0, ignore_eos=True), SamplingParams(max_tokens=4)]
    many, one = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(many.outputs) == 2 and many.outputs[0].token_ids == many.outputs[1].token_ids
    assert len(one.outputs) == 1 and len(one.outputs[0].token_ids) <= 4


def test_stream_merges_a_prompts_n_outputs_and_ends_as_generate(make_llm):
    llm = make_llm(num_decode_steps=1)
    params = [SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)]
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    stream = llm.stream(PROMPTS, params)
    seen: dict[str, list] = {}
    for out in stream:
        seen.setdefault(out.request_id, []).append(out)
    assert set(seen) == set(stream.request_ids)
    fanned = seen[stream.request_ids[0]]
    assert len(fanned) == 12, "one output each time either completion gains a token"
    for before, after in zip(fanned, fanned[1:]):
        assert sum(len(c.token_ids) for c in after.outputs) == sum(len(c.token_ids) for c in before.outputs) + 1
        for b, a in zip(before.outputs, after.outputs):
            assert a.token_ids[:len(b.token_ids)] == b.token_ids
    assert [o.finished for o in fanned] == [False] * 11 + [True]
    for outs, final in zip((fanned, seen[stream.request_ids[1]]), expected):
        assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in final.outputs]
        assert [c.text for c in outs[-1].outputs] == [c.text for c in final.outputs]
    assert llm._siblings == {}


def test_abort_stops_all_n_requests_of_a_prompt(make_llm):
    llm = make_llm()
    stream = llm.stream(PROMPTS, SamplingParams(n=3, max_tokens=40, temperature=0, ignore_eos=True))
    victim = next(stream).request_id
    assert len(llm.engine.scheduler.requests) == 6
    llm.abort(victim)
    assert len(llm.engine.scheduler.requests) == 3
    rest = list(stream)
    assert {o.request_id for o in rest} == set(stream.request_ids) - {victim}
    assert rest[-1].finished and len(rest[-1].outputs) == 3
    assert_idle(llm)
    assert llm._siblings == {}


def test_closing_a_stream_aborts_every_request_it_started(make_llm):
    llm = make_llm()
    stream = llm.stream(PROMPTS, SamplingParams(n=2, max_tokens=40, temperature=0, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.scheduler.requests and llm._siblings == {}


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True])
def test_bad_n_is_a_param_error(n):
    with pytest.raises(ParamError, match=r"SamplingParams.n = .*must be an integer >= 1") as e:
        SamplingParams(n=n)
    assert e.value.field == "n"


def test_a_refused_prompt_queues_none_of_the_calls_requests(make_llm):
    llm = make_llm(max_model_len=64)
    with pytest.raises(ValueError, match="shorter than max_model_len"):
        llm.generate(["hi", {"prompt_token_ids": [5] * 64}], SamplingParams(n=3), use_tqdm=False)
    assert not llm.engine.scheduler.requests and llm._siblings == {} and llm._inboxes == {}


def test_chat_over_a_list_of_conversations_runs_them_together(make_llm):
    llm = make_llm()
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = llm.chat(chats, greedy)
    assert isinstance(outs, list) and len(outs) == 2
    for chat, out in zip(chats, outs):
        alone = llm.chat(chat, greedy)
        assert out.prompt_token_ids == alone.prompt_token_ids
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert isinstance(out.outputs[0], ChatCompletionOutput)
    per_chat = llm.chat(chats, [greedy, SamplingParams(n=2, max_tokens=3, temperature=0, ignore_eos=True)])
    assert [len(o.outputs) for o in per_chat] == [1, 2]
    assert all(isinstance(c, ChatCompletionOutput) for c in per_chat[1].outputs)
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        llm.chat(chats, [greedy] * 3)


def test_the_engine_refuses_n_it_would_not_honour(make_llm):
    llm = make_llm()
    with pytest.raises(ParamError, match="n = 2: an engine request is one sequence") as e:
        llm.engine.add_request([1, 2, 3], SamplingParams(n=2))
    assert e.value.field == "n" and not llm.engine.scheduler.requests
