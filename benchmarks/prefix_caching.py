"""Prefix caching on a multi-turn chat: computed prefill tokens and time to first token per turn, caching off vs on.

A conversation of --turns turns: turn 1 is a system prompt and a user message, each later prompt is the previous
prompt + the model's answer + a new user message, so with the defaults (a 263-token system prompt, 97-token
messages, 95-token answers, 10 turns) the last prompt holds 2,088 tokens of history. The lengths are not multiples
of the block size, so that, as with real text, each prompt ends inside a block and caching pays for its snapshot at
the prompt's last full block (saved inside the prefill step, between two passes of the KDA layers, since e69b3f6;
before, a step of its own). Token ids are random, answers greedy with ignore_eos. Each
setting runs on its own fresh engine, after an unrelated warm-up conversation; --repeats conversations (other
random ids) run one after another and each turn's figures are their medians. One request runs at a time, so a
turn's TTFT is its prefill alone.

    python benchmarks/prefix_caching.py                                   # the make-tiny model, CPU, float32
    python benchmarks/prefix_caching.py --config benchmarks/configs/kimi-linear-48b-a3b.json --load-format dummy \\
        --device cuda --dtype bfloat16

Prints a table and one JSON line with the machine, the date, the commit and the command.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from deltaserve.config import EngineConfig
from deltaserve.core.engine import Engine
from deltaserve.sampling_params import SamplingParams


def conversation(seed: int, vocab: int, system_len: int, user_len: int, turns: int) -> list[list[int]]:
    """The user side of one chat: turn 1's system prompt + message, then one message per turn."""
    gen = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(5, vocab, (n,), generator=gen).tolist()  # noqa: E731 (ids < 5: special tokens)
    return [draw(system_len + user_len)] + [draw(user_len) for _ in range(turns - 1)]


def record_scheduled(engine: Engine) -> list[dict[str, int]]:
    """Every step's {request id: tokens scheduled}, from now on."""
    steps, schedule = [], engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append(dict(out.num_scheduled_tokens))
        return out

    engine.scheduler.schedule = recording
    return steps


def run_chat(engine: Engine, user_turns: list[list[int]], answer_len: int) -> list[dict]:
    """Run the turns one after another; per turn: prompt tokens, cached tokens, tokens computed before the first
    output token, and TTFT in ms."""
    steps = record_scheduled(engine)
    params = SamplingParams(max_tokens=answer_len, temperature=0, ignore_eos=True)
    prompt, rows = [], []
    for user in user_turns:
        prompt = prompt + user
        req_id = engine.add_request(prompt, params)
        first_step, final = None, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                first_step = len(steps) if first_step is None else first_step
                final = out if out.finished else final
        computed = sum(s.get(req_id, 0) for s in steps[:first_step])
        times = final.metrics
        rows.append({"prompt": len(prompt), "cached": final.num_cached_tokens, "computed": computed,
                     "ttft_ms": 1000 * (times["first_token_time"] - times["arrival_time"]),
                     "answer": final.outputs[0].token_ids})
        prompt = prompt + final.outputs[0].token_ids
        steps.clear()
    return rows


def bench_setting(model: str, engine_config: EngineConfig, chats: list[list[list[int]]], warmup: list[list[int]],
                  answer_len: int) -> tuple[list[dict], dict | None, list[list[int]]]:
    """Per-turn medians over the chats, the prefix cache's stats at the end (None when off), and every answer."""
    engine = Engine(model, engine_config)
    run_chat(engine, warmup, answer_len)
    runs = [run_chat(engine, chat, answer_len) for chat in chats]
    answers = [row.pop("answer") for run in runs for row in run]
    medians = [{key: statistics.median(run[turn][key] for run in runs) for key in runs[0][turn]}
               for turn in range(len(runs[0]))]
    stats = engine.prefix_cache_stats
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return medians, (None if stats is None else {"hit_rate": stats.hit_rate, "hit_tokens": stats.num_hit_tokens,
                                                 "snapshot_evictions": stats.num_snapshot_evictions,
                                                 "block_evictions": stats.num_block_evictions}), answers


def print_table(off: list[dict], on: list[dict]) -> None:
    print(f"{'turn':>4} {'prompt':>7} | {'off: computed':>13} {'TTFT ms':>9} | {'on: cached':>10} {'computed':>9} "
          f"{'TTFT ms':>9} | {'TTFT off/on':>11}")
    for turn, (a, b) in enumerate(zip(off, on), start=1):
        print(f"{turn:>4} {a['prompt']:>7.0f} | {a['computed']:>13.0f} {a['ttft_ms']:>9.1f} | {b['cached']:>10.0f} "
              f"{b['computed']:>9.0f} {b['ttft_ms']:>9.1f} | {a['ttft_ms'] / b['ttft_ms']:>10.2f}x")
    total = lambda rows, key: sum(r[key] for r in rows)  # noqa: E731
    print(f"{'all':>4} {total(off, 'prompt'):>7.0f} | {total(off, 'computed'):>13.0f} {total(off, 'ttft_ms'):>9.1f} | "
          f"{total(on, 'cached'):>10.0f} {total(on, 'computed'):>9.0f} {total(on, 'ttft_ms'):>9.1f} | "
          f"{total(off, 'ttft_ms') / total(on, 'ttft_ms'):>10.2f}x")


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{cpu} ({torch.get_num_threads()} torch threads)"


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: a fresh make-tiny model)")
    parser.add_argument("--config", default=None, help="a config.json, with --load-format dummy")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-len", type=int, default=263)
    parser.add_argument("--user-len", type=int, default=97)
    parser.add_argument("--answer-len", type=int, default=95)
    parser.add_argument("--repeats", type=int, default=3, help="conversations per setting; medians per turn")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    args = parser.parse_args()

    model = args.config or args.model
    if model is None:
        from deltaserve.entrypoints.make_tiny import make_tiny

        model = str(make_tiny(Path(tempfile.mkdtemp()) / "tiny", seed=0))
    vocab = json.loads((Path(model) / "config.json" if Path(model).is_dir() else Path(model)).read_text())[
        "vocab_size"]
    max_len = args.system_len + args.turns * (args.user_len + args.answer_len) + 1
    shape = (vocab, args.system_len, args.user_len, args.turns)
    chats = [conversation(seed, *shape) for seed in range(1, args.repeats + 1)]
    warmup = conversation(0, *shape)[:2]
    results = {}
    for caching in (False, True):
        config = EngineConfig(max_model_len=max_len, max_num_seqs=4, max_num_batched_tokens=args.max_num_batched_tokens,
                              block_size=args.block_size, enable_prefix_caching=caching, device=args.device,
                              dtype=args.dtype or ("float32" if args.device == "cpu" else "bfloat16"),
                              threads=args.threads if args.device == "cpu" else None, load_format=args.load_format)
        results[caching] = bench_setting(model, config, chats, warmup, args.answer_len)
    print_table(results[False][0], results[True][0])
    same = sum(a == b for a, b in zip(results[False][2], results[True][2]))
    print(f"answers identical with caching on and off: {same} of {len(results[False][2])}")
    print(json.dumps({"benchmark": "prefix_caching", "machine": machine(args.device), "date":
                      datetime.date.today().isoformat(), "commit": commit(), "command": " ".join(sys.argv),
                      "off": results[False][0], "on": results[True][0], "on_stats": results[True][1],
                      "same_answers": f"{same}/{len(results[False][2])}"}))


if __name__ == "__main__":
    main()
