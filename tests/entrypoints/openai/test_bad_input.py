"""Every malformed request gets OpenAI's error shape and status and a message that names the problem; none of
them reaches the engine (no token is prefilled or generated), and a normal request still succeeds after them."""

from __future__ import annotations

import json
import sys

import pytest
from helpers.http_server import read_metrics
from pydantic import ValidationError

from deltaserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}


def chat(**fields):
    return {"model": "tiny", "messages": USER, "max_tokens": 2, **fields}


# (case id, path, JSON body or raw bytes, status, words the message must hold)
CASES = [
    ("malformed JSON", COMPLETIONS, b'{"prompt": "hi",', 400, "not valid JSON"),
    ("body not an object", COMPLETIONS, b"[1, 2]", 400, "must be a JSON object"),
    ("non-UTF-8 body", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
    ("prompt of wrong type", COMPLETIONS, completion(prompt=5), 400, "'prompt' must be a string"),
    ("max_tokens a string", COMPLETIONS, completion(max_tokens="ten"), 400, "'max_tokens'"),
    ("temperature a string", CHAT, chat(temperature="hot"), 400, "'temperature'"),
    ("stream not a bool", CHAT, chat(stream="yes"), 400, "'stream'"),
    ("missing prompt", COMPLETIONS, {"model": "tiny"}, 400, "'prompt' is required"),
    ("unknown model", COMPLETIONS, completion(model="gpt-9"), 404, "'gpt-9' does not exist"),
    ("vLLM's old guided_json", CHAT, chat(guided_json={"type": "integer"}), 400,
     "'guided_json' is vLLM's old name, which this server does not read; send \"structured_outputs\": {\"json\""),
    ("vLLM's old guided_choice", COMPLETIONS, completion(guided_choice=["a"]), 400,
     "\"structured_outputs\": {\"choice\""),
    ("structured_outputs' unknown key", CHAT, chat(structured_outputs={"choice": ["a"], "structural_tag": {}}), 400,
     "'structured_outputs.structural_tag' is not a field this server reads; the output would not follow it"),
    ("negative max_tokens", COMPLETIONS, completion(max_tokens=-1), 400, "greater than or equal to 0"),
    ("huge max_tokens", COMPLETIONS, completion(max_tokens=10**12), 400, "maximum context length"),
    ("huge max_completion_tokens", CHAT, chat(max_completion_tokens=100_000), 400, "maximum context length"),
    ("prompt over the context", COMPLETIONS, completion(prompt="ab " * 400), 400, "maximum context length"),
    ("token prompt over the context", COMPLETIONS, completion(prompt=[7] * 600), 400, "maximum context length"),
    ("text far over the context", COMPLETIONS, completion(prompt="x" * 200_000), 400, "bytes, at least"),
    ("token id out of the vocabulary", COMPLETIONS, completion(prompt=[1, 99999]), 400, "out of range"),
    ("empty prompt list", COMPLETIONS, completion(prompt=[]), 400, "must not be empty"),
    ("empty prompt string", COMPLETIONS, completion(prompt=""), 400, "'prompt' must not be empty"),
    ("empty string in a prompt list", COMPLETIONS, completion(prompt=["hi", ""]), 400, "'prompt' must not be empty"),
    ("empty id list in a batch", COMPLETIONS, completion(prompt=[[5, 6], []]), 400, "'prompt' must not be empty"),
    ("empty messages", CHAT, chat(messages=[]), 400, "'messages'"),
    ("invalid role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "'messages[0].role'"),
    ("content of wrong type", CHAT, chat(messages=[{"role": "user", "content": 3}]), 400, "'messages[0].content'"),
    ("n too large", COMPLETIONS, completion(n=1000), 400, "'n'"),
    ("n zero", CHAT, chat(n=0), 400, "'n'"),
    ("logprobs too many", COMPLETIONS, completion(logprobs=21), 400, "'logprobs'"),
    ("top_p out of range", CHAT, chat(top_p=1.5), 400, "'top_p'"),
    ("top_k past int64", COMPLETIONS, completion(top_k=2**70), 400, "'top_k'"),
    ("min_tokens over max_completion_tokens", CHAT, chat(max_completion_tokens=1, min_tokens=2), 400,
     "min_tokens = 2: must be an integer in [0, max_tokens = 1]"),
    ("content None outside a tool call", CHAT, chat(messages=[{"role": "user", "content": None}]), 400, "content"),
    ("empty stop string", COMPLETIONS, completion(stop=[""]), 400, "'stop'"),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("unpaired surrogate", COMPLETIONS, b'{"prompt": "a\\ud800b", "max_tokens": 1}', 400, "surrogate"),
    ("many negative token ids", COMPLETIONS, completion(prompt=[-1] * 200_000), 400, "'prompt' must be a string"),
    ("many bad stop_token_ids", CHAT, chat(stop_token_ids=[-1] * 200_000), 400, "'stop_token_ids"),
    ("logit_bias key not a token id", COMPLETIONS, completion(logit_bias={"the": 1.0}), 400,
     "'logit_bias' key 'the' is not a token id: keys are token ids written in decimal"),
    ("logit_bias key negative", CHAT, chat(logit_bias={"-5": 1.0}), 400, "'logit_bias' key '-5' is not a token id"),
    ("logit_bias of odd values", CHAT, chat(logit_bias={"5": "a"}), 400, "logit_bias[5] = 'a': keys must be token"),
    ("logit_bias past the vocabulary", COMPLETIONS, completion(logit_bias={"99999": 1}), 400,
     "logit_bias names token id 99999, past this model's vocabulary"),
    ("too many logit_bias entries", COMPLETIONS, completion(logit_bias={str(i): 1 for i in range(1025)}), 400,
     "at most 1024"),
    ("many bad logit_bias values", CHAT, chat(logit_bias={str(i): "x" for i in range(50_000)}), 400, "at most 1024"),
    ("empty allowed_token_ids", CHAT, chat(allowed_token_ids=[]), 400, "'allowed_token_ids'"),
    ("negative allowed_token_ids", COMPLETIONS, completion(allowed_token_ids=[5, -1]), 400, "'allowed_token_ids"),
    ("allowed_token_ids past the vocabulary", COMPLETIONS, completion(allowed_token_ids=[5, 99999]), 400,
     "allowed_token_ids names token id 99999"),
    ("too many allowed_token_ids", CHAT, chat(allowed_token_ids=[5] * 1025), 400, "at most 1024"),
    ("more prompts than sequences", COMPLETIONS, completion(prompt=["hi"] * 5000), 400, "sequences (prompts x n)"),
    ("too many stop_token_ids", COMPLETIONS, completion(stop_token_ids=[5] * 1025), 400, "at most 1024"),
    ("many bad messages", CHAT, chat(messages=[7] * 200_000), 400, "'messages[0]'"),
    ("echo logprobs past the limit", COMPLETIONS, completion(prompt=[[5] * 500] * 128, echo=True, logprobs=20), 400,
     "asks for 1,344,000 prompt logprob entries (64,000 prompt tokens x n 1 x (logprobs 20 + 1))"),
]


# (request model, body): every list-like field given many bad items
MANY_BAD_ITEMS = [
    (CompletionRequest, {"prompt": [-1] * 20_000}),
    (CompletionRequest, {"prompt": [5] * 19_999 + [-1]}),
    (CompletionRequest, {"prompt": [[-1]] * 20_000}),
    (CompletionRequest, {"prompt": [1.5] * 20_000}),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": [-1] * 20_000}),
    (CompletionRequest, {"prompt": "x", "allowed_token_ids": [-1] * 20_000}),
    (CompletionRequest, {"prompt": "x", "logit_bias": {str(i): "x" for i in range(20_000)}}),
    (CompletionRequest, {"prompt": "x", "stop": [1] * 20_000}),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"choice": [1] * 20_000}}),
    (ChatCompletionRequest, {"messages": [1] * 20_000}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [1] * 20_000}]}),
    (ChatCompletionRequest, {"messages": USER, "tools": [1] * 20_000}),
    (ChatCompletionRequest, {"messages": [{"role": "assistant", "tool_calls": [1] * 20_000}]}),
]


@pytest.mark.parametrize("model, body", MANY_BAD_ITEMS, ids=range(len(MANY_BAD_ITEMS)))
def test_many_bad_items_make_few_errors(model, body):
    """A list stops at its first bad item: pydantic would report each one, once for each union member the list is
    in, and building those errors held the server's event loop for seconds at a million items."""
    with pytest.raises(ValidationError) as raised:
        model.model_validate(body)
    assert len(raised.value.errors()) <= 4


@pytest.mark.parametrize("path, body, status, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_error(http, path, body, status, words):
    before = read_metrics(http)
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"]
    after = read_metrics(http)
    for name in ("deltaserve_prompt_tokens_total", "deltaserve_generation_tokens_total"):
        assert after[name] == before[name], f"{name}: the bad request reached the engine"


@pytest.mark.parametrize("body, param, words", [
    (completion(stop=""), "stop", "stop = ['']: must be non-empty strings"),
    (b'{"prompt": "hi", "repetition_penalty": Infinity}', "repetition_penalty", "repetition_penalty = inf: must be"),
    (completion(stop=list("abcdefghijklmnopq")), "stop", "a list of at most 16 non-empty strings"),
    (completion(max_tokens=10**400), "max_tokens", "'max_tokens' = 100000... (401 digits) must be less than"),
    (completion(prompt=[1, 999999]), "prompt", "prompt token id 999999 is out of range"),
    (completion(max_tokens=2, min_tokens=3), "min_tokens", "min_tokens = 3: must be an integer in [0, max_tokens = 2]"),
    (completion(min_tokens=-1), "min_tokens", "greater than or equal to 0"),
    (completion(logit_bias={"1e3": 1}), "logit_bias", "'logit_bias' key '1e3' is not a token id"),
    (b'{"prompt": "hi", "logit_bias": {"5": Infinity}}', "logit_bias", "logit_bias[5] = inf: keys must be"),
    (completion(logit_bias={"5": 1, "600": 2}), "logit_bias", "logit_bias names token id 600"),
    (completion(allowed_token_ids=[600]), "allowed_token_ids", "allowed_token_ids names token id 600"),
    (completion(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=1), "allowed_token_ids",
     "are all stop or EOS ids, which min_tokens = 1 masks"),
], ids=["empty stop string", "repetition_penalty infinite", "17 stop strings", "a 401-digit max_tokens",
        "a token id past the vocabulary", "min_tokens over max_tokens", "negative min_tokens",
        "logit_bias key not an id", "logit_bias infinite", "logit_bias past the vocabulary",
        "allowed id past the vocabulary", "allowed ids all masked"])
def test_a_bad_sampling_field_is_named_in_param(http, body, param, words):
    """The field SamplingParams refused is the error's param; a huge number is not echoed whole."""
    if isinstance(body, bytes):  # JSON's Infinity, which Python's json reads
        error = http.post(COMPLETIONS, content=body, headers={"content-type": "application/json"}).json()["error"]
    else:
        error = http.post(COMPLETIONS, json=body).json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value") and words in error["message"]
    assert len(error["message"]) < 200


def test_oversized_body_is_413_by_length_and_by_chunks(http, server):
    too_big = json.dumps(completion(prompt="x" * (server.app.state.max_body_bytes + 1))).encode()
    response = http.post(COMPLETIONS, content=too_big, headers={"content-type": "application/json"})
    assert response.status_code == 413 and "larger than" in response.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit must hold while reading
        for start in range(0, len(too_big), 64 << 10):
            yield too_big[start:start + (64 << 10)]

    response = http.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_a_body_nested_past_the_recursion_limit_is_a_400(http):
    """Tool parameters {"a": {"a": ... {}}} nested 0.6x Python's recursion limit deep: the body parses (json's
    parser recurses once a level), yet the chat template's walk over it recurses more than once a level and runs
    out of stack. The limit is read now: some libraries the suite imports raise it."""
    depth = int(sys.getrecursionlimit() * 0.6)
    tool = {"type": "function", "function": {"name": "f", "parameters": "NESTED"}}
    body = json.dumps(chat(tools=[tool])).replace('"NESTED"', '{"a": ' * depth + "{}" + "}" * depth)
    response = http.post(CHAT, content=body.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert "nests objects or lists too deeply" in response.json()["error"]["message"]


@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["missing key", "wrong key"])
def test_api_key_guards_v1_but_not_health(server, key):
    with server.http(api_key=key) as anonymous:
        for method, path in (("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", CHAT)):
            response = anonymous.request(method, path, json=completion())
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert "API key" in response.json()["error"]["message"]
        assert anonymous.get("/health").status_code == 200


def test_unknown_route_is_404_in_openai_shape(http):
    response = http.get("/v1/engines")
    assert response.status_code == 404 and "error" in response.json()


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, completion(n=None, stream=None, echo=None, ignore_eos=None, logprobs=None, temperature=0)),
    (CHAT, chat(n=None, stream=None, logprobs=None, ignore_eos=None, stream_options=None, temperature=0))])
def test_null_is_the_default(http, path, body):
    """OpenAI's SDK sends a None argument as null, and its API takes null for these fields: the default, not a 400."""
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice.get("logprobs") is None
    assert CompletionRequest.model_validate(completion(n=None, echo=None)).n == 1
    with pytest.raises(ValidationError, match="prompt"):  # a required field stays required
        CompletionRequest.model_validate(completion(prompt=None))


def test_every_response_carries_a_request_id(http):
    """x-request-id, as OpenAI's responses carry it: the client's own when plain, else a new one per request."""
    ok = http.post(COMPLETIONS, json=completion(), headers={"x-request-id": "trace-7:a.b_c"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "trace-7:a.b_c"
    assert ok.json()["system_fingerprint"] is None  # listed, as OpenAI lists it
    fresh = [http.post(COMPLETIONS, json=completion()).headers["x-request-id"] for _ in range(2)]
    assert all(rid.startswith("req-") for rid in fresh) and fresh[0] != fresh[1]
    odd = http.post(COMPLETIONS, json=completion(), headers={"x-request-id": "a b\u00e9".encode()})
    assert odd.headers["x-request-id"].startswith("req-")
    refused = http.post(COMPLETIONS, content=b'{"prompt": "\xff"}', headers={"x-request-id": "r1"})
    streamed = http.post(COMPLETIONS, json=completion(stream=True), headers={"x-request-id": "r2"})
    assert (refused.status_code, refused.headers["x-request-id"]) == (400, "r1")
    assert streamed.headers["x-request-id"] == "r2" and http.get("/health").headers["x-request-id"]


def test_normal_requests_succeed_after_bad_ones(http):
    for _, path, body, _, _ in CASES:
        http.post(path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
    response = http.post(COMPLETIONS, json=completion(max_tokens=3, temperature=0, ignore_eos=True))
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3
    response = http.post(CHAT, json=chat(max_tokens=3, ignore_eos=True))
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["role"] == "assistant"


def test_echo_logprobs_limit_counts_tokens_choices_and_entries():
    from types import SimpleNamespace

    from deltaserve.entrypoints.openai.errors import OpenAIError
    from deltaserve.entrypoints.openai.serving import MIN_ECHO_LOGPROBS, ServingContext, echo_logprobs_limit

    assert echo_logprobs_limit(1024) == MIN_ECHO_LOGPROBS and echo_logprobs_limit(1 << 20) == 2 << 20
    ctx = SimpleNamespace(max_model_len=1 << 20)  # a whole context's prompt with logprobs 1 fits (lm-eval's way)
    ServingContext.check_echo_logprobs(ctx, (1 << 20) - 1, 1, 1)
    ServingContext.check_echo_logprobs(ctx, 1 << 19, 2, 1)  # exactly at the limit
    with pytest.raises(OpenAIError, match="2,097,156 prompt logprob entries"):
        ServingContext.check_echo_logprobs(ctx, (1 << 19) + 1, 1, 3)
