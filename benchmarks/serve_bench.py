"""The HTTP server measured as clients see it, against the offline engine on the same requests and engine flags.

    python benchmarks/serve_bench.py                                      # the demo model on the CPU
    python benchmarks/serve_bench.py --config benchmarks/configs/kimi-linear-48b-a3b.json --load-format dummy \\
        --device cuda --concurrency 64,256 --prompt-len 512 --output-len 128

Self-started (the default), it writes the requests, starts serve_bench_engine.py (one engine: `LLM.generate` on
each run's requests first, then `deltaserve serve` on that same engine, so both share every engine flag), drives
the server with serve_client.py's asyncio client and prints, per run, the HTTP output tok/s over the whole run
(prefill included), the offline figure and their ratio, requests/s, TTFT, inter-token latency and inter-chunk gap
percentiles, and the errors. With --url it drives a server already running (no offline figure).

Loads: --concurrency N (N streams, each sending its next request when its previous one ends: N x
--requests-per-stream requests) and --request-rate R (--num-requests sent at Poisson arrivals of R a second).
Requests: completions with random token-id prompts of --prompt-len, greedy, ignore_eos, --output-len tokens; with
--chat-concurrency, also streaming chat of about --prompt-len tokens (random words; needs a tokenizer). A --config
model gets the synthetic Kimi tokenizer of tests/helpers/kimi_tokenizer.py (the published vocabulary's size).
Prefix caching is off unless --enable-prefix-caching: the offline pass would otherwise serve the HTTP runs' prompts
from its cache.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from serve_client import poisson_schedule, read_server_histograms, run_concurrency, run_rate, server_means, summarize
from serve_workload import build_plan, prepare_model

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ENGINE_FLAGS = ("device", "dtype", "load_format", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                "num_decode_steps", "threads", "gpu_memory_utilization", "quantization", "seed")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (http://host:port): no offline baseline")
    p.add_argument("--model", default=None, help="model folder (default: the bundled demo model)")
    p.add_argument("--config", default=None, help="a config.json, with --load-format dummy (the 48B shape)")
    p.add_argument("--served-model-name", default="bench")
    p.add_argument("--concurrency", type=_ints, default=[8], help="e.g. 64,256")
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--request-rate", type=_floats, default=[], help="Poisson request rates, e.g. 4,inf")
    p.add_argument("--num-requests", type=int, default=32, help="requests of each --request-rate run")
    p.add_argument("--chat-concurrency", type=_ints, default=[], help="streaming chat runs at these concurrencies")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--warmup-output-len", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times; also the engine's --seed")
    p.add_argument("--no-offline", action="store_true", help="skip the offline baseline")
    p.add_argument("--json-out", default=None)
    p.add_argument("--server-log", default=None, help="keep the server process's log here (default: a temporary file)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the server to start and for each run")
    g = p.add_argument_group("engine flags, passed to both measurements (bench's defaults, not serve's)")
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default=None)
    g.add_argument("--load-format", default="auto")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-model-len", type=int, default=None, help="default: prompt + output, rounded up to 256")
    g.add_argument("--num-decode-steps", type=int, default=None)
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--quantization", default=None, help="e.g. fp8: FP8 weights (the 48B shape on an 80 GB card)")
    g.add_argument("--enable-prefix-caching", action="store_true")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="serve's --engine-process: the server's engine in a process of its own (default, as serve's)")
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    counts = args.concurrency + args.chat_concurrency + [args.requests_per_stream, args.num_requests,
                                                         args.prompt_len, args.output_len, args.warmup_output_len]
    if min(counts) < 1:
        parser.error("--concurrency, --chat-concurrency, --requests-per-stream, --num-requests, --prompt-len, "
                     "--output-len and --warmup-output-len must be at least 1")
    if any(r <= 0 for r in args.request_rate):
        parser.error(f"--request-rate {args.request_rate}: each must be > 0 (inf: all at once)")
    if args.config and args.load_format != "dummy":
        parser.error("--config FILE has no weights: add --load-format dummy (or pass --model DIR)")
    if args.max_model_len is None:
        args.max_model_len = -(-(args.prompt_len + args.output_len + 64) // 256) * 256  # chat prompts run a bit over


def engine_command(args: argparse.Namespace, model_dir: Path, port: int) -> list[str]:
    """The `deltaserve serve` command line of both measurements."""
    # no --model for the demo model: serve then picks its one-thread default, as `deltaserve serve` does
    model = ["--model", str(model_dir)] if args.model or args.config else []
    cmd = ["serve", *model, "--port", str(port), "--served-model-name", args.served_model_name,
           "--max-queue", str(max(256, args.num_requests)),
           "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
           "--engine-process" if args.engine_process else "--no-engine-process"]
    for name in ENGINE_FLAGS:
        value = getattr(args, name)
        if value is not None:
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    return cmd


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM (the server drains), then SIGKILL past timeout seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server process exited ({proc.returncode}); its log ends:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s; its log ends:\n{_tail(log)}")


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def run_http(url: str, plan: dict, timeout: float) -> list[dict]:
    """The warm-up runs, then each run of the plan; one summary per run."""
    for warmup in plan["warmup"]:
        asyncio.run(run_concurrency(f"{url}{warmup['path']}", warmup["bodies"], warmup["concurrency"], timeout))
    rows = []
    for run in plan["runs"]:
        endpoint = f"{url}{run['path']}"
        before = asyncio.run(read_server_histograms(url))
        if run["rate"] is None:
            results, duration = asyncio.run(run_concurrency(endpoint, run["bodies"], run["concurrency"], timeout))
        else:
            times = poisson_schedule(len(run["bodies"]), run["rate"], run["seed"])
            results, duration = asyncio.run(run_rate(endpoint, run["bodies"], times, timeout))
        server = server_means(before, asyncio.run(read_server_histograms(url)))
        rows.append({"name": run["name"], "mode": run["mode"], "load": run["load"], **summarize(results, duration),
                     **server})
        print(f"http {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def run_self_started(args: argparse.Namespace, plan: dict, model_dir: Path,
                     workdir: Path) -> tuple[list[dict], list[dict], list[str]]:
    """Start serve_bench_engine.py (offline runs, then the server), drive it, stop it."""
    port = free_port()
    requests, offline_out = workdir / "requests.json", workdir / "offline.json"
    log = Path(args.server_log) if args.server_log else workdir / "server.log"
    requests.write_text(json.dumps(plan["engine"]))
    cmd = engine_command(args, model_dir, port)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as log_file:
        proc = subprocess.Popen([sys.executable, str(HERE / "serve_bench_engine.py"), "--requests", str(requests),
                                 "--offline-out", str(offline_out), "--", *cmd], stdout=log_file,
                                stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(proc, url, args.timeout, log)
            rows = run_http(url, plan["http"], args.timeout)
        finally:
            stop(proc, 120)
    offline = json.loads(offline_out.read_text()) if offline_out.is_file() else []
    return rows, offline, cmd


def main() -> None:
    args = parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    try:
        model_dir = prepare_model(args, workdir)
        plan = build_plan(args, model_dir)
        if args.url:
            rows, offline, cmd = run_http(args.url.rstrip("/"), plan["http"], args.timeout), [], None
        else:
            rows, offline, cmd = run_self_started(args, plan, model_dir, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(args, rows, offline, cmd)


def report(args: argparse.Namespace, rows: list[dict], offline: list[dict], cmd: list[str] | None) -> None:
    by_name = {o["name"]: o for o in offline}
    for row in rows:
        base = by_name.get(row["name"])
        row["offline_tok_s"] = base["output_tok_s"] if base else math.nan
        row["http_over_offline"] = row["output_tok_s"] / row["offline_tok_s"] if base else math.nan
        row["offline_ttft_ms_p50"] = base["ttft_ms_p50"] if base else math.nan
        for kind in ("decode", "prefill"):
            for part in ("steps", "step_ms_mean", "step_tokens_mean"):
                row[f"offline_{kind}_{part}"] = base.get(f"{kind}_{part}", math.nan) if base else math.nan
    cols = [("name", "run", 14, ""), ("requests", "reqs", 6, ""), ("errors", "errs", 5, ""),
            ("output_tok_s", "out tok/s", 10, ".1f"), ("offline_tok_s", "offline", 10, ".1f"),
            ("http_over_offline", "ratio", 7, ".3f"), ("request_s", "req/s", 7, ".2f")]
    cols += [(f"{m}_p{q}", f"{label} p{q}", 10, ".1f") for m, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"))
             for q in (50, 90, 99)]
    cols += [("chunk_gap_ms_p50", "gap p50", 9, ".1f"), ("ttft_ms_mean", "TTFT mean", 10, ".1f"),
             ("server_ttft_ms_mean", "srv TTFT", 10, ".1f"), ("itl_ms_mean", "ITL mean", 10, ".1f"),
             ("server_tpot_ms_mean", "srv TPOT", 10, ".1f")]
    print("".join(f"{label:>{width}}" for _, label, width, _ in cols))
    for row in rows:
        print("".join(f"{row[key]:>{width}{spec}}" for key, _, width, spec in cols))
    # the engine's steps during each run, by kind, in the server and offline: a slower step or more prefill steps
    steps = [("name", "run", 14, "")]
    parts = {"steps": "n", "step_ms_mean": "ms", "step_tokens_mean": "tok"}
    for where, kind, part in itertools.product(("server", "offline"), ("decode", "prefill"), parts):
        label = f"{where[:3]} {kind[:3]} {parts[part]}"
        steps.append((f"{where}_{kind}_{part}", label, 12, ".0f" if part == "steps" else ".2f"))
    print("engine steps by kind (n: how many; ms: mean wall ms a step; tok: mean tokens computed a step):")
    print("".join(f"{label:>{width}}" for _, label, width, _ in steps))
    for row in rows:
        print("".join(f"{row.get(key, math.nan):>{width}{spec}}" for key, _, width, spec in steps))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    result = {"date": datetime.date.today().isoformat(), "commit": commit, "machine": platform.node(),
              "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "args": vars(args), "serve_command": cmd, "runs": rows, "offline": offline}
    result = _nan_to_none(result)
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


def _nan_to_none(value):
    """NaN (a figure with no data: no offline run, no second token) as JSON's null, so strict parsers read it."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


if __name__ == "__main__":
    main()
