"""Requests that share a prompt or its beginning: prefill tokens computed, wall time and TTFT, for the scheduler
that shares them (a request waits while a running one computes the state it would reuse, and saves a snapshot where
its prompt parts from a cached one), against the same engine without either (the schedule before them) and with
prefix caching off.

Three workloads of N requests queued at once, on fresh prompts each run, after a warm-up:
  n       one prompt with SamplingParams(n=N): N requests of one prompt (what LLM.generate and the server's `n` run)
  burst   N requests of one prompt (clients that send the same prompt together)
  system  N requests of one system prompt, each with its own 40-token message, queued after one such request ran
          alone (a server's steady traffic: the system prompt's pages are cached, no snapshot inside it)

    python benchmarks/shared_prompt.py                        # the bundled demo model, CPU, float32, 1 thread

Prints a table and one JSON line with the machine, the date, the commit and the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import replace
from unittest import mock

import torch
from prefix_caching import commit, machine

from deltaserve.cache.manager import CacheManager
from deltaserve.core.engine import Engine
from deltaserve.entrypoints.llm import engine_arguments
from deltaserve.sampling_params import SamplingParams

SETTINGS = ("caching off", "caching, before", "caching, now")


def no_branch(find):
    """find_cached_prefix without branches (the cache before them)."""
    def found(self, req):
        hit = find(self, req)
        return None if hit is None else replace(hit, branch_blocks=0)
    return found


def workload(kind: str, vocab: int, copies: int, prompt_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(5, vocab, (n,), generator=gen).tolist()  # noqa: E731 (ids < 5: special tokens)
    if kind == "system":
        system = draw(prompt_len - 40)
        return [system + draw(40) for _ in range(copies)]
    return [draw(prompt_len)] * copies


def run(engine: Engine, prompts: list[list[int]], kind: str, output_len: int) -> dict:
    """Queue every prompt at once and step to the end: tokens computed, wall time, TTFT per request."""
    params = SamplingParams(max_tokens=output_len, temperature=0.8, seed=1, ignore_eos=True)
    if kind == "system":  # one alone first: the system prompt's pages cached, as a running server has them
        engine.add_request(prompts[0][:-40] + prompts[0][-40:][::-1], params)
        while engine.has_unfinished_requests():
            engine.step()
    before = {k: t.tokens for k, t in engine.step_totals.items()}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):  # n: seed + i per request, as LLM.generate fans out SamplingParams(n=...)
        engine.add_request(prompt, replace(params, seed=1 + i) if kind == "n" else params)
    ttft, cached = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ttft.append((out.metrics["first_token_time"] - out.metrics["arrival_time"]) * 1e3)
                cached.append(out.num_cached_tokens)
    wall = time.perf_counter() - start
    computed = sum(t.tokens - before[k] for k, t in engine.step_totals.items())
    return {"wall_s": round(wall, 3), "tokens_computed": computed, "cached_tokens": sum(cached),
            "ttft_ms_median": round(statistics.median(ttft), 1), "ttft_ms_max": round(max(ttft), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--copies", type=int, default=4, help="requests of each workload (n)")
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="runs per setting and workload; medians")
    args = parser.parse_args()

    results = {}
    for setting in SETTINGS:
        model, config = engine_arguments(args.model, device=args.device, max_model_len=args.prompt_len + 64,
                                         enable_prefix_caching=setting != "caching off")
        before = setting == "caching, before"
        with mock.patch.object(CacheManager, "awaits_prefix", (lambda *a: False) if before
                               else CacheManager.awaits_prefix), \
                mock.patch.object(CacheManager, "find_cached_prefix", no_branch(CacheManager.find_cached_prefix)
                                  if before else CacheManager.find_cached_prefix):
            engine = Engine(model, config)
            vocab = engine.model_config.vocab_size
            run(engine, workload("burst", vocab, 2, 200, seed=0), "burst", 4)  # warm-up
            for k, kind in enumerate(("n", "burst", "system")):  # fresh prompts for every run: nothing cached before
                runs = [run(engine, workload(kind, vocab, args.copies, args.prompt_len, seed=100 * k + r + 1), kind,
                            args.output_len) for r in range(args.repeats)]
                results[(setting, kind)] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            engine.shutdown()

    print(f"{args.copies} requests, {args.prompt_len}-token prompts, {args.output_len} output tokens; medians of "
          f"{args.repeats} runs")
    print("| workload | setting | tokens computed | cached tokens | wall s | TTFT median ms | TTFT max ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind in ("n", "burst", "system"):
        for setting in SETTINGS:
            r = results[(setting, kind)]
            print(f"| {kind} | {setting} | {r['tokens_computed']:,} | {r['cached_tokens']:,} | {r['wall_s']:.2f} | "
                  f"{r['ttft_ms_median']:.0f} | {r['ttft_ms_max']:.0f} |")
    print(json.dumps({"benchmark": "shared_prompt", "machine": machine(args.device),
                      "date": datetime.date.today().isoformat(), "commit": commit(), "command": " ".join(sys.argv),
                      "results": [{"setting": s, "workload": k, **r} for (s, k), r in results.items()]}))


if __name__ == "__main__":
    main()
