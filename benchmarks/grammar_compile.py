"""What bounding grammar compiles costs, and what it stops: each constraint compiled in this process (unbounded, as
before compile_worker) and in a worker process (bounded), alternated over rounds, on the synthetic Kimi tokenizer
of tests/helpers/kimi_tokenizer.py (the published vocabulary's size); then the constraints that took the engine
down or held its pool, in a worker only.

    python benchmarks/grammar_compile.py --rounds 3

A compile's time here is GrammarBackend.compile's: the compile, its first token mask, and (in a worker) passing the
grammar back or compiling it again. The first constrained request also pays for the backend and its first worker
(printed apart). Prints a table and one JSON line (date, commit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deltaserve.sampling_params import StructuredOutputsParams as S
from deltaserve.structured.backend import GrammarBackend
from deltaserve.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
ORDINARY = {
    "json, 4 fields": S(json={"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": "boolean"}}, "required": ["name", "age"]}),
    "json, 20 strings maxLength 400": S(json={"type": "object", "properties": {
        f"k{i}": {"type": "string", "maxLength": 400} for i in range(20)}, "required": [f"k{i}" for i in range(20)]}),
    "regex email {1,400}": S(regex="[a-z]{1,400}@[a-z]+\\.(com|org)"),
    "choice of 3": S(choice=["yes", "no", "maybe"]),
}
HOSTILE = {
    "(a*)* x 100,000 (500 KB)": S(regex="(a*)*" * 100_000),
    "a* x 3,000 (6 KB)": S(regex="a*" * 3_000),
    "(a*)* x 2,000": S(regex="(a*)*" * 2_000),
    "(a*)* x 500": S(regex="(a*)*" * 500),
}


def timed(backend: GrammarBackend, spec) -> tuple[float, str]:
    start = time.perf_counter()
    try:
        backend.compile(spec)
        outcome = "compiled"
    except ValueError as e:
        outcome = str(e)[:90]
    return time.perf_counter() - start, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-hostile", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.kimi_tokenizer import PUBLISHED_NUM_RANKS, synthetic_ranks, write_kimi_files

    with tempfile.TemporaryDirectory() as tmp:
        write_kimi_files(Path(tmp), synthetic_ranks(PUBLISHED_NUM_RANKS))
        tokenizer = load_tokenizer(tmp)
    make = {"here": lambda: GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, isolated=False),
            "worker": lambda: GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)}
    first, backends = {}, {}
    for way in ("here", "worker"):
        start = time.perf_counter()
        backends[way] = make[way]()
        backends[way].compile(ORDINARY["choice of 3"])
        first[way] = time.perf_counter() - start
    times = {name: {"here": [], "worker": []} for name in ORDINARY}
    for r in range(args.rounds):
        for name, spec in ORDINARY.items():
            for way in (("here", "worker") if r % 2 == 0 else ("worker", "here")):
                times[name][way].append(timed(backends[way], spec)[0])
    print(f"vocabulary {tokenizer.vocab_size:,}; first constrained request (backend + choice of 3): here "
          f"{first['here']:.2f} s, worker {first['worker']:.2f} s")
    print(f"| constraint | here, s (median of {args.rounds}) | worker, s | ratio |\n|---|---:|---:|---:|")
    rows = {}
    for name, ways in times.items():
        here, worker = statistics.median(ways["here"]), statistics.median(ways["worker"])
        rows[name] = {"here_s": here, "worker_s": worker}
        print(f"| {name} | {here:.3f} | {worker:.3f} | {worker / here:.2f} |")
    hostile = {}
    if not args.skip_hostile:
        print("| hostile constraint, worker only | seconds | outcome |\n|---|---:|---|")
        for name, spec in HOSTILE.items():
            seconds, outcome = timed(backends["worker"], spec)
            hostile[name] = {"seconds": seconds, "outcome": outcome}
            print(f"| {name} | {seconds:.2f} | {outcome} |")
    for backend in backends.values():
        backend.close()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(json.dumps({"date": datetime.date.today().isoformat(), "commit": commit.strip(), "first_s": first,
                      "ordinary": rows, "hostile": hostile,
                      "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}))


if __name__ == "__main__":
    main()
