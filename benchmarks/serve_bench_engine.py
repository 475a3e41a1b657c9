"""serve_bench.py's server process: one engine for the offline baseline, then the HTTP server on that engine.

    python benchmarks/serve_bench_engine.py --requests REQ.json --offline-out OFFLINE.json -- serve --model DIR ...

Everything after `--` is a `deltaserve serve` command line: the engine is built from it as `deltaserve serve` builds
it (the same flags for both measurements, by construction). The offline part runs, for each run in REQ.json,
`LLM.generate` end to end on that run's requests: in waves of `concurrency` requests, as that many streams that
each send their next request when the previous one ends would. Its figures go to OFFLINE.json before the server
starts. With --no-engine-process the server runs on the same engine (one model load for both), so the HTTP runs
find every kernel compiled and tuned; with --engine-process (serve's default) this engine is dropped, saving the
kernels' tuning decisions to disk as it goes (LLM.shutdown), and the server starts its own process, whose engine
reads them and runs its warm-up anew (both engines warm their prefill kernels up at start, as serve's does:
EngineConfig.warmup_prefill).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

# isort: off
import deltaserve  # noqa: F401  before torch, so that its CUDA allocator default (deltaserve/__init__.py) applies here
# isort: on
import torch
from serve_client import PERCENTILES, percentile, step_figures

from deltaserve.core.engine_process import EngineProcess
from deltaserve.entrypoints.chat_tools import render_chat_prompt
from deltaserve.entrypoints.cli import _engine_arguments, _make_llm, build_parser
from deltaserve.entrypoints.openai.api_server import run_server
from deltaserve.entrypoints.openai.command import bind_address, server_config
from deltaserve.sampling_params import SamplingParams


def prompt_ids(llm, request: dict) -> list[int]:
    """A request's prompt token ids as the server makes them: token ids as sent, or chat messages through the
    chat template."""
    if "prompt" in request:
        return request["prompt"]
    text = render_chat_prompt(llm.tokenizer, request["messages"]).text
    return llm.tokenizer.encode_prompt(text)


def run_offline(llm, run: dict) -> dict:
    """One run's requests through LLM.generate in waves of `concurrency`: output tok/s over the whole run, TTFT
    percentiles (ms, arrival at the engine to the first token), and the engine's steps by kind (how many, mean wall
    ms and tokens a step)."""
    params = SamplingParams(max_tokens=run["max_tokens"], temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt_ids(llm, r)} for r in run["requests"]]
    size = run["concurrency"]
    before = {kind: replace(totals) for kind, totals in llm.engine.step_totals.items()}
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), size):
        outputs += llm.generate(prompts[i:i + size], params, use_tqdm=False)
    duration = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft = [1000 * (o.metrics["first_token_time"] - o.metrics["arrival_time"]) for o in outputs]
    steps = {}
    for kind, totals in llm.engine.step_totals.items():  # the same figures as serve_client.server_means'
        steps.update(step_figures(kind, totals.steps - before[kind].steps, totals.seconds - before[kind].seconds,
                                  totals.tokens - before[kind].tokens))
    return {"name": run["name"], "requests": len(outputs), "duration_s": duration, "output_tokens": tokens,
            "output_tok_s": tokens / duration, **{f"ttft_ms_p{q}": percentile(ttft, q) for q in PERCENTILES},
            **steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", required=True, help="JSON from serve_bench.py: warm-up and runs")
    parser.add_argument("--offline-out", required=True, help="where to write the offline figures")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- serve --model DIR ... (the engine flags)")
    args = parser.parse_args()
    rest = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    serve_args = build_parser().parse_args(rest)
    if serve_args.command != "serve":
        parser.error(f"after --: a `deltaserve serve` command line (serve --model DIR ...), got {rest[:1]}")
    plan = json.loads(Path(args.requests).read_text())
    config = server_config(serve_args)
    llm = _make_llm(serve_args)
    try:
        for warmup in plan["warmup"]:
            run_offline(llm, warmup)
        results = []
        for run in plan["runs"]:
            results.append(run_offline(llm, run))
            print(f"offline {json.dumps(results[-1])}", file=sys.stderr, flush=True)
        Path(args.offline_out).write_text(json.dumps(results))
        if serve_args.engine_process and serve_args.tensor_parallel_size == 1:
            llm.shutdown()
            llm = None
            release_memory()
            serve_in_engine_process(serve_args, config)
        else:
            with bind_address(serve_args.host, serve_args.port) as sock:
                run_server(llm.engine, config, sock, serve_args.drain_timeout, log_level="warning")
    finally:
        if llm is not None:
            llm.shutdown()


def release_memory() -> None:
    """Give the dropped engine's GPU memory back to the card (its weights, cache and graphs' pools, which reference
    cycles and PyTorch's caching allocator would keep), before the engine process loads and sizes its own."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        print(f"offline engine dropped: {torch.cuda.memory_reserved() / 2**30:.2f} GiB still reserved here",
              file=sys.stderr, flush=True)


def serve_in_engine_process(serve_args, config) -> None:
    """The server as `deltaserve serve --engine-process` runs it."""
    process = EngineProcess(functools.partial(_engine_arguments, serve_args))
    try:
        with bind_address(serve_args.host, serve_args.port) as sock:
            run_server(process, config, sock, serve_args.drain_timeout, log_level="warning")
    finally:
        process.close()


if __name__ == "__main__":
    main()
