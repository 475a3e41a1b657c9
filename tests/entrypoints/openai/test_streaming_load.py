"""Many clients at once: a dropped stream is aborted and its cache freed, a full queue answers 429, and a
bounded load of concurrent streams (a quarter dropped mid-way) leaves every completed answer right, no server
error, and the cache full again (read from /metrics). Loopback only; every loop is bounded."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import httpx
import openai
import pytest
from helpers.http_server import API_KEY, read_metrics, wait_idle

from deltaserve import SamplingParams


def test_dropped_stream_is_aborted_and_frees_its_cache(client, http):
    before = read_metrics(http)
    stream = client.completions.create(model="tiny", prompt="Tell me a long story", max_tokens=480,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    received = [chunk for _, chunk in zip(range(2), stream)]
    stream.close()
    after = wait_idle(http, timeout=10)
    assert len(received) == 2
    assert after['deltaserve_requests_finished_total{finished_reason="abort"}'] == \
        before.get('deltaserve_requests_finished_total{finished_reason="abort"}', 0) + 1
    generated = after["deltaserve_generation_tokens_total"] - before["deltaserve_generation_tokens_total"]
    assert generated < 480  # stopped, not run to the end


def test_metrics_count_the_engine_steps_by_kind(client, http):
    """deltaserve_engine_step*_total{kind}: a request's prompt computed in prefill steps, its outputs but the last in
    decode steps (a loaded engine's per-kind step time is what tells a slow step from a prefill-heavy mix)."""
    before = read_metrics(http)
    client.completions.create(model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=9, temperature=0,
                              extra_body={"ignore_eos": True})
    after = wait_idle(http)

    def grew(name: str, kind: str) -> float:
        key = f'deltaserve_engine_{name}_total{{kind="{kind}"}}'
        return after.get(key, 0) - before.get(key, 0)

    assert grew("step_tokens", "prefill") == 5 and grew("step_tokens", "decode") == 8
    assert grew("steps", "prefill") == 1 and grew("steps", "decode") >= 1
    assert grew("step_seconds", "prefill") > 0 and grew("step_seconds", "decode") > 0


def test_client_leaving_a_non_streaming_request_aborts_it(thread_server, monkeypatch):
    """The client leaves while the engine is held after its request's first step (not after some wall time, which a
    fast engine could outrun); every later step passes through the event loop, which hears the disconnect. The
    engine runs in a thread of the server's process here, where its step can be held."""
    with thread_server.http() as http:
        before = read_metrics(http)
        first_step, left = threading.Event(), threading.Event()
        step = thread_server.engine.step

        def held_step():
            outputs = step()
            if outputs and not first_step.is_set():
                first_step.set()
                left.wait(timeout=30)
            return outputs

        monkeypatch.setattr(thread_server.engine, "step", held_step)
        body = json.dumps({"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 480, "ignore_eos": True})
        host, port = thread_server.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as client:
            client.sendall((f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {API_KEY}\r\n"
                            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n{body}").encode())
            assert first_step.wait(timeout=30)
        left.set()
        after = wait_idle(http, timeout=10)
    assert after['deltaserve_requests_finished_total{finished_reason="abort"}'] == \
        before.get('deltaserve_requests_finished_total{finished_reason="abort"}', 0) + 1
    assert after["deltaserve_generation_tokens_total"] - before["deltaserve_generation_tokens_total"] < 480


def test_full_queue_answers_429_then_recovers(small_server):
    """small_server runs 2 requests and queues 1: a fourth at once is refused with 429 and Retry-After."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=small_server.base_url, headers=headers, timeout=60) as http:
        streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(3)]
        responses = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in responses] == [200, 200, 200]
            refused = http.post("/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "queue_full"
            assert refused.json()["error"]["type"] == "rate_limit_error"
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
        wait_idle(http)
        assert http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2}).status_code == 200


@pytest.mark.slow
def test_64_concurrent_streams_with_a_quarter_dropped(server, http, offline_llm):
    prompts = [[10 + 7 * i + j for j in range(3 + 5 * i)] for i in range(8)]
    jobs = [(prompts[i % 8], 6 + (i % 5) * 3, i % 4 == 0) for i in range(64)]  # (prompt, max_tokens, dropped)
    kinds = sorted({(tuple(p), m) for p, m, _ in jobs})
    outputs = offline_llm.generate([{"prompt_token_ids": list(p)} for p, _ in kinds],
                                   [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in kinds],
                                   use_tqdm=False)
    expected = {kind: out.outputs[0].text for kind, out in zip(kinds, outputs)}

    async def one(client, prompt, max_tokens, dropped):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason
            if dropped and len(text) > 0:
                await stream.close()
                return None
        return text, finish

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, *job) for job in jobs)), timeout=240)

    results = asyncio.run(run_all())  # any error status (a 5xx included) raises here
    completed = [(job, result) for job, result in zip(jobs, results) if result is not None]
    assert len(completed) == 48
    for (prompt, max_tokens, _), (text, finish) in completed:
        assert text == expected[(tuple(prompt), max_tokens)] and finish == "length"
    metrics = wait_idle(http)
    assert not [k for k in metrics if k.startswith('deltaserve_requests_rejected_total{status="5')]
