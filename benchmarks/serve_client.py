"""The HTTP side of serve_bench.py: a small asyncio client of OpenAI streaming endpoints and its statistics.

It needs the standard library and aiohttp only (both on the GPU image). A request's timings are taken where its
bytes arrive: TTFT is send to the first event that carries text (the chat role chunk carries none), the
inter-token latency is aiperf's (first to last text event over the output tokens after the first, per request),
and the inter-chunk gaps are the times between text events (a chunk may hold several tokens: a decode burst).
The output token count is the server's, from the usage chunk that stream_options.include_usage asks for.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from dataclasses import dataclass, field

import aiohttp

PERCENTILES = (50, 90, 99)
# the server's own view of a run, from deltaserve's /metrics: its histograms' sums and counts before and after
SERVER_HISTOGRAMS = {"server_ttft_ms_mean": "deltaserve_time_to_first_token_seconds",
                     "server_tpot_ms_mean": "deltaserve_time_per_output_token_seconds"}
# and its engine's steps by kind (decode, prefill): how many, the wall time they added, the tokens they computed
SERVER_STEP_COUNTERS = {"steps": "deltaserve_engine_steps_total", "seconds": "deltaserve_engine_step_seconds_total",
                        "tokens": "deltaserve_engine_step_tokens_total"}
_SAMPLE = re.compile(r"^(\w+)(?:\{[^}]*\})? (\S+)$")
_KIND = re.compile(r'kind="(\w+)"')


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy's default; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class SSEDecoder:
    """Server-sent events from bytes as they arrive: feed() returns the data of each event it completed.

    Events end with a blank line; an event's data lines are joined with newlines; comments (':') and other fields
    are skipped; CRLF and LF line ends both work, also when a chunk boundary splits one.
    """

    def __init__(self):
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events = []
        while (end := self._buffer.find(b"\n")) >= 0:
            line, self._buffer = self._buffer[:end].rstrip(b"\r").decode("utf-8"), self._buffer[end + 1:]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
        return events


def poisson_schedule(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: gaps drawn from an exponential of mean 1/rate (a Poisson process);
    all at 0 when the rate is infinite."""
    if rate <= 0:
        raise ValueError(f"request rate {rate}: must be > 0 requests/s (inf: all at once)")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


@dataclass
class RequestResult:
    """One streamed request as the client saw it; times in seconds from time.perf_counter()."""

    start: float
    end: float = math.nan
    text_times: list[float] = field(default_factory=list)  # arrival of each event that carried text
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.text_times[0] - self.start if self.text_times else math.nan

    @property
    def itl(self) -> float:
        """Mean time between output tokens after the first (aiperf's inter-token latency of one request)."""
        if self.output_tokens < 2 or not self.text_times:
            return math.nan
        return (self.text_times[-1] - self.text_times[0]) / (self.output_tokens - 1)


def event_text(event: dict) -> str:
    """The text a completions or chat chunk adds (content or tool-call arguments); '' for role and usage chunks."""
    text = ""
    for choice in event.get("choices") or []:
        if "text" in choice:
            text += choice["text"] or ""
        delta = choice.get("delta") or {}
        text += delta.get("content") or ""
        text += "".join(call.get("function", {}).get("arguments") or "" for call in delta.get("tool_calls") or [])
    return text


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict) -> RequestResult:
    """POST one streaming request and read it to the end; errors (status, in-band, connection) land in .error."""
    result = RequestResult(start=time.perf_counter())
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            await _read_events(response, result)
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.end = time.perf_counter()
    return result


async def _read_events(response: aiohttp.ClientResponse, result: RequestResult) -> None:
    decoder, done = SSEDecoder(), False
    async for chunk in response.content.iter_any():
        now = time.perf_counter()
        for data in decoder.feed(chunk):
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                result.error = f"in-band error: {event['error'].get('message', event['error'])}"
            if event_text(event):
                result.text_times.append(now)
            if event.get("usage"):
                result.output_tokens = event["usage"]["completion_tokens"]
    if not done and result.error is None:
        result.error = "the stream ended without data: [DONE]"


def new_session(timeout_s: float) -> aiohttp.ClientSession:
    """One session for a whole run: no cap on connections (the load decides how many are open)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def run_concurrency(url: str, bodies: list[dict], concurrency: int, timeout_s: float = 3600
                          ) -> tuple[list[RequestResult], float]:
    """`concurrency` streams, each sending its next body when its previous request ends, until all are sent;
    returns the results in body order and the run's wall time."""
    results: list[RequestResult | None] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))

    async def worker(session):
        for i in next_index:
            results[i] = await stream_request(session, url, bodies[i])

    async with new_session(timeout_s) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, len(bodies)))))
        return results, time.perf_counter() - start


async def run_rate(url: str, bodies: list[dict], send_times: list[float], timeout_s: float = 3600
                   ) -> tuple[list[RequestResult], float]:
    """Send body i at send_times[i] seconds from the start, whatever is in flight (an open loop)."""

    async def send_at(session, start, delay, body):
        await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
        return await stream_request(session, url, body)

    async with new_session(timeout_s) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(send_at(session, start, t, b) for t, b in zip(send_times, bodies)))
        return list(results), time.perf_counter() - start


async def read_server_histograms(base_url: str) -> dict[str, float]:
    """The _sum and _count samples of SERVER_HISTOGRAMS at GET /metrics; {} when the server has none."""
    names = {f"{h}_{part}" for h in SERVER_HISTOGRAMS.values() for part in ("sum", "count")}
    try:
        async with new_session(30) as session, session.get(f"{base_url}/metrics") as response:
            text = await response.text() if response.status == 200 else ""
    except aiohttp.ClientError:
        return {}
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in names:
            samples[match.group(1)] = samples.get(match.group(1), 0.0) + float(match.group(2))
        elif match and match.group(1) in SERVER_STEP_COUNTERS.values() and (kind := _KIND.search(line)):
            samples[f"{match.group(1)}:{kind.group(1)}"] = float(match.group(2))
    return samples


def server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean TTFT and time per output token (ms) of the requests that finished between two readings, as the
    server measured them (arrival at the engine to its first token; first token to the last), and the engine's
    steps in between by kind: their number, mean wall ms and mean tokens computed a step."""
    means = {}
    for key, name in SERVER_HISTOGRAMS.items():
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        means[key] = 1000 * total / count if count > 0 else math.nan
    for kind in ("decode", "prefill"):  # the engine's steps in between
        delta = {part: after.get(f"{name}:{kind}", 0.0) - before.get(f"{name}:{kind}", 0.0)
                 for part, name in SERVER_STEP_COUNTERS.items()}
        means.update(step_figures(f"server_{kind}", **delta))
    return means


def step_figures(prefix: str, steps: float, seconds: float, tokens: float) -> dict[str, float]:
    """A run's engine steps of one kind as serve_bench reports them (the server's and the offline engine's alike):
    how many, mean wall ms and mean tokens computed a step."""
    return {f"{prefix}_steps": steps, f"{prefix}_step_ms_mean": 1000 * seconds / steps if steps else math.nan,
            f"{prefix}_step_tokens_mean": tokens / steps if steps else math.nan}


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """The run's figures: output tok/s and requests/s over the whole wall time (prefill included), TTFT,
    inter-token latency and inter-chunk gap percentiles in ms over the requests that succeeded, and the errors."""
    ok = [r for r in results if r.error is None]
    output_tokens = sum(r.output_tokens for r in ok)
    gaps = [b - a for r in ok for a, b in zip(r.text_times, r.text_times[1:])]
    summary = {"requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
               "duration_s": duration_s, "output_tokens": output_tokens,
               "output_tok_s": output_tokens / duration_s if duration_s > 0 else math.nan,
               "request_s": len(ok) / duration_s if duration_s > 0 else math.nan}
    for name, values in (("ttft_ms", [r.ttft for r in ok]), ("itl_ms", [r.itl for r in ok]), ("chunk_gap_ms", gaps)):
        finite = [1000 * v for v in values if not math.isnan(v)]
        summary.update({f"{name}_p{q}": percentile(finite, q) for q in PERCENTILES})
        summary[f"{name}_mean"] = sum(finite) / len(finite) if finite else math.nan
    summary["first_errors"] = sorted({r.error for r in results if r.error is not None})[:3]
    return summary
