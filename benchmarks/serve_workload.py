"""serve_bench.py's model folder and requests: what both the HTTP runs and the offline runs are given.

A --config model (the 48B shape, dummy weights) becomes a folder with that config.json and the synthetic Kimi
tokenizer of tests/helpers/kimi_tokenizer.py at the published vocabulary's size (163,584 ranks and the special
ids after them), so that every id the model can sample decodes and chat renders through a Kimi chat template.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUNDLED_MODEL = REPO / "deltaserve" / "assets" / "demo-model"
FIRST_ID = 5  # below it: special tokens in the demo model; random prompts start here


def prepare_model(args, workdir: Path) -> Path:
    """The model folder both measurements load: --model, the demo model, or --config plus a Kimi tokenizer."""
    if not args.config:
        return Path(args.model) if args.model else BUNDLED_MODEL
    sys.path.insert(0, str(REPO / "tests"))
    from helpers.kimi_tokenizer import PUBLISHED_NUM_RANKS, synthetic_ranks, write_kimi_files

    folder = workdir / "model"
    folder.mkdir()
    shutil.copy(args.config, folder / "config.json")
    write_kimi_files(folder, synthetic_ranks(PUBLISHED_NUM_RANKS))
    return folder


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab_size) for _ in range(length)] for _ in range(num)]


def chat_messages(num: int, prompt_len: int, tokenizer, seed: int) -> list[list[dict]]:
    """One user message of random words a request; with a tokenizer, as many words as keep the rendered prompt
    at most prompt_len tokens (at least one word); without, prompt_len words."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    out = []
    for _ in range(num):
        words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(prompt_len)]
        count = _words_that_fit(words, prompt_len, tokenizer) if tokenizer is not None else prompt_len
        out.append([{"role": "user", "content": " ".join(words[:count])}])
    return out


def _words_that_fit(words: list[str], prompt_len: int, tokenizer) -> int:
    """The most leading words whose rendered chat prompt has at most prompt_len tokens (binary search)."""
    from deltaserve.entrypoints.chat_tools import render_chat_prompt

    def length(count):
        text = render_chat_prompt(tokenizer, [{"role": "user", "content": " ".join(words[:count])}]).text
        return len(tokenizer.encode_prompt(text))

    low, high = 1, len(words)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if length(mid) <= prompt_len else (low, mid - 1)
    return low


def body(request: dict, max_tokens: int, model: str) -> dict:
    """The streaming request body of one request (token ids to completions, messages to chat)."""
    return {**request, "model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def build_plan(args, model_dir: Path) -> dict:
    """The warm-up and the runs, each for the engine (requests) and for HTTP (bodies and load)."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokenizer = _tokenizer(model_dir) if args.chat_concurrency else None
    runs = []
    for i, (mode, rate, concurrency) in enumerate(_loads(args)):
        num = args.num_requests if rate is not None else concurrency * args.requests_per_stream
        seed = args.seed * 1000 + i
        requests = ([{"prompt": p} for p in random_prompts(num, args.prompt_len, vocab_size, seed)] if mode == "cmpl"
                    else [{"messages": m} for m in chat_messages(num, args.prompt_len, tokenizer, seed)])
        load = f"r{rate:g}" if rate is not None else f"c{concurrency}"
        runs.append({"name": f"{mode} {load}", "mode": mode, "load": load, "rate": rate, "seed": seed,
                     "concurrency": concurrency, "max_tokens": args.output_len, "requests": requests})
    widest = max([r["concurrency"] for r in runs if r["rate"] is None], default=1)
    warmup = {"name": "warmup", "mode": "cmpl", "rate": None, "concurrency": widest,
              "max_tokens": args.warmup_output_len,
              "requests": [{"prompt": p} for p in random_prompts(widest, args.prompt_len, vocab_size, -1 - args.seed)]}
    offline_runs = [] if args.no_offline else [r for r in runs if r["rate"] is None]
    return {"engine": {"warmup": [] if args.no_offline else [warmup], "runs": offline_runs},
            "http": {"warmup": [_http(warmup, args)], "runs": [_http(r, args) for r in runs]}}


def _loads(args) -> list[tuple[str, float | None, int]]:
    """(mode, request rate or None, concurrency) of each run: completions at each concurrency and rate, then
    chat at each chat concurrency."""
    loads = [("cmpl", None, c) for c in args.concurrency]
    loads += [("cmpl", rate, 0) for rate in args.request_rate]
    return loads + [("chat", None, c) for c in args.chat_concurrency]


def _http(run: dict, args) -> dict:
    path = "/v1/completions" if run["mode"] == "cmpl" else "/v1/chat/completions"
    bodies = [body(r, run["max_tokens"], args.served_model_name) for r in run["requests"]]
    return {**{k: v for k, v in run.items() if k != "requests"}, "path": path, "bodies": bodies}


def _tokenizer(model_dir: Path):
    from deltaserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise SystemExit(f"--chat-concurrency needs a tokenizer and {model_dir} has none")
    return tokenizer
