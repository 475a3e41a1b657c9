"""The offline API as users see it (vLLM's shapes): logprobs, prompt logprobs, stopping, streaming, abort, and
input errors that queue nothing. Every LLM here must end with all its pages and slots free (make_llm)."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import as_inputs, assert_idle, random_prompts, token_ids, with_bos, without_tokenizer
from helpers.hand_runner import prefill_logits

from deltaserve import LLM, SamplingParams
from deltaserve.scheduler_output import SchedulerOutput

LOGPROB_ATOL = 1e-4  # the engine's batched step vs one plain prefill: same float32 math, other shapes
TEXT_PROMPT = "The quick brown fox"


def model_logprobs(llm, token_ids_: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits over a whole sequence [T, V], from one prefill outside the engine."""
    return prefill_logits(llm.engine.runner.model, token_ids_).log_softmax(dim=-1)


def assert_entry(entry: dict, expected: torch.Tensor, chosen: int, num: int, tokenizer) -> None:
    """One vLLM logprobs entry {token id: Logprob}: the chosen token with its rank, and the top num with ranks
    1..num, every value the model's log_softmax, every decoded_token the token's text."""
    top = expected.topk(num)
    assert set(entry) == {chosen, *top.indices.tolist()}
    for rank, (token_id, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
        assert entry[token_id].logprob == pytest.approx(value, abs=LOGPROB_ATOL)
        assert entry[token_id].rank == rank
    assert entry[chosen].logprob == pytest.approx(expected[chosen].item(), abs=LOGPROB_ATOL)
    assert entry[chosen].rank == 1 + int((expected > expected[chosen]).sum())
    assert all(entry[t].decoded_token == tokenizer.decode([t]) for t in entry)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.3, top_k=50, seed=5)],
                         ids=["greedy", "sampled"])
def test_logprobs_are_the_model_log_softmax_in_vllm_shape(make_llm, sampling):
    llm = make_llm()
    prompt = random_prompts([23], seed=4)[0]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2, **sampling)
    out = llm.generate(as_inputs([prompt]), params, use_tqdm=False)[0]
    tokens, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
    expected = model_logprobs(llm, prompt + tokens[:-1])  # row p: the distribution of token p + 1

    assert len(logprobs) == len(tokens) == 6
    for i, (entry, token_id) in enumerate(zip(logprobs, tokens)):
        assert_entry(entry, expected[len(prompt) - 1 + i], token_id, 3, llm.tokenizer)
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(logprobs, tokens)))
    if params.temperature == 0:
        assert all(entry[t].rank == 1 for entry, t in zip(logprobs, tokens))

    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        assert_entry(out.prompt_logprobs[p], expected[p - 1], prompt[p], 2, llm.tokenizer)


def test_zero_logprobs_give_the_chosen_token_only(make_llm):
    llm = make_llm()
    out = llm.generate(as_inputs(random_prompts([9], seed=6)), SamplingParams(
        max_tokens=3, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert [list(entry) for entry in out.outputs[0].logprobs] == [[t] for t in out.outputs[0].token_ids]
    assert [list(entry) for entry in out.prompt_logprobs[1:]] == [[t] for t in out.prompt_token_ids[1:]]


def test_max_tokens_zero_returns_prompt_logprobs_and_no_tokens(make_llm):
    """lm-eval's loglikelihood: score a prompt, generate nothing."""
    llm = make_llm()
    prompts = random_prompts([1, 30, 200], seed=7)
    scored = llm.generate(as_inputs(prompts), SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)
    for prompt, out in zip(prompts, scored):
        completion = out.outputs[0]
        assert completion.token_ids == [] and completion.text == "" and completion.finish_reason == "length"
        assert out.finished and len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        expected = model_logprobs(llm, prompt)
        for p in range(1, len(prompt)):
            assert out.prompt_logprobs[p][prompt[p]].logprob == pytest.approx(expected[p - 1, prompt[p]].item(),
                                                                             abs=LOGPROB_ATOL)


@pytest.fixture
def greedy_text(make_llm):
    """(llm, the greedy continuation of TEXT_PROMPT: token ids, text) of 40 tokens."""
    llm = make_llm()
    out = llm.generate(TEXT_PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    return llm, out[0].outputs[0].token_ids, out[0].outputs[0].text


def ascii_stop_string(text: str, start: int) -> str:
    """Two letters of text at or after `start` that do not occur before it."""
    for i in range(start, len(text) - 1):
        candidate = text[i: i + 2]
        if candidate.isascii() and candidate.isalpha() and text.find(candidate) == i:
            return candidate
    pytest.skip("the model's greedy text has no fresh two-letter string")


def first_tokens_containing(tokenizer, ids: list[int], text: str) -> int:
    """The fewest leading tokens of ids whose decoded text contains text."""
    return next(k for k in range(1, len(ids) + 1) if text in tokenizer.decode(ids[:k], skip_special_tokens=True))


def test_stop_string_truncates_text_and_finishes_with_stop(greedy_text):
    llm, ids, text = greedy_text
    stop = ascii_stop_string(text, len(text) // 3)
    num_tokens = first_tokens_containing(llm.tokenizer, ids, stop)
    cut = llm.generate(TEXT_PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (text[: text.index(stop)], "stop", stop)
    assert cut.token_ids == ids[:num_tokens]

    kept = llm.generate(TEXT_PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop],
                                                    include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)] and kept.finish_reason == "stop"

    # the stop string completed by the last token max_tokens allows: "stop" wins over "length", as in vLLM
    last = llm.generate(TEXT_PROMPT, SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True,
                                                    stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (last.text, last.finish_reason, last.stop_reason) == (cut.text, "stop", stop)


def test_stop_token_id_ends_output_and_stays_out_of_the_text(greedy_text):
    llm, ids, _ = greedy_text
    index = next(i for i in range(5, len(ids)) if ids[i] not in ids[:i])
    out = llm.generate(TEXT_PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[ids[index]]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: index + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", ids[index])
    assert out.text == llm.tokenizer.decode(ids[:index], skip_special_tokens=True)


def masked_greedy(llm, prompt: list[int], stop: int, min_tokens: int, max_tokens: int) -> list[int]:
    """The slow twin of min_tokens: greedy tokens by whole-sequence prefills, stop at -inf while fewer than
    min_tokens are out, ending at a stop past them."""
    tokens = []
    while len(tokens) < max_tokens and (not tokens or tokens[-1] != stop):
        logits = prefill_logits(llm.engine.runner.model, prompt + tokens)[-1].clone()
        if len(tokens) < min_tokens:
            logits[stop] = float("-inf")
        tokens.append(int(logits.argmax()))
    return tokens


@pytest.mark.parametrize("as_eos", [False, True], ids=["stop_token_ids", "eos"])
def test_min_tokens_keeps_a_stop_token_from_ending_the_first_tokens(greedy_text, as_eos):
    """A stop token (or EOS) that ends the greedy output at index i: min_tokens i still lets it end there, and
    min_tokens past i masks it until then, giving the masked greedy decode's tokens."""
    llm, ids, _ = greedy_text
    index = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    stop = ids[index]
    if as_eos:
        llm.engine.eos_token_ids = (stop,)  # what add_request gives its requests
    params = dict(max_tokens=20, temperature=0) | ({} if as_eos else dict(ignore_eos=True, stop_token_ids=[stop]))
    prompt = llm.generate(TEXT_PROMPT, SamplingParams(max_tokens=0), use_tqdm=False)[0].prompt_token_ids
    for min_tokens in (0, index, index + 1, index + 4):
        out = llm.generate(TEXT_PROMPT, SamplingParams(min_tokens=min_tokens, **params), use_tqdm=False)[0].outputs[0]
        expected = masked_greedy(llm, prompt, stop, min_tokens, 20)
        assert out.token_ids == expected and stop not in expected[:min_tokens], min_tokens
        assert out.finish_reason == ("stop" if expected[-1] == stop else "length")
        if min_tokens <= index:
            assert out.token_ids == ids[: index + 1]


def test_min_tokens_keeps_a_seeded_request_going_past_its_stop_token(make_llm):
    llm = make_llm()
    prompt = as_inputs(random_prompts([12], seed=9))
    free = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    index = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5, ignore_eos=True, stop_token_ids=[free[index]],
                            min_tokens=index + 3)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:index] == free[:index] and free[index] not in out.token_ids[: index + 3]
    assert len(out.token_ids) > index + 3 or out.finish_reason == "length"
    assert out.token_ids == llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_min_tokens_ignores_a_stop_string_in_the_text_of_the_first_tokens(greedy_text):
    """A stop string counts only where it ends in text after that of the first min_tokens tokens."""
    llm, ids, text = greedy_text
    stop = ascii_stop_string(text, len(text) // 3)
    num_tokens = first_tokens_containing(llm.tokenizer, ids, stop)
    for min_tokens in (num_tokens - 1, num_tokens, num_tokens + 3):
        out = llm.generate(TEXT_PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop],
                                                       min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
        first_text = llm.tokenizer.decode(ids[:min_tokens], skip_special_tokens=True).rstrip("\ufffd")
        start = text.find(stop, max(0, len(first_text) - len(stop) + 1))
        assert (out.text, out.finish_reason) == ((text[:start], "stop") if start >= 0 else (text, "length"))
        if min_tokens < num_tokens:
            assert out.token_ids == ids[:num_tokens]


def test_max_tokens_finishes_with_length(greedy_text):
    llm, ids, _ = greedy_text
    out = llm.generate(TEXT_PROMPT, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[:7], "length", None)
    assert out.text == llm.tokenizer.decode(ids[:7], skip_special_tokens=True)


def test_stream_yields_cumulative_outputs_that_end_as_generate(make_llm):
    llm = make_llm(num_decode_steps=1)  # one token a step (bursts stream several: test_engine_bursts.py)
    prompts = [TEXT_PROMPT, "Once upon a time"]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.9, seed=3, ignore_eos=True)]
    expected = llm.generate(prompts, params, use_tqdm=False)
    seen: dict[str, list] = {}
    for out in llm.stream(prompts, params):
        seen.setdefault(out.request_id, []).append(out)
    assert len(seen) == 2
    for outs, final, sp in zip(seen.values(), expected, params):
        assert len(outs) == sp.max_tokens, "one output per step that added a token"
        for before, after in zip(outs, outs[1:]):
            assert after.outputs[0].token_ids[:-1] == before.outputs[0].token_ids
            assert after.outputs[0].text.startswith(before.outputs[0].text)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].outputs[0].token_ids == final.outputs[0].token_ids
        assert outs[-1].outputs[0].text == final.outputs[0].text


def test_abort_mid_stream_frees_pages_and_slot_at_once(make_llm):
    llm = make_llm(block_size=4)
    cache = llm.engine.scheduler.cache
    prompts = random_prompts([40, 25, 60], seed=8)
    stream = llm.stream(as_inputs(prompts), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    victim = next(stream).request_id
    before = {r.req_id: list(r.block_ids) for r in llm.engine.scheduler.running}
    assert len(before) == 3 and cache.num_free_slots == cache.state_pool.num_slots - 3
    llm.abort(victim)
    assert victim not in llm.engine.scheduler.requests
    assert cache.num_free_blocks == cache.num_blocks - sum(len(b) for r, b in before.items() if r != victim)
    assert cache.num_free_slots == cache.state_pool.num_slots - 2
    rest = list(stream)
    assert victim not in {o.request_id for o in rest}
    assert sorted(o.request_id for o in rest if o.finished) == sorted(set(before) - {victim})


def test_scheduler_that_schedules_nothing_raises_instead_of_spinning(make_llm):
    llm = make_llm()
    calls = []

    def stalled():
        calls.append(1)
        assert len(calls) < 100, "generate kept stepping an engine that scheduled nothing"
        return SchedulerOutput()

    llm.engine.scheduler.schedule = stalled
    with pytest.raises(RuntimeError, match="scheduled nothing while 0 running and 2 waiting"):
        llm.generate(as_inputs(random_prompts([5, 9], seed=9)), use_tqdm=False)
    assert len(calls) == 1
    assert_idle(llm)  # generate aborted its requests on the way out


GOOD = {"prompt_token_ids": [5, 6, 7]}


@pytest.mark.parametrize("prompts, params, message", [
    ([GOOD, {"prompt_token_ids": []}], None, "non-empty 'prompt_token_ids'"),
    ([GOOD, ""], None, "encodes to no tokens"),
    ([GOOD, {"prompt_token_ids": [5, 512]}], None, r"token id 512 is out of range: .* \[0, 512\)"),
    ([GOOD, {"prompt_token_ids": [-1]}], None, r"token id -1 is out of range"),
    ([GOOD, GOOD, GOOD], [SamplingParams()] * 2, "3 prompts but 2 SamplingParams"),
    ([GOOD, {"prompt_token_ids": [5] * 64}], None, "prompt of 64 tokens must be shorter than max_model_len=64"),
    ([GOOD, "a\ud800b"], None, "unpaired UTF-16 surrogate"),  # was tokenizers' TypeError "TextInputSequence..."
], ids=["empty-ids", "empty-text", "id-too-large", "id-negative", "params-mismatch", "longer-than-max-model-len",
        "unpaired-surrogate"])
def test_input_errors_raise_value_error_and_queue_nothing(make_llm, prompts, params, message):
    llm = make_llm(max_model_len=64)
    for call in (lambda: llm.generate(prompts, params, use_tqdm=False), lambda: llm.stream(prompts, params)):
        with pytest.raises(ValueError, match=message):
            call()
        assert_idle(llm)
    assert token_ids(llm.generate(GOOD, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)) != [[]]


def test_text_prompt_without_tokenizer_raises(make_llm, tiny_model, tmp_path):
    llm = make_llm(without_tokenizer(tiny_model, tmp_path / "ids_only"))
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer, so text prompts cannot be encoded"):
        llm.generate([GOOD, "hello"], use_tqdm=False)
    assert_idle(llm)
    out = llm.generate(GOOD, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""


def test_a_chat_whose_template_writes_the_bos_gets_one(tiny_model, tmp_path):
    """A tokenizer that adds a BOS to text, a chat template that writes one: plain prompts get the tokenizer's,
    chats only the template's (as vLLM encodes them), through LLM.chat and the chat command's LLM.stream."""
    with LLM(str(with_bos(tiny_model, tmp_path / "bos")), max_model_len=128, threads=1) as llm:
        bos = llm.tokenizer.bos_token_id
        params = SamplingParams(max_tokens=1)
        plain = llm.generate("hi", params, use_tqdm=False)[0].prompt_token_ids
        assert plain[0] == bos and plain.count(bos) == 1
        chat = llm.chat([{"role": "user", "content": "hi"}], params).prompt_token_ids
        assert chat[0] == bos and chat.count(bos) == 1
        rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        assert list(llm.stream(rendered, params))[-1].prompt_token_ids == chat
        assert llm.tokenizer.encode_prompt(str(rendered)) == [bos, *chat]  # an edited chat is plain text again
