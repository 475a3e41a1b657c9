"""The model folder's generation_config.json sets the sampling fields a request leaves out, as vLLM applies it; a
request's own fields win."""

from __future__ import annotations

import json

from helpers.http_server import start_server

from deltaserve.entrypoints.cli import build_parser
from deltaserve.entrypoints.openai.command import server_config


def test_serve_reads_the_model_folders_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "top_p": 0.8, "max_length": 9}))
    config = server_config(build_parser().parse_args(["serve", "--model", str(tmp_path)]))
    assert config.sampling_defaults == {"temperature": 0.5, "top_p": 0.8}
    assert server_config(build_parser().parse_args(["serve", "--model", str(tmp_path / "x")])).sampling_defaults == {}


def test_a_request_without_sampling_fields_takes_the_defaults(tiny_model):
    srv = start_server(tiny_model, max_model_len=256, sampling_defaults={"temperature": 0.0})
    try:
        with srv.http() as http:
            def text(**fields):
                body = {"prompt": [5, 6, 7], "max_tokens": 12, "ignore_eos": True, **fields}
                return http.post("/v1/completions", json=body).json()["choices"][0]["text"]

            greedy = text(temperature=0)
            assert text(seed=1) == text(seed=2) == greedy  # the default: greedy, whatever the seed
            assert text(temperature=1.0, seed=1) != text(temperature=1.0, seed=2)  # the request's own field wins
    finally:
        srv.stop()
