"""Prometheus metrics of one server, fed by the engine loop (EngineObserver) and read at GET /metrics.

Each server has its own CollectorRegistry, so several servers in one process (tests) do not collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from deltaserve.core.async_engine import EngineObserver, EngineStats
from deltaserve.core.outputs import RequestOutput, StepTotals

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics(EngineObserver):
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = dict(labelnames=["model_name"], registry=self.registry)

        def gauge(name, doc):
            return Gauge(f"deltaserve_{name}", doc, **labels).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (including preempted).")
        self.cache_usage = gauge("cache_usage_ratio", "Fraction of MLA cache pages in use, 0 to 1.")
        self.free_blocks = gauge("cache_free_blocks", "MLA cache pages free.")
        self.num_blocks = gauge("cache_num_blocks", "MLA cache pages in all.")
        self.free_slots = gauge("cache_free_state_slots", "KDA state slots free.")
        self.num_slots = gauge("cache_num_state_slots", "KDA state slots in all.")
        self.prompt_tokens = Counter("deltaserve_prompt_tokens", "Prompt tokens prefilled.",
                                     **labels).labels(model_name)
        self.generation_tokens = Counter("deltaserve_generation_tokens", "Tokens generated.",
                                         **labels).labels(model_name)
        self.finished = Counter("deltaserve_requests_finished", "Engine requests finished, by reason.",
                                labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram("deltaserve_time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=TTFT_BUCKETS, **labels).labels(model_name)
        self.tpot = Histogram("deltaserve_time_per_output_token_seconds", "Mean time between output tokens.",
                              buckets=TPOT_BUCKETS, **labels).labels(model_name)
        self.e2e = Histogram("deltaserve_e2e_request_latency_seconds", "Arrival to finish.", buckets=E2E_BUCKETS,
                             **labels).labels(model_name)
        self.rejected = Counter("deltaserve_requests_rejected", "HTTP requests answered with a 4xx/5xx error.",
                                labelnames=["model_name", "status"], registry=self.registry)
        step_labels = dict(labelnames=["model_name", "kind"], registry=self.registry)
        self.steps = Counter("deltaserve_engine_steps", "Engine steps, by kind: decode (one token a request) or "
                             "prefill (with a prompt chunk).", **step_labels)
        self.step_seconds = Counter("deltaserve_engine_step_seconds", "Wall time the engine's steps added, by kind "
                                    "(idle time excluded).", **step_labels)
        self.step_tokens = Counter("deltaserve_engine_step_tokens", "Tokens the engine's steps computed, by kind.",
                                   **step_labels)
        self._steps_seen: dict[str, StepTotals] = {}
        self.model_name = model_name

    def on_step(self, stats: EngineStats) -> None:
        cache = stats.cache
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.cache_usage.set(cache.usage)
        self.free_blocks.set(cache.num_free_blocks)
        self.num_blocks.set(cache.num_blocks)
        self.free_slots.set(cache.num_free_slots)
        self.num_slots.set(cache.num_slots)
        for kind, totals in stats.steps.items():  # the engine's running totals, as counter increments
            seen = self._steps_seen.get(kind, StepTotals())
            self.steps.labels(self.model_name, kind).inc(totals.steps - seen.steps)
            self.step_seconds.labels(self.model_name, kind).inc(max(0.0, totals.seconds - seen.seconds))
            self.step_tokens.labels(self.model_name, kind).inc(totals.tokens - seen.tokens)
            self._steps_seen[kind] = totals

    def on_output(self, output: RequestOutput, num_new_tokens: int, first: bool) -> None:
        self.generation_tokens.inc(num_new_tokens)
        times = output.metrics
        if first:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            if "first_token_time" in times:
                self.ttft.observe(times["first_token_time"] - times["arrival_time"])
        if not output.finished:
            return
        completion = output.outputs[0]
        if not completion.token_ids:
            self.prompt_tokens.inc(len(output.prompt_token_ids))  # max_tokens 0: only the prompt was run
        self.finished.labels(self.model_name, completion.finish_reason or "unknown").inc()
        if "finish_time" in times:
            self.e2e.observe(times["finish_time"] - times["arrival_time"])
            if len(completion.token_ids) > 1 and "first_token_time" in times:
                self.tpot.observe((times["finish_time"] - times["first_token_time"]) / (len(completion.token_ids) - 1))

    def on_abort(self, num_requests: int) -> None:
        self.finished.labels(self.model_name, "abort").inc(num_requests)

    def on_error_response(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
