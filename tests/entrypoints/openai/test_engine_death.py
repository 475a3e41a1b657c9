"""The engine process dying under a server: the requests in flight, whole or streamed, are told 503 unavailable, as
the requests after them are, and the server itself keeps answering."""

from __future__ import annotations

import json
import threading
import time

import httpx
from helpers.http_server import start_server

LONG = {"prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def test_requests_in_flight_when_the_engine_dies_are_told_503(tiny_model):
    srv = start_server(tiny_model, max_model_len=512, engine_process=True)
    try:
        with srv.http() as http:
            whole: list[httpx.Response] = []
            thread = threading.Thread(target=lambda: whole.append(http.post("/v1/completions", json=LONG)))
            thread.start()
            with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
                lines = stream.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["text"] is not None
                srv.engine.process.kill()
                events = [line[6:] for line in lines if line.startswith("data: ")]
            thread.join(30)
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "unavailable" and "engine" in error["message"]
            [response] = whole
            assert response.status_code == 503 and response.json()["error"]["code"] == "unavailable"
            after = http.post("/v1/completions", json=LONG)
            assert after.status_code == 503 and after.json()["error"]["code"] == "unavailable"
            deadline = time.monotonic() + 10
            while http.get("/health").status_code != 503 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert http.get("/health").status_code == 503
    finally:
        srv.stop()
