"""Structured outputs through the OpenAI routes, with the official openai client, on the demo model."""

from __future__ import annotations

import json
import re
import sys

import openai
import pydantic
import pytest
from helpers.http_server import API_KEY, start_server, wait_idle

from deltaserve.entrypoints.llm import BUNDLED_MODEL

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar", reason="the structured extra is part of the test extra")
MESSAGES = [{"role": "user", "content": "Describe a person."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    hobbies: list[str] = pydantic.Field(max_length=2)


@pytest.fixture(scope="module")
def demo_server():
    srv = start_server(BUNDLED_MODEL, max_model_len=1024)
    yield srv
    srv.stop()


@pytest.fixture
def client(demo_server):
    with demo_server.http() as http:
        yield openai.OpenAI(base_url=f"{demo_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        wait_idle(http)


def test_parse_with_a_pydantic_model_returns_the_object(client):
    completion = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Person,
                                               max_tokens=120, temperature=0)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and len(person.hobbies) <= 2


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format_on_chat(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=3, response_format=fmt)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,5} \d{2}"}}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} \d{2}", t)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False, "disable_additional_properties": False,
                             "disable_fallback": True, "structural_tag": None, "whitespace_pattern": None,
                             "_backend": "xgrammar"}},  # vLLM's options (met either way), nulls and internals
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"grammar": 'root ::= "a" ("b" | "c")*  "."'}}, lambda t: re.fullmatch(r"a[bc]*\.", t)),
])
def test_completions_are_constrained(client, extra, check):
    response = client.completions.create(model="tiny", prompt=["Say:", "Now:"], max_tokens=60, temperature=1.0,
                                         seed=1, extra_body=extra)
    for choice in response.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text


def test_json_object_response_format_on_completions(client):
    """Any JSON object: its strings are unbounded, so a cut-off output is an object begun; a finished one parses."""
    response = client.completions.create(model="tiny", prompt=["Say:", "Now:", "Go:"], max_tokens=40, seed=2,
                                         extra_body={"response_format": {"type": "json_object"}})
    for choice in response.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.text), dict)
        else:
            assert choice.text.startswith("{"), choice.text


def test_vllm_structured_outputs_on_chat(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, n=3, seed=0,
                                              extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert {c.message.content for c in response.choices} <= {"yes", "no"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_returns_a_tool_call_with_valid_arguments(client, stream):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=40, temperature=0, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
        calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
    [call] = calls
    assert (call.type, call.function.name, finish) == ("function", "get_weather", "tool_calls")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])


def test_tool_choice_required_calls_a_tool(client):
    choice = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                            tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.message.content is None
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])


def test_forced_call_ids_go_on_from_the_calls_earlier_in_the_chat(client):
    """Kimi numbers a chat's tool calls globally (functions.NAME:INDEX): a second turn's call must not reuse the
    first's id, which the tool's reply names."""
    kwargs = dict(model="tiny", max_tokens=40, temperature=0, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [first] = client.chat.completions.create(messages=MESSAGES, **kwargs).choices[0].message.tool_calls
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [first.model_dump()]},
               {"role": "tool", "tool_call_id": first.id, "content": "sunny"}, {"role": "user", "content": "And?"}]
    [second] = client.chat.completions.create(messages=history, **kwargs).choices[0].message.tool_calls
    required = client.chat.completions.create(messages=history, **{**kwargs, "tool_choice": "required",
                                                                    "max_tokens": 60, "parallel_tool_calls": False})
    [third] = required.choices[0].message.tool_calls
    assert (first.id, second.id, third.id) == ("functions.get_weather:0", "functions.get_weather:1",
                                               "functions.get_weather:1")


WIDE = {"structured_outputs": {"regex": "é😀中"}}  # characters of 2, 4 and 3 bytes: the demo's tokens split them


def test_chat_logprobs_bytes_are_the_tokens_own_and_rebuild_the_text(client):
    choice = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0,
                                            logprobs=True, top_logprobs=1, extra_body=WIDE).choices[0]
    assert choice.message.content == "é😀中"
    pieces = [bytes(entry.bytes) for entry in choice.logprobs.content]
    assert b"".join(pieces) in ("é😀中".encode(), "é😀中<|eos|>".encode())  # the end token listed, as vLLM lists it
    assert any(not piece.decode("utf-8", "ignore") for piece in pieces)  # some token held part of a character


def test_completions_text_offsets_count_characters_once_streamed_or_not(client):
    kwargs = dict(model="tiny", prompt="Go:", max_tokens=20, temperature=0, logprobs=0, extra_body=WIDE)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert whole.text == "é😀中" and streamed == whole.logprobs.text_offset
    assert streamed == sorted(streamed) and streamed[0] == 0 and set(streamed) <= {0, 1, 2, 3}  # 3 characters
    echoed = client.completions.create(**kwargs, echo=True).choices[0]
    assert echoed.logprobs.text_offset[-len(streamed):] == [3 + o for o in streamed]  # after "Go:"


@pytest.mark.parametrize("as_ids", [False, True])
def test_an_echoed_prompts_special_tokens_keep_their_text_in_the_offsets(client, as_ids):
    """The echo is the prompt's text (or its ids decoded), special tokens' text included: each prompt token starts
    where the ones before it end, and the output starts after the echo."""
    from deltaserve.tokenizer import load_tokenizer

    text = "<|im_start|>user hi<|im_end|>"
    prompt = load_tokenizer(BUNDLED_MODEL).encode(text) if as_ids else text
    choice = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                       logprobs=0, extra_body={"ignore_eos": True}).choices[0]
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    assert choice.text.startswith(text) and tokens[0] == "<|im_start|>"
    assert offsets[:-2] == [sum(map(len, tokens[:i])) for i in range(len(tokens) - 2)]  # ASCII: a character a byte
    assert offsets[-2] == len(text)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_off_by_max_tokens_streams_the_text_the_whole_response_has(client, tool_choice):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, tools=TOOLS, tool_choice=tool_choice)
    choice = client.chat.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    streamed = "".join(c.delta.content or "" for c in chunks)
    assert choice.finish_reason == chunks[-1].finish_reason == "length" and choice.message.tool_calls is None
    assert streamed == choice.message.content and streamed  # the partial JSON, not nothing


@pytest.mark.parametrize("extra, param, message", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex",
     "structured_outputs.regex: Regex parsing error at position 4: The parenthesis is not closed"),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs.grammar", 'Rule "foo" is not defined'),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "structured_outputs.json",
     "keyword 'uniqueItems' at '/uniqueItems' is not supported"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice",
     "structured_outputs.choice = (): must be 1 to 1024 non-empty strings"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex",
     "structured_outputs.regex = '': must be a non-empty string"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "set exactly one of json, regex, choice, grammar or json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format.json_schema.schema", "keyword 'not' at '/not'"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "response_format and structured_outputs both constrain the output"),
    ({"structured_outputs": {"regex": "a+"}, "min_tokens": 2}, "min_tokens",
     "min_tokens = 2 cannot go with structured outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"if": {}}}}], "tool_choice": "required"},
     "tools", "keyword 'if'"),
])
def test_a_bad_constraint_is_a_400_naming_it(client, extra, param, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=extra)
    body = err.value.response.json()["error"]
    assert body["param"] == param and message in body["message"], body


def test_without_xgrammar_a_constrained_request_is_a_400_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError in this process
    srv = start_server(BUNDLED_MODEL, max_model_len=256)
    try:
        with srv.http() as http:
            response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                                          "structured_outputs": {"regex": "a+"}})
            assert response.status_code == 400
            assert "pip install 'deltaserve[structured]'" in response.json()["error"]["message"]
            free = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
            assert free.status_code == 200
    finally:
        srv.stop()


def test_a_constraint_queued_behind_other_compiles_is_a_429_and_the_server_goes_on(client, demo_server, monkeypatch):
    """A compile that has not ended within twice COMPILE_TIMEOUT_S waits behind others (its own is stopped at
    COMPILE_TIMEOUT_S, a 400 to simplify it: the next test): no fault of the constraint, so retry, not simplify."""
    import threading

    from deltaserve.structured import errors

    manager = demo_server.engine.structured_outputs()
    release, compile_ = threading.Event(), manager._compile
    monkeypatch.setattr(manager, "_compile", lambda spec: release.wait(30) and compile_(spec))  # the pool is busy
    monkeypatch.setattr(errors, "COMPILE_TIMEOUT_S", 0.2)
    extra = {"structured_outputs": {"regex": "[vwx]{4}"}}  # a pattern no other test compiles
    with pytest.raises(openai.RateLimitError) as err:
        client.with_options(max_retries=0).completions.create(model="tiny", prompt="Go:", max_tokens=8,
                                                              extra_body=extra)
    body = err.value.response.json()["error"]
    assert body["param"] == "structured_outputs" and body["code"] == "compiles_busy", body
    assert "waited 0.4 s behind other constraints' compiles; retry" in body["message"]
    release.set()
    monkeypatch.setattr(errors, "COMPILE_TIMEOUT_S", 60.0)
    text = client.completions.create(model="tiny", prompt="Go:", max_tokens=8, extra_body=extra).choices[0].text
    assert re.fullmatch("[vwx]{4}", text)


def test_a_constraint_past_the_compiles_bounds_is_a_400_and_the_server_goes_on(client):
    """(a*)* 500 times: each of its masks takes over a second, and every stream beside it would wait (the bounds of
    time and memory themselves: tests/structured/test_compile_worker.py)."""
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="Go:", max_tokens=8, extra_body={"structured_outputs": {
            "regex": "(a*)*" * 500}})
    body = err.value.response.json()["error"]
    assert body["param"] == "structured_outputs.regex" and "first token mask took" in body["message"], body
    text = client.completions.create(model="tiny", prompt="Go:", max_tokens=8, extra_body={"structured_outputs": {
        "regex": "[yz]{5}"}}).choices[0].text
    assert re.fullmatch("[yz]{5}", text)


def test_a_new_constraint_past_the_compiles_in_flight_is_a_429_and_the_server_goes_on(client, demo_server,
                                                                                      monkeypatch):
    import threading

    from deltaserve.sampling_params import StructuredOutputsParams
    from deltaserve.structured import errors

    manager = demo_server.engine.structured_outputs()
    release, compile_ = threading.Event(), manager._compile
    monkeypatch.setattr(manager, "_compile", lambda spec: release.wait(30) and compile_(spec))
    monkeypatch.setattr(errors, "MAX_COMPILES_IN_FLIGHT", 1)
    blocked = manager.submit(StructuredOutputsParams(regex="[pq]{5}"))  # a pattern no other test compiles
    extra = {"structured_outputs": {"regex": "[pq]{6}"}}
    with pytest.raises(openai.RateLimitError) as err:
        client.with_options(max_retries=0).completions.create(model="tiny", prompt="Go:", max_tokens=8,
                                                               extra_body=extra)
    assert err.value.response.headers["retry-after"] == "1"
    body = err.value.response.json()["error"]
    assert body["type"] == "rate_limit_error" and body["code"] == "compiles_busy", body
    assert body["param"] == "structured_outputs" and "1 constraints are compiling already" in body["message"], body
    release.set()
    blocked.result(timeout=30)
    text = client.completions.create(model="tiny", prompt="Go:", max_tokens=8, extra_body=extra).choices[0].text
    assert re.fullmatch("[pq]{6}", text)
