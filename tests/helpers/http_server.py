"""Serving-test helpers: a real uvicorn server on a free loopback port in a thread, and /metrics reading.

Only loopback addresses are used; every wait here is bounded.
"""

from __future__ import annotations

import functools
import re
import socket
import threading
import time

import httpx
import uvicorn

from deltaserve.config import EngineConfig
from deltaserve.core.engine import Engine
from deltaserve.core.engine_process import EngineProcess
from deltaserve.entrypoints.llm import engine_arguments
from deltaserve.entrypoints.openai.api_server import build_app
from deltaserve.entrypoints.openai.serving import ServerConfig

API_KEY = "test-key"
MODEL_NAME = "tiny"


class ServerThread:
    """build_app(engine, config) served by uvicorn in a daemon thread; stop() drains and joins it. With
    engine_process the engine runs in a process of its own (EngineProcess), as `deltaserve serve` runs it."""

    def __init__(self, model_dir, server_config: ServerConfig, engine_process: bool = False, **engine_options):
        engine_options.setdefault("threads", 1)  # a second torch thread only fights other jobs on 2 cores
        if engine_process:
            self.engine = EngineProcess(functools.partial(engine_arguments, str(model_dir), **engine_options))
        else:
            self.engine = Engine(str(model_dir), EngineConfig(**engine_options))
        self.config = server_config
        self.app = build_app(self.engine, server_config)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=10))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self, timeout: float = 60) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()
        if isinstance(self.engine, EngineProcess):
            self.engine.close()

    def http(self, api_key: str | None = API_KEY, timeout: float = 60) -> httpx.Client:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)


def start_server(model_dir, api_key: str | None = API_KEY, max_queue: int = 256, max_body_bytes: int | None = 1 << 20,
                 engine_process: bool = False, sampling_defaults: dict | None = None,
                 **engine_options) -> ServerThread:
    config = ServerConfig(MODEL_NAME, api_key=api_key, max_queue=max_queue, max_body_bytes=max_body_bytes,
                          sampling_defaults=sampling_defaults or {})
    return ServerThread(model_dir, config, engine_process, **engine_options).start()


_SAMPLE = re.compile(r"^(deltaserve_\w+?)(?:\{([^}]*)\})? (\S+)$")


def read_metrics(client: httpx.Client) -> dict[str, float]:
    """GET /metrics as {name or name{labels, without model_name}: value}."""
    response = client.get("/metrics")
    response.raise_for_status()
    samples = {}
    for line in response.text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            name, labels, value = match.groups()
            labels = ",".join(p for p in (labels or "").split(",") if p and not p.startswith("model_name="))
            samples[f"{name}{{{labels}}}" if labels else name] = float(value)
    return samples


def wait_idle(client: httpx.Client, timeout: float = 15) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and every page and state slot is free; returns the metrics."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = read_metrics(client)
        idle = (metrics["deltaserve_num_requests_running"] == 0 and metrics["deltaserve_num_requests_waiting"] == 0
                and metrics["deltaserve_cache_free_blocks"] == metrics["deltaserve_cache_num_blocks"]
                and metrics["deltaserve_cache_free_state_slots"] == metrics["deltaserve_cache_num_state_slots"])
        if idle:
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not become idle with a full cache: {metrics}")
        time.sleep(0.05)
