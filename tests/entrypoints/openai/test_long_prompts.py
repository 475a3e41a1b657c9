"""What long-context requests meet before the engine: a body limit that follows the model's length, and text
prompts long enough to stall the event loop tokenized in a worker thread."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from helpers.http_server import start_server

from deltaserve.entrypoints.openai import serving
from deltaserve.entrypoints.openai.serving import MIN_BODY_BYTES, body_limit


def test_body_limit_fits_a_prompt_that_fills_the_context():
    """16 bytes a token plus 1 MiB (a 1M-token context: 17 MiB), never under MIN_BODY_BYTES; a prompt of the whole
    context as JSON token ids (the largest ids, as json.dumps writes them) fits."""
    assert body_limit(512) == MIN_BODY_BYTES == 4 << 20
    assert body_limit(1 << 20) == 17 << 20
    for length in (300_000, 1 << 20):
        body = json.dumps({"model": "kimi-linear", "prompt": [163839] * length, "max_tokens": 1})
        assert len(body.encode()) < body_limit(length)


def test_server_without_a_body_limit_takes_the_model_lengths(tiny_model):
    server = start_server(tiny_model, max_model_len=512, max_body_bytes=None)
    try:
        assert server.app.state.max_body_bytes == body_limit(512)
        with server.http() as http:
            too_big = b" " * (body_limit(512) + 1)
            response = http.post("/v1/completions", content=too_big, headers={"content-type": "application/json"})
            assert response.status_code == 413 and str(body_limit(512)) in response.json()["error"]["message"]
    finally:
        server.stop()


@pytest.mark.parametrize("off_loop_chars,off_loop", [(serving.OFF_LOOP_CHARS, False), (1, True)])
def test_long_text_prompts_are_tokenized_off_the_event_loop(server, http, monkeypatch, off_loop_chars, off_loop):
    """A text of OFF_LOOP_CHARS or more (here: every text, with the threshold at 1) is tokenized in a worker thread,
    a shorter one on the event loop's thread; the tokens are the same either way."""
    tokenizer = server.app.state.async_engine.info.tokenizer
    threads, encode = [], tokenizer.encode

    def recorded(text, add_special_tokens=False):
        threads.append(threading.current_thread())
        return encode(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", recorded)
    monkeypatch.setattr(serving, "OFF_LOOP_CHARS", off_loop_chars)
    text = "In the beginning was the word"
    completion = http.post("/v1/completions", json={"model": "tiny", "prompt": [text, text + "s"], "max_tokens": 1})
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1,
                                                   "messages": [{"role": "user", "content": text}]})
    assert completion.status_code == chat.status_code == 200
    assert len(threads) == 3 and all((t is not server._thread) == off_loop for t in threads)
    assert completion.json()["usage"]["prompt_tokens"] == len(encode(text, True)) + len(encode(text + "s", True))


def test_the_loop_answers_while_a_long_prompt_is_tokenized(server, http, monkeypatch):
    """While one request's long prompt is being tokenized (held here until released), the server still answers
    others: /health returns at once. Tokenized on the event loop, /health would wait for the hold."""
    tokenizer = server.app.state.async_engine.info.tokenizer
    started, release, encode = threading.Event(), threading.Event(), tokenizer.encode

    def held(text, add_special_tokens=False):
        started.set()
        release.wait(30)
        return encode(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", held)
    monkeypatch.setattr(serving, "OFF_LOOP_CHARS", 1)
    results = []
    request = threading.Thread(target=lambda: results.append(http.post(
        "/v1/completions", json={"model": "tiny", "prompt": "a long prompt", "max_tokens": 1})))
    request.start()
    try:
        assert started.wait(30)
        start = time.monotonic()
        with server.http(timeout=5) as other:
            assert other.get("/health").status_code == 200
        assert time.monotonic() - start < 2
    except httpx.TimeoutException:
        pytest.fail("/health waited for the tokenizing request: the event loop was blocked")
    finally:
        release.set()
        request.join(30)
    assert results and results[0].status_code == 200
