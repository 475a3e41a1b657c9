"""Tool calling through POST /v1/chat/completions with the official openai client, on a model rigged to answer
every chat with some content and then one Kimi tool call (tests/helpers/rigged_model.py)."""

from __future__ import annotations

import json
import time

import openai
import pytest
from helpers.http_server import API_KEY, start_server, wait_idle
from helpers.rigged_model import write_rigged_model

OUTPUT_PIECES = ["Let me check.", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.get_weather",
                 ":0", "<|tool_call_argument_begin|>", '{"city": ', '"Paris"}', "<|tool_call_end|>",
                 "<|tool_calls_section_end|>"]
RAW_OUTPUT = "".join(OUTPUT_PIECES)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
REQUEST = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=32, temperature=0)


@pytest.fixture(scope="module")
def rigged_server(tmp_path_factory):
    # byte-level ranks: about one token a character; one decode step at a time (no bursts), so that a stream's
    # deltas are single tokens, which the arguments test counts
    srv = start_server(write_rigged_model(tmp_path_factory.mktemp("rigged") / "model", OUTPUT_PIECES),
                       max_model_len=1024, num_decode_steps=1)
    yield srv
    srv.stop()


@pytest.fixture
def client(rigged_server):
    """The openai client on the rigged server; at teardown the server must be idle with its whole cache free."""
    with rigged_server.http() as http:
        yield openai.OpenAI(base_url=f"{rigged_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        wait_idle(http)


@pytest.mark.parametrize("tool_choice", [openai.NOT_GIVEN, "auto"])
def test_tool_call_comes_back_as_tool_calls(client, tool_choice):
    choice = client.chat.completions.create(**REQUEST, tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("functions.get_weather:0", "function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_streamed_tool_call_comes_as_openai_deltas(client, rigged_server, monkeypatch):
    """The engine's loop does not wait for the server: a handler that lags a step gets that step's tokens folded
    into the next chunk. Each step here waits 50 ms (the rigged model's own take well under one), so that the handler
    keeps up and every argument token is a chunk of its own, which shows that the arguments stream."""
    step = rigged_server.engine.step

    def slow_step():
        time.sleep(0.05)
        return step()

    monkeypatch.setattr(rigged_server.engine, "step", slow_step)
    chunks = list(client.chat.completions.create(**REQUEST, stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks]
    assert deltas[0].role == "assistant"
    first_call = next(i for i, delta in enumerate(deltas) if delta.tool_calls)
    assert "".join(delta.content or "" for delta in deltas[:first_call]) == "Let me check."
    assert all(not delta.content for delta in deltas[first_call:])
    [start, *fragments] = [call for delta in deltas for call in delta.tool_calls or []]
    assert (start.index, start.id, start.type, start.function.name) == (
        0, "functions.get_weather:0", "function", "get_weather")
    assert len(fragments) >= 2  # one per argument token: the arguments stream, they do not come at the end
    assert all(f.index == 0 and f.id is None and f.function.name is None for f in fragments)
    arguments = start.function.arguments + "".join(f.function.arguments for f in fragments)
    assert json.loads(arguments) == {"city": "Paris"}
    assert [chunk.choices[0].finish_reason for chunk in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]


def test_tool_choice_none_returns_the_raw_text_as_content(client):
    choice = client.chat.completions.create(**REQUEST, tool_choice="none").choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (RAW_OUTPUT, None, "stop")


@pytest.mark.parametrize("request_fields, message", [
    (dict(tools=TOOLS, tool_choice="always"), "tool_choice = 'always' is not supported"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}),
     "tool_choice names function 'get_time', which is not among tools"),
    (dict(tool_choice="auto"), "tool_choice = 'auto' needs tools"),
])
def test_bad_tool_choice_is_a_400_in_openai_shape(client, request_fields, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **request_fields)
    body = err.value.response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "tool_choice"
    assert body["error"]["message"].startswith(message)
