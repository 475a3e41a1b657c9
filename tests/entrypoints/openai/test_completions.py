"""POST /v1/completions through the official openai client: text equals the offline API, seeds, stops,
n and batches of prompts, logprobs with echo (what lm-eval sends), streaming."""

from __future__ import annotations

import json

import pytest

from deltaserve import SamplingParams

PROMPT = "The quick brown fox"


def offline(llm, prompt, **params):
    prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


def test_greedy_text_equals_llm_generate(client, offline_llm):
    expected = offline(offline_llm, PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_streamed_text_equals_whole_and_usage_comes_last(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done(http):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_seed_reproducible_and_choices_differ(client):
    def run(seed):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed, n=2,
                                         extra_body={"ignore_eos": True})

    first, again, other = run(7), run(7), run(8)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert texts != [c.text for c in other.choices]
    assert texts[0] != texts[1]  # choice i samples with seed + i


def test_batch_of_token_prompts_numbers_choices_prompt_major(client, offline_llm):
    prompts = [[20, 30, 40], [50, 60, 70, 80]]
    response = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, n=2,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for prompt_index, prompt in enumerate(prompts):
        expected = offline(offline_llm, prompt, max_tokens=5, temperature=0, ignore_eos=True).outputs[0].text
        assert [c.text for c in response.choices[2 * prompt_index: 2 * prompt_index + 2]] == [expected, expected]
    assert response.usage.prompt_tokens == 7  # each prompt once, whatever n is
    assert response.usage.completion_tokens == 20


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    start = next(i for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip())
    stop = full[start:start + 2]
    choice = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True}).choices[0]
    assert choice.text == full[:full.index(stop)]
    assert choice.finish_reason == "stop"


def test_min_tokens_keeps_a_stop_token_from_ending_the_first_tokens(client, offline_llm):
    """vLLM's min_tokens field reaches the engine: the first greedy token as a stop token ends a plain request at
    once, and one with min_tokens 3 only after its third token; the text is the offline API's."""
    first = offline(offline_llm, PROMPT, max_tokens=1, temperature=0).outputs[0].token_ids[0]
    fields = dict(max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[first])

    def run(**extra):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True, "stop_token_ids": [first], **extra})

    assert run().usage.completion_tokens == 1
    response = run(min_tokens=3)
    expected = offline(offline_llm, PROMPT, min_tokens=3, **fields).outputs[0]
    assert response.usage.completion_tokens == len(expected.token_ids) > 3
    assert (response.choices[0].text, response.choices[0].finish_reason) == (expected.text, expected.finish_reason)


def test_logit_bias_and_allowed_token_ids_reach_the_engine(client, offline_llm):
    """OpenAI's logit_bias, keyed by token ids written as strings (values past 100 clamped), and vLLM's
    allowed_token_ids: the text is the offline API's with the same fields, and not the plain request's."""
    plain = offline(offline_llm, PROMPT, max_tokens=8, temperature=0, ignore_eos=True).outputs[0]
    bias = {plain.token_ids[0]: -100, 123: 5, plain.token_ids[1]: -250}
    expected = offline(offline_llm, PROMPT, max_tokens=8, temperature=0, ignore_eos=True, logit_bias=bias).outputs[0]
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                         logit_bias={str(t): b for t, b in bias.items()},
                                         extra_body={"ignore_eos": True})
    assert response.choices[0].text == expected.text != plain.text

    allowed = [plain.token_ids[2], 123, 300, 301]
    fields = dict(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=allowed)
    expected = offline(offline_llm, PROMPT, **fields).outputs[0]
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3,
                                         logprobs=0, extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert response.choices[0].text == expected.text and set(expected.token_ids) <= set(allowed)
    assert response.usage.completion_tokens == 16


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_score_the_prompt(client, offline_llm, max_tokens):
    """lm-eval's loglikelihood request: echo + logprobs; the prompt's logprobs equal the offline API's."""
    prompt = [11, 42, 97, 250, 3, 77]
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         logprobs=1, echo=True)
    logprobs = response.choices[0].logprobs
    expected = offline(offline_llm, prompt, max_tokens=1, temperature=0, prompt_logprobs=1).prompt_logprobs
    assert len(logprobs.tokens) == len(prompt) + max_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i, token_id in enumerate(prompt[1:], start=1):
        assert logprobs.token_logprobs[i] == pytest.approx(expected[i][token_id].logprob, abs=1e-5)
        assert max(logprobs.top_logprobs[i].values()) >= logprobs.token_logprobs[i]
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert response.usage.completion_tokens == max_tokens


def test_logprobs_of_generated_tokens_stream_like_whole(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == whole.tokens
    assert len(whole.tokens) == 6 and all(lp <= 0 for lp in whole.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in whole.top_logprobs)  # the top 2, and the chosen token if not among them
    assert whole.text_offset[0] == 0


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
