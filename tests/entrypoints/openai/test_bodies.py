"""Large bodies off the event loop, in pieces. Requests: validated in pieces against the models' own validation of
the whole (the same request, or the same error). Responses: rendered in pieces against JSONResponse (the same
bytes). Fresh random bodies, with lists of ragged lengths around the piece size."""

from __future__ import annotations

import json
import random
import threading

import pytest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from deltaserve.entrypoints.openai import request_body, serving
from deltaserve.entrypoints.openai.errors import OpenAIError, describe_validation
from deltaserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

PIECE = 3
CHAT = "/v1/chat/completions"


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of PIECE, and every body decoded by json's Python scanner."""
    monkeypatch.setattr(request_body, "PIECE", PIECE)
    monkeypatch.setattr(request_body, "MANY_CONTAINERS", 0)


def outcome(raw: bytes, model, in_pieces: bool):
    try:
        return "ok", request_body.parse_body(raw, model, in_pieces).model_dump()
    except RequestValidationError as e:
        return "error", describe_validation(e.errors())
    except OpenAIError as e:
        return "error", (e.message, e.param)


def ragged(rng: random.Random) -> int:
    return rng.choice([0, 1, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE, 2 * PIECE + 1, rng.randrange(4 * PIECE)])


def completion_body(rng: random.Random) -> dict:
    n = ragged(rng)
    prompt = rng.choice([lambda: "hello", lambda: [f"t{i}" for i in range(n)], lambda: [rng.randrange(100)] * n,
                         lambda: [[rng.randrange(100)] * max(1, ragged(rng)) for _ in range(min(n, 9))]])()
    return {"prompt": prompt, "max_tokens": 4}


def chat_body(rng: random.Random) -> dict:
    def content(i: int):
        return f"m{i}" if rng.random() < 0.5 else [{"type": "text", "text": f"p{j}"} for j in range(ragged(rng))]

    body = {"messages": [{"role": rng.choice(["user", "assistant", "system"]), "content": content(i)}
                         for i in range(max(1, ragged(rng)))]}
    if rng.random() < 0.5:
        body["tools"] = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(ragged(rng))]
    return body


BAD_ITEMS = {"prompt": [7, None, ["x"], -1, "7", 2.5, True, 2**31, [-1]], "messages": [
    {"role": "robot", "content": "x"}, {"content": "x"}, "hi", {"role": "user", "content": 5}],
    "content": [{"type": "image"}, {"text": "x"}, "p"], "tools": ["f", 3, None]}


def spoil_one(rng: random.Random, body: dict) -> dict:
    """body with one thing wrong, or as it is (a third of the time): an item of one of its lists (a prompt of one
    type then another from a random index on, among them), or a scalar field. Of several errors, the one reported
    may differ (request_body's docstring)."""
    lists = [(name, value) for name, value in body.items() if isinstance(value, list) and value]
    lists += [("content", m["content"]) for m in body.get("messages", ()) if isinstance(m["content"], list) and
              m["content"]]
    lists += [("prompt", ids) for ids in body.get("prompt", ()) if isinstance(ids, list)]  # a list of token-id lists
    choice = rng.randrange(3)
    if choice == 0 or not lists:
        return {**body, "temperature": "hot"} if choice == 0 else body
    name, items = rng.choice(lists)
    index = rng.randrange(len(items))
    if choice == 1 or name != "prompt":
        items[index] = rng.choice(BAD_ITEMS[name])
    else:
        items[index:] = [f"t{i}" if isinstance(items[0], int) else i for i in range(len(items) - index)]
    return body


@pytest.mark.parametrize("seed", range(200))
def test_a_body_in_pieces_is_the_body_whole(small_pieces, seed):
    rng = random.Random(seed)
    model, body = (CompletionRequest, completion_body(rng)) if seed % 2 else (ChatCompletionRequest, chat_body(rng))
    raw = json.dumps(spoil_one(rng, body)).encode()
    assert outcome(raw, model, True) == outcome(raw, model, False), body


def test_long_lists_are_validated_in_pieces(small_pieces, monkeypatch):
    """The pieces are the point: no call of a field's validator weighs more than PIECE (items and the items of their
    lists; one more for a piece of a long list inside a list), wherever the long lists are."""
    seen = []
    adapter = request_body._field_adapter
    monkeypatch.setattr(request_body, "_field_adapter", lambda model, name: _Counting(adapter(model, name), seen))
    parts = [{"type": "text", "text": "p"}]
    messages = [{"role": "user", "content": "x"} for _ in range(3 * PIECE + 1)]
    messages[1]["content"] = parts * (2 * PIECE)
    messages[4:4 + PIECE] = [{"role": "user", "content": parts * (PIECE - 1)}] * PIECE  # heavy, not long
    request = request_body.parse_body(json.dumps({"messages": messages}).encode(), ChatCompletionRequest, True)
    assert [len(m.content) for m in request.messages] == [len(m["content"]) for m in messages]
    prompt = [[7] * (3 * PIECE + 1), [8] * (PIECE - 1), [9]]
    assert request_body.parse_body(json.dumps({"prompt": prompt}).encode(), CompletionRequest, True).prompt == prompt
    assert seen and max(seen) <= PIECE + 1


class _Counting:
    def __init__(self, adapter, seen: list):
        self.adapter, self.seen = adapter, seen

    def validate_python(self, items):
        self.seen.append(sum(1 + _inner(item) for item in items))
        return self.adapter.validate_python(items)


def _inner(item) -> int:
    if isinstance(item, list):
        return len(item)
    return len(item.get("content", ())) if isinstance(item, dict) and isinstance(item.get("content"), list) else 0


@pytest.mark.parametrize("raw, words", [
    (b"", "body is empty"), (b"{\"messages\": [", "not valid JSON"), (b"[1, 2]", "must be a JSON object"),
    (b"{\x00\x00\x00}\x00\x00", "not valid JSON"),  # UTF-8 that json would take for UTF-32
    (b'{"messages": [], "max_tokens": 1' + b"1" * 5000 + b"}", "not valid JSON"),  # past Python's int digits
    (b"\xef\xbb\xbf[1]", "must be a JSON object")])  # a byte-order mark is read past
def test_not_a_body(small_pieces, raw, words):
    for in_pieces in (False, True):
        status, (message, _) = outcome(raw, ChatCompletionRequest, in_pieces)
        assert status == "error" and words in message


def test_a_body_nested_too_deep_goes_to_the_recursion_handler_either_way(small_pieces):
    raw = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for in_pieces in (False, True):
        with pytest.raises(RecursionError):
            request_body.parse_body(raw, CompletionRequest, in_pieces)


def test_a_body_not_sent_as_json_is_refused_with_how_to_send_it(http):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        response = http.post(CHAT, content=body, headers=headers)
        assert response.status_code == 400
        assert "Content-Type: application/json" in response.json()["error"]["message"]
    assert http.post(CHAT, content=body, headers={"content-type": "application/json; charset=utf-8"}).status_code == 200


def test_a_large_body_is_checked_as_a_small_one(http, monkeypatch):
    """Over OFF_LOOP_BYTES, the body is validated in a worker thread and in pieces; its bad item is named."""
    monkeypatch.setattr(request_body, "OFF_LOOP_BYTES", 1 << 16)
    parse, calls = request_body.parse_body, []
    monkeypatch.setattr(request_body, "parse_body", lambda *args: calls.append(args[2:]) or parse(*args))
    messages = [{"role": "user", "content": "x" * 100} for _ in range(2000)]
    index = len(messages) - 7
    messages[index] = {"role": "robot", "content": "x"}
    response = http.post(CHAT, json={"messages": messages})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == f"messages[{index}].role"
    assert calls == [(True,)]


def random_json(rng: random.Random, depth: int = 0):
    """A JSON value of every kind, with lists of ragged lengths around the render piece."""
    kind = rng.choice(["list", "dict", "scalar"] if depth < 3 else ["scalar"])
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(ragged(rng))]
    if kind == "dict":
        return {rng.choice(["a", "é", "\u2028", "k\"", f"{depth}"]) + str(i): random_json(rng, depth + 1)
                for i in range(rng.randrange(4))}
    return rng.choice([None, True, False, 0, -7, 2**40, 0.1, -9999.0, 1e300, "", "x", "ü\n\t\"\\", "😀", "\x00"])


@pytest.mark.parametrize("seed", range(100))
def test_a_response_rendered_in_pieces_is_the_response_rendered_whole(monkeypatch, seed):
    monkeypatch.setattr(serving, "RENDER_PIECE", PIECE)
    content = {"choices": [random_json(random.Random(seed)) for _ in range(2)], "n": {1: 2}}
    assert serving.render_json(content) == JSONResponse(content).body


def test_a_long_logprobs_response_is_rendered_off_the_loop(http, monkeypatch):
    """Past OFF_LOOP_ENTRIES, the echo's logprobs are built and rendered in a thread: the same response."""
    body = {"prompt": list(range(5, 105)), "max_tokens": 2, "echo": True, "logprobs": 3, "temperature": 0}
    small = http.post("/v1/completions", json=body).json()
    monkeypatch.setattr(serving, "OFF_LOOP_ENTRIES", 10)
    rendered, render = [], serving.render_json
    monkeypatch.setattr(serving, "render_json", lambda content: rendered.append(1) or render(content))
    large = http.post("/v1/completions", json=body).json()
    assert rendered and {**large, "id": None, "created": None} == {**small, "id": None, "created": None}


def test_a_long_prompt_is_tokenized_while_large_bodies_are_parsed(server, http, monkeypatch):
    """Bodies and responses have worker threads of their own: with every one of them busy, a long text prompt (one
    tokenized in a worker thread) is still answered."""
    monkeypatch.setattr(request_body, "OFF_LOOP_BYTES", 1 << 10)
    monkeypatch.setattr(serving, "OFF_LOOP_CHARS", 64)
    release, parse, started = threading.Event(), request_body.parse_body, threading.Semaphore(0)

    def held(raw, model, in_pieces=False):  # a large body (in pieces, in a bulk thread) waits for release
        if in_pieces:
            started.release()
            assert release.wait(30)
        return parse(raw, model, in_pieces)

    monkeypatch.setattr(request_body, "parse_body", held)
    large = {"prompt": list(range(5, 400)), "max_tokens": 1}

    def send(codes: list) -> None:
        with server.http() as own:
            codes.append(own.post("/v1/completions", json=large).status_code)

    codes = []
    threads = [threading.Thread(target=send, args=(codes,)) for _ in range(serving.BULK_THREADS)]
    for thread in threads:
        thread.start()
    try:
        for _ in threads:
            assert started.acquire(timeout=30)  # every bulk thread holds a body
        text = {"prompt": "the " * 100, "max_tokens": 1}
        assert http.post("/v1/completions", json=text, timeout=10).status_code == 200
    finally:
        release.set()
        for thread in threads:
            thread.join()
    assert codes == [200] * serving.BULK_THREADS
