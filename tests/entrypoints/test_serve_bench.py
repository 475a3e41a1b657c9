"""benchmarks/serve_bench.py end to end on the demo model (CPU): the offline pass, then the server on the same
engine, driven at a fixed concurrency, at a request rate and through chat; every request completes with the asked
number of tokens and each concurrency run has its offline figure beside it. Bad counts are refused at once."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_bench.py"


@pytest.mark.slow
def test_serve_bench_runs_every_load_against_the_demo_model(tmp_path):
    out = tmp_path / "serve.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--concurrency", "2", "--requests-per-stream", "2",
                             "--request-rate", "inf", "--num-requests", "3", "--chat-concurrency", "2",
                             "--prompt-len", "24", "--output-len", "5", "--threads", "1", "--json-out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {run["name"]: run for run in report["runs"]}
    assert list(runs) == ["cmpl c2", "cmpl rinf", "chat c2"]
    assert [runs[name]["completed"] for name in runs] == [4, 3, 4]
    assert all(run["errors"] == 0 and run["output_tokens"] == 5 * run["requests"] for run in runs.values())
    assert runs["cmpl c2"]["ttft_ms_p50"] > 0 and runs["cmpl c2"]["itl_ms_p50"] > 0
    assert runs["cmpl c2"]["http_over_offline"] > 0 and runs["chat c2"]["offline_tok_s"] > 0
    assert runs["cmpl rinf"]["offline_tok_s"] is None  # a rate run has no offline twin
    assert runs["cmpl c2"]["server_decode_steps"] > 0 and runs["cmpl c2"]["offline_decode_steps"] > 0
    assert runs["cmpl c2"]["server_decode_step_ms_mean"] > 0 and runs["cmpl c2"]["offline_prefill_steps"] > 0
    assert "engine steps by kind" in result.stdout
    assert "--no-enable-prefix-caching" in report["serve_command"]
    assert "out tok/s" in result.stdout


@pytest.mark.parametrize("flag,value", [("--concurrency", "0"), ("--output-len", "0"), ("--request-rate", "0")])
def test_bad_counts_are_refused_before_any_engine(flag, value):
    result = subprocess.run([sys.executable, str(SCRIPT), flag, value], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and flag in result.stderr


def test_serve_start_times_each_start_to_its_first_health_200(tmp_path):
    """benchmarks/serve_start.py on the demo model: each start's seconds to /health 200 and its logged phases."""
    out = tmp_path / "start.json"
    result = subprocess.run([sys.executable, str(SCRIPT.parent / "serve_start.py"), "--starts", "2", "--json-out",
                             str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    starts = json.loads(out.read_text())["starts"]
    assert [s["start"] for s in starts] == [1, 2] and all(s["to_health_s"] > 0 for s in starts)
    assert all(any(p.startswith("start-up: weights") for p in s["phases"]) for s in starts)


def test_serve_start_refuses_no_starts():
    result = subprocess.run([sys.executable, str(SCRIPT.parent / "serve_start.py"), "--starts", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--starts must be at least 1" in result.stderr
