"""`deltaserve serve` as a process: it binds loopback, serves, and on SIGTERM lets the stream in flight finish
(every token and `data: [DONE]`), then exits 0 and stops listening."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from deltaserve.entrypoints.cli import main
from deltaserve.entrypoints.openai import api_server
from deltaserve.entrypoints.openai.command import bind_address


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_sigterm_drains_the_stream_in_flight_then_exits(tiny_model, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.entrypoints.cli", "serve", "--model", str(tiny_model), "--port", str(port),
         "--served-model-name", "tiny", "--threads", "1", "--max-model-len", "512"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "DELTASERVE_API_KEY": "env-key"})
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base)
        headers = {"authorization": "Bearer env-key"}
        body = {"model": "tiny", "prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        events, first_chunk = [], threading.Event()

        def read_stream():
            with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=headers, timeout=120) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        first_chunk.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert first_chunk.wait(60)
        proc.send_signal(signal.SIGTERM)
        num_events_at_signal = len(events)
        reader.join(120)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert events[-1] == "data: [DONE]", (tmp_path / "serve.log").read_text()[-2000:]
    assert num_events_at_signal < len(events) - 10  # the stream was in flight when the signal came
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 300
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health", timeout=5)


@pytest.mark.parametrize("option, words", [(["--max-queue", "-1"], "--max-queue -1"), (["--port", "70000"], "--port"),
                                           (["--api-key", " "], "--api-key is empty")])
def test_serve_rejects_a_bad_option_before_loading(capsys, option, words):
    assert main(["serve", "--model", "/nonexistent", *option]) == 2
    assert words in capsys.readouterr().err


def test_serve_refuses_an_address_in_use_or_unknown_before_loading(capsys):
    """The address is bound before the model loads: an address in use or a host that does not resolve is one line,
    exit 2 (the model folder does not exist, so an error from the load would name it instead)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "/nonexistent", "--port", str(port)]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert f"cannot listen on 127.0.0.1:{port}" in line and "another --port" in line
    assert main(["serve", "--model", "/nonexistent", "--host", "nowhere.invalid"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "--host nowhere.invalid: cannot resolve it" in line
    assert main(["serve", "--model", "/nonexistent", "--host", "192.0.2.1"]) == 2  # TEST-NET-1: no machine's own
    [line] = capsys.readouterr().err.splitlines()
    assert "cannot listen on 192.0.2.1:8000" in line and "an address of this machine with --host" in line


@pytest.mark.parametrize("host, family, address", [
    ("localhost", socket.AF_INET, "127.0.0.1"), ("", socket.AF_INET, "0.0.0.0"), ("::1", socket.AF_INET6, "::1")])
def test_bind_address_takes_uvicorns_family(monkeypatch, host, family, address):
    """IPv4 unless the host holds a colon, whichever address the resolver lists first (as uvicorn binds)."""
    real = socket.getaddrinfo

    def ipv6_first(name, port, family=0, *args, **kwargs):  # lists ::1 first for localhost, as many resolvers do
        found = real(name, port, family, *args, **kwargs)
        if name == "localhost" and kwargs.get("family", family) == socket.AF_UNSPEC:
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))] + found
        return found

    monkeypatch.setattr(socket, "getaddrinfo", ipv6_first)
    if family == socket.AF_INET6 and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    with bind_address(host, 0) as sock:
        assert sock.family == family and sock.getsockname()[0] == address


def _wait_healthy(proc: subprocess.Popen, base: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited before it was healthy"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become healthy")


def test_start_up_stays_frozen_until_the_last_server_of_the_process_stops():
    """gc.freeze acts on the whole process: a second server's stop must not thaw the first's start-up objects."""
    running = api_server._frozen_by  # the test session's own servers, if any are up
    api_server._freeze_start_up()
    api_server._freeze_start_up()
    assert gc.get_freeze_count() > 0
    api_server._thaw()
    assert gc.get_freeze_count() > 0
    api_server._thaw()
    assert api_server._frozen_by == running and (gc.get_freeze_count() == 0) == (running == 0)
