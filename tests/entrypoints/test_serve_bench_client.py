"""benchmarks/serve_client.py, serve_bench.py's HTTP client: percentiles, server-sent event parsing, the request
schedule, per-request timings, and the two loads against a small aiohttp server on loopback (no engine)."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import sys
from pathlib import Path

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serve_client as client  # noqa: E402


def test_percentile_interpolates_between_ranks_as_numpy_does():
    values = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert [client.percentile(values, q) for q in (0, 25, 40, 50, 90, 100)] == [15.0, 20.0, 29.0, 35.0, 46.0, 50.0]
    assert client.percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert client.percentile([7.0], 99) == 7.0
    assert math.isnan(client.percentile([], 50))


STREAM = ('data: {"a": 1}\r\n\r\n: a comment\n\ndata: {"text": "héllo"}\n\n'
          'event: ignored\ndata: line one\ndata: line two\n\ndata: [DONE]\n\n').encode()
EVENTS = ['{"a": 1}', '{"text": "héllo"}', "line one\nline two", "[DONE]"]


@pytest.mark.parametrize("cut", range(len(STREAM) + 1))
def test_sse_events_are_the_same_wherever_the_bytes_are_cut(cut):
    decoder = client.SSEDecoder()  # a cut may fall inside CRLF or inside the two bytes of é
    assert decoder.feed(STREAM[:cut]) + decoder.feed(STREAM[cut:]) == EVENTS


def test_sse_decoder_holds_an_event_until_its_blank_line():
    decoder = client.SSEDecoder()
    assert decoder.feed(b"data: x\n") == []
    assert decoder.feed(b"\ndata: y\n\n") == ["x", "y"]


def test_poisson_schedule_is_seeded_and_its_gaps_average_one_over_the_rate():
    times = client.poisson_schedule(4000, rate=20.0, seed=3)
    assert times == client.poisson_schedule(4000, rate=20.0, seed=3) != client.poisson_schedule(4000, 20.0, seed=4)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20.0, rel=0.1)  # exponential: sd = mean


def test_an_infinite_rate_sends_everything_at_once_and_a_rate_of_zero_is_refused():
    assert client.poisson_schedule(3, math.inf, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="> 0"):
        client.poisson_schedule(3, 0.0, 0)


def test_event_text_reads_completions_and_chat_chunks():
    assert client.event_text({"choices": [{"index": 0, "text": "ab"}]}) == "ab"
    assert client.event_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert client.event_text({"choices": [{"delta": {"content": "hi"}}]}) == "hi"
    calls = [{"index": 0, "function": {"arguments": '{"x"'}}]
    assert client.event_text({"choices": [{"delta": {"tool_calls": calls}}]}) == '{"x"'
    assert client.event_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_a_requests_ttft_and_inter_token_latency():
    result = client.RequestResult(start=10.0, end=11.0, text_times=[10.2, 10.5, 10.8], output_tokens=7)
    assert result.ttft == pytest.approx(0.2)
    assert result.itl == pytest.approx(0.6 / 6)  # first to last text, over the 6 tokens after the first
    assert math.isnan(client.RequestResult(start=0.0, text_times=[1.0], output_tokens=1).itl)


def test_summary_counts_tokens_over_the_whole_run_and_leaves_errors_out_of_the_latencies():
    ok = [client.RequestResult(0.0, 1.0, [0.1 * (i + 1), 0.9], output_tokens=9) for i in range(4)]
    failed = client.RequestResult(0.0, 0.2, [0.05], output_tokens=0, error="HTTP 429: full")
    summary = client.summarize(ok + [failed], duration_s=2.0)
    assert (summary["requests"], summary["completed"], summary["errors"]) == (5, 4, 1)
    assert summary["output_tok_s"] == 36 / 2.0 and summary["request_s"] == 2.0
    assert summary["ttft_ms_p50"] == pytest.approx(250.0) and summary["ttft_ms_p99"] == pytest.approx(397.0)
    assert summary["first_errors"] == ["HTTP 429: full"]


def test_server_means_are_the_histograms_growth_over_the_run():
    before = {"deltaserve_time_to_first_token_seconds_sum": 1.0, "deltaserve_time_to_first_token_seconds_count": 2}
    after = {"deltaserve_time_to_first_token_seconds_sum": 1.6, "deltaserve_time_to_first_token_seconds_count": 5}
    means = client.server_means(before, after)
    assert means["server_ttft_ms_mean"] == pytest.approx(200.0) and math.isnan(means["server_tpot_ms_mean"])


def test_server_means_give_the_engine_steps_by_kind_over_the_run():
    before = {"deltaserve_engine_steps_total:decode": 10, "deltaserve_engine_step_seconds_total:decode": 0.5,
              "deltaserve_engine_step_tokens_total:decode": 100}
    after = {"deltaserve_engine_steps_total:decode": 30, "deltaserve_engine_step_seconds_total:decode": 1.5,
             "deltaserve_engine_step_tokens_total:decode": 900, "deltaserve_engine_steps_total:prefill": 2,
             "deltaserve_engine_step_seconds_total:prefill": 0.1, "deltaserve_engine_step_tokens_total:prefill": 48}
    means = client.server_means(before, after)
    assert (means["server_decode_steps"], means["server_decode_step_ms_mean"]) == (20, pytest.approx(50.0))
    assert means["server_decode_step_tokens_mean"] == 40 and means["server_prefill_step_tokens_mean"] == 24
    assert means["server_prefill_step_ms_mean"] == pytest.approx(50.0)


class FakeServer:
    """Streams `tokens` completion chunks of one token each, `delay` apart, then usage and [DONE]; counts the
    requests in flight and the order in which bodies arrive."""

    def __init__(self, tokens: int = 3, delay: float = 0.01):
        self.tokens, self.delay = tokens, delay
        self.in_flight = self.most_in_flight = 0
        self.seen: list[int] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body["id"])
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(self.tokens):
            await asyncio.sleep(self.delay)
            await response.write(f"data: {json.dumps({'choices': [{'text': 'x'}]})}\n\n".encode())
        await response.write(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 3}})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        self.in_flight -= 1
        return response


async def _serve(handler, run):
    """run(url of /v1/completions) while an aiohttp server answers it with handler."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await run(f"http://127.0.0.1:{port}/v1/completions")
    finally:
        await runner.cleanup()


def test_fixed_concurrency_keeps_n_requests_in_flight_and_sends_each_body_once():
    fake = FakeServer()
    bodies = [{"id": i} for i in range(10)]
    results, duration = asyncio.run(_serve(fake.handle, lambda url: client.run_concurrency(url, bodies, 3)))
    assert fake.most_in_flight == 3 and sorted(fake.seen) == list(range(10))
    assert all(r.error is None and r.output_tokens == 3 and len(r.text_times) == 3 for r in results)
    assert client.summarize(results, duration)["output_tokens"] == 30


def test_a_request_rate_sends_each_body_at_its_time():
    fake = FakeServer(tokens=1, delay=0.0)
    send_times = [0.0, 0.3, 0.6]

    results, _ = asyncio.run(_serve(fake.handle, lambda url: client.run_rate(url, [{"id": i} for i in range(3)],
                                                                           send_times)))
    starts = [r.start - results[0].start for r in results]
    assert starts == pytest.approx(send_times, abs=0.1)
    assert fake.seen == [0, 1, 2]


def test_a_stream_cut_before_done_and_an_error_status_are_errors():
    async def cut(request):
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        return response

    async def refuse(request):
        return web.json_response({"error": {"message": "full"}}, status=429)

    async def request(url):
        async with client.new_session(10) as session:
            return await client.stream_request(session, url, {})

    assert "without data: [DONE]" in asyncio.run(_serve(cut, request)).error
    assert asyncio.run(_serve(refuse, request)).error.startswith("HTTP 429")
