"""usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served, on whole responses and on
the final usage chunk of a stream, for completions and chat; 0 when nothing was cached. The session's server runs
with prefix caching on (the engine's default) and 16-token pages."""

from __future__ import annotations

import json
import random

BLOCK_SIZE = 16


def fresh_prompt(length: int) -> list[int]:
    """Token ids no other test sends (a random run over the tiny model's vocabulary, ids >= 5: not special)."""
    rng = random.Random()
    return [rng.randrange(5, 500) for _ in range(length)]


def expected_hit(prompt_len: int) -> int:
    """A repeated prompt reuses its whole pages short of its last token (the last one is always computed)."""
    return (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE


def stream_usage(http, path: str, body: dict) -> dict:
    """The usage of a stream's final chunk (the one with no choices)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", path, json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"] == []
    return events[-1]["usage"]


def test_completions_report_cached_prompt_tokens(client):
    prompt = fresh_prompt(40)
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == expected_hit(40) == 32
    assert again.usage.prompt_tokens == 40 and again.choices[0].text == first.choices[0].text


def test_streamed_completion_usage_reports_cached_tokens(http):
    body = {"model": "tiny", "prompt": fresh_prompt(50), "max_tokens": 4, "temperature": 0}
    assert stream_usage(http, "/v1/completions", body)["prompt_tokens_details"] == {"cached_tokens": 0}
    assert stream_usage(http, "/v1/completions", body)["prompt_tokens_details"] == {"cached_tokens": expected_hit(50)}


def test_chat_reports_cached_tokens_whole_and_streamed(client, http):
    words = " ".join(f"w{random.randrange(10**9)}" for _ in range(12))  # a long user message no other test sends
    messages = [{"role": "user", "content": f"Remember these words: {words}"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    prompt_len = first.usage.prompt_tokens
    assert prompt_len > BLOCK_SIZE
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == expected_hit(prompt_len)
    streamed = stream_usage(http, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 3})
    assert streamed["prompt_tokens_details"] == {"cached_tokens": expected_hit(prompt_len)}


def test_a_repeated_prompt_of_whole_pages_reuses_all_but_its_last_page(client):
    prompt = fresh_prompt(2 * BLOCK_SIZE)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == expected_hit(2 * BLOCK_SIZE) == BLOCK_SIZE


def test_a_prompt_shorter_than_a_page_reports_zero(client):
    prompt = fresh_prompt(BLOCK_SIZE)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # a hit leaves the last token: no boundary before it
