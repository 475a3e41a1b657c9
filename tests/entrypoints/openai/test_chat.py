"""POST /v1/chat/completions through the official openai client: the chat template, LLM.chat parity, streaming,
max_completion_tokens, logprobs, n with seeds, and clear refusals of what the server does not do."""

from __future__ import annotations

import openai
import pytest

from deltaserve import SamplingParams

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def test_greedy_chat_equals_llm_chat(client, offline_llm):
    expected = offline_llm.chat(MESSAGES, SamplingParams(max_tokens=10, temperature=0))
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_a_chat_rendered_in_a_thread_gives_the_same_tokens(client, offline_llm, monkeypatch):
    """A chat of OFF_LOOP_ITEMS or more messages and tools is rendered off the event loop: same prompt, same tokens."""
    from deltaserve.entrypoints.openai import serving

    monkeypatch.setattr(serving, "OFF_LOOP_ITEMS", 1)
    test_greedy_chat_equals_llm_chat(client, offline_llm)
    with pytest.raises(openai.BadRequestError, match="tool_choice = 'auto' needs tools"):  # still a clear 400
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, tool_choice="auto")


def test_content_parts_and_developer_role_render_like_plain_text(client):
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0)
    system = [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]
    parts = [{"role": "developer", "content": system}, MESSAGES[1]]
    same = client.chat.completions.create(model="tiny", messages=parts, max_tokens=6, temperature=0)
    assert same.choices[0].message.content == plain.choices[0].message.content
    assert same.usage.prompt_tokens == plain.usage.prompt_tokens


def test_stream_role_first_then_content_then_usage(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_completion_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8 == whole.usage.completion_tokens


def test_logprobs_and_top_logprobs(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert entry.logprob == pytest.approx(top[0])  # greedy picks the most likely token
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_logit_bias_reaches_the_engine(client, offline_llm):
    """A chat's logit_bias ({"token id": bias}) gives LLM.chat's text with the same bias: +100 on one token makes
    it every token."""
    token = offline_llm.chat(MESSAGES, SamplingParams(max_tokens=1, temperature=0)).outputs[0].token_ids[0] + 1
    expected = offline_llm.chat(MESSAGES, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                         logit_bias={token: 100}))
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                              logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert expected.outputs[0].token_ids == [token] * 6
    assert response.choices[0].message.content == expected.outputs[0].text


def test_n_choices_with_seed_are_reproducible(client):
    def run():
        response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, n=3, seed=5,
                                                  temperature=1.0, extra_body={"ignore_eos": True})
        return [c.message.content for c in response.choices]

    first = run()
    assert first == run() and len(set(first)) == 3


@pytest.mark.parametrize("kwargs, param", [
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (dict(top_logprobs=2), "top_logprobs"),
])
def test_unsupported_features_are_refused_clearly(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and param in err.value.body["message"]


def test_tools_with_tool_choice_none_are_shown_to_the_model(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    with_tools = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, tools=tools,
                                                tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens


def test_a_chat_whose_template_writes_the_bos_gets_one_through_the_server(tiny_model, tmp_path):
    """The tokenizer adds a BOS to text and the template writes one: a completion's prompt has the tokenizer's,
    a chat's only the template's."""
    from helpers.engine import with_bos
    from helpers.http_server import start_server

    from deltaserve.tokenizer import load_tokenizer

    folder = with_bos(tiny_model, tmp_path / "bos")
    tokenizer = load_tokenizer(folder)
    messages = [{"role": "user", "content": "hi"}]
    chat_ids = tokenizer.encode_prompt(tokenizer.apply_chat_template(messages))
    assert chat_ids.count(tokenizer.bos_token_id) == 1
    srv = start_server(folder, max_model_len=128)
    try:
        with srv.http() as http:
            def prompt_tokens(route: str, **body) -> int:
                response = http.post(route, json={"model": "tiny", "max_tokens": 1, **body})
                assert response.status_code == 200, response.text
                return response.json()["usage"]["prompt_tokens"]

            chat = prompt_tokens("/v1/chat/completions", messages=messages)
            chat_added = prompt_tokens("/v1/chat/completions", messages=messages, add_special_tokens=True)
            text = prompt_tokens("/v1/completions", prompt="hi")
            text_bare = prompt_tokens("/v1/completions", prompt="hi", add_special_tokens=False)
    finally:
        srv.stop()
    assert (chat, chat_added) == (len(chat_ids), len(chat_ids) + 1)  # vLLM's add_special_tokens, per request
    assert (text, text_bare) == (len(tokenizer.encode("hi")) + 1, len(tokenizer.encode("hi")))
