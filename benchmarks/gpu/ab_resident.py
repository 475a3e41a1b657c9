"""An A/B of two source trees with both engines resident on one GPU, measured in alternation (ABBA) in one call.

ab_bench.sh starts a new process for every side of every round, and a commit without the tuning cache (eff5dd2)
autotunes for ~100 s in each, so three rounds a side took two device calls. Here each side starts once, in a
process of its own (its tree first on PYTHONPATH, so it runs that tree's engine and that tree's `run_batch`), warms
up every row's shape (one side after the other: autotuning beside the other's warm-up would time noise), and then
waits; the coordinator tells one side at a time to measure its rows, in the order
head, before, before, head, head, ... (the first process measured ~6% more copy bandwidth: alternate). The idle
side holds its memory and nothing else, so the two share the card but never its time.

    python benchmarks/gpu/ab_resident.py --tree head=. --tree before=ab/before --rounds 3 \\
        --model benchmarks/configs/kimi-linear-48b-a3b-8layers.json --device cuda --json-out $OUT/ab.json

Each side gets --gpu-memory-utilization (default 0.45) of the card: two copies of the 48B shape in 8 layers
(~30 GB each in bf16) fit an 80 GB H100; 12 layers fit an H200. The rows are bench's: batch sizes at one prompt
length, each timed by the tree's run_batch (TPOT and output tok/s of the decode phase), prompts drawn afresh each
round (a prefix-cache hit would skip a later round's prefill). The report is the median of each side's rounds
and head / before.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIGURES = ("tpot_ms", "steady_tpot_ms", "output_tok_s", "steady_tok_s", "ttft_ms")  # those a row has


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer")
    return int(text)


def batch_sizes(text: str) -> list[int]:
    return [positive_int(b) for b in text.split(",")]


def child(args) -> None:
    """One side: start the engine of the tree that `import deltaserve` finds, warm up, then run the rows once per
    `go ROUND` line on stdin, one JSON line of rows on stdout each time; `quit` ends it."""
    from deltaserve.config import EngineConfig
    from deltaserve.core.tensor_parallel import start_engine, stop_engine
    from deltaserve.entrypoints.bench import run_batch

    config = EngineConfig(dtype=args.dtype or ("float32" if args.device == "cpu" else "bfloat16"), device=args.device,
                          max_model_len=args.prompt_len + args.output_len, max_num_seqs=max(args.batch_sizes),
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          gpu_memory_utilization=args.gpu_memory_utilization, load_format=args.load_format)
    engine, workers = start_engine(args.model, config)
    try:
        for batch in args.batch_sizes:  # every kernel compiles and tunes at the rows' shapes before any is timed
            run_batch(engine, batch, args.prompt_len, 2, seed=2**31 + batch)
        reply({"ready": True, "deltaserve": _package_dir()})
        for line in sys.stdin:
            if line.strip() == "quit":
                break
            round_ = int(line.split()[1])
            rows = [run_batch(engine, batch, args.prompt_len, args.output_len, seed=1000 * round_ + batch)
                    for batch in args.batch_sizes]
            reply({"round": round_, "rows": rows})
    finally:
        stop_engine(engine, workers)


def reply(message: dict) -> None:
    print("AB " + json.dumps(message), flush=True)  # a prefix: the engine may print lines of its own


def _package_dir() -> str:
    import deltaserve

    return str(Path(deltaserve.__file__).parent)


class Side:
    """A child process for one tree, talked to through its stdin and stdout."""

    def __init__(self, name: str, tree: Path, child_args: list[str], log_dir: Path):
        self.name, self.tree = name, tree
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree)] + _extra_path()))
        self.log = open(log_dir / f"ab_{name}.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "child", *child_args],
                                     cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)

    def read(self, deadline: float) -> dict:
        """The child's next message (lines without the prefix go to its log); fails past the deadline or at exit."""
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no answer before the deadline (its log: {self.log.name})")
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} exited with {self.proc.wait()} (its log: {self.log.name})")
            if line.startswith("AB "):
                return json.loads(line[3:])
            self.log.write(line)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def _extra_path() -> list[str]:
    """PYTHONPATH entries other than a deltaserve tree (the GPU machine's installed wheels), kept for the children."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return [p for p in entries if p and not (Path(p) / "deltaserve").is_dir()]


def order(rounds: int, names: list[str]) -> list[tuple[int, str]]:
    """ABBA: round r runs the sides in the given order when r is even, reversed when odd."""
    return [(r, name) for r in range(rounds) for name in (names if r % 2 == 0 else names[::-1])]


def _median(values: list[float]) -> float:
    """The median of the values that are numbers (a steady figure is NaN where a request finished before the decode
    phase), NaN if none is."""
    numbers = [v for v in values if not math.isnan(v)]
    return statistics.median(numbers) if numbers else float("nan")


def summarise(results: dict[str, list[dict]], names: list[str]) -> list[dict]:
    """Per batch size and figure: each side's median over its rounds, and the first side's over the second's."""
    first, second = names
    table = []
    for i, row in enumerate(results[first][0]["rows"]):
        entry = {"batch": row["batch"]}
        for figure in (f for f in FIGURES if all(f in r["rows"][i] for side in names for r in results[side])):
            medians = {name: _median([r["rows"][i][figure] for r in results[name]]) for name in names}
            usable = medians[second] and not math.isnan(medians[second])
            entry[figure] = {**medians, "ratio": medians[first] / medians[second] if usable else None}
        table.append(entry)
    return table


def coordinate(args, child_args: list[str]) -> dict:
    trees = dict(spec.split("=", 1) for spec in args.tree)
    names = list(trees)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="ab_resident_")).resolve()
    print(f"each side's stderr: {log_dir}/ab_<side>.log", flush=True)
    sides: dict[str, Side] = {}
    try:
        for name, tree in trees.items():  # one at a time: autotuning beside the other's warm-up would time noise
            start = time.monotonic()
            sides[name] = Side(name, Path(tree).resolve(), child_args, log_dir)
            ready = sides[name].read(start + args.start_timeout)
            print(f"{name} ready after {time.monotonic() - start:.0f} s, from {ready['deltaserve']}", flush=True)
        results: dict[str, list[dict]] = {name: [] for name in names}
        for round_, name in order(args.rounds, names):
            sides[name].send(f"go {round_}")
            measured = sides[name].read(time.monotonic() + args.round_timeout)
            results[name].append(measured)
            rows = ", ".join(f"batch {r['batch']} TPOT {r['tpot_ms']:.3f} ms {r['output_tok_s']:.0f} tok/s"
                             for r in measured["rows"])
            print(f"round {round_} {name}: {rows}", flush=True)
    finally:
        for side in sides.values():
            side.close()
    return {"trees": trees, "order": order(args.rounds, names), "results": results,
            "summary": summarise(results, names)}


def print_summary(summary: list[dict], names: list[str]) -> None:
    first, second = names
    print(f"{'batch':>6} {'figure':>13} {first:>12} {second:>12} {first + ' / ' + second:>16}")
    for entry in summary:
        for figure in (f for f in FIGURES if f in entry):
            f = entry[figure]
            ratio = f"{f['ratio']:.4f}" if f["ratio"] is not None else "-"
            print(f"{entry['batch']:>6} {figure:>13} {f[first]:>12.3f} {f[second]:>12.3f} {ratio:>16}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", nargs="?", default="run", choices=["run", "child"])
    parser.add_argument("--tree", action="append", default=[], help="NAME=DIR, twice: the two sides, in order")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--model", required=True, help="a model folder, or a config.json with --load-format dummy")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch-sizes", type=batch_sizes, default=[1, 64, 256])
    parser.add_argument("--prompt-len", type=positive_int, default=512)
    parser.add_argument("--output-len", type=positive_int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--start-timeout", type=float, default=300, help="seconds for a side to start and warm up")
    parser.add_argument("--round-timeout", type=float, default=120, help="seconds for one side's rows")
    parser.add_argument("--log-dir", default=None, help="where each side's stderr goes (default: a new temporary "
                        "folder, printed)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if args.role == "child":
        return child(args)
    if len(args.tree) != 2 or not all("=" in spec for spec in args.tree):
        parser.error("--tree NAME=DIR twice: the two sides")
    if Path(args.model).exists():  # the children run in their trees' folders
        args.model = str(Path(args.model).resolve())
    child_args = ["--model", args.model, "--load-format", args.load_format, "--device", args.device,
                  "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--prompt-len", str(args.prompt_len),
                  "--output-len", str(args.output_len), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                  "--gpu-memory-utilization", str(args.gpu_memory_utilization)] + (
                     ["--dtype", args.dtype] if args.dtype else [])
    result = coordinate(args, child_args)
    print_summary(result["summary"], list(result["trees"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
