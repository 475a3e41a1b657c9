"""Structured outputs' cost to a batch: output tokens/s of `--concurrency` requests at once with half of them
constrained by a JSON schema, against none constrained, on one engine in one process, alternated over rounds.

    python benchmarks/structured_outputs.py --config benchmarks/configs/kimi-linear-48b-a3b.json     # H200, 48B shape
    python benchmarks/structured_outputs.py --model deltaserve/assets/demo-model --device cpu --concurrency 8

--config: dummy weights at that config's shape, with the synthetic Kimi tokenizer of tests/helpers/kimi_tokenizer.py
(the published vocabulary's size). Every request runs exactly --output-len tokens: the free ones ignore eos, the
constrained ones follow a schema whose array must hold more items than fit (so it never completes early); its
strings are unbounded unless --max-length is given (xgrammar 0.2.8 fills a bounded string's bitmask at run time, up
to ~1 ms a request a step on a 4k vocabulary: the flag prices that). A batch with a constrained request decodes one
step at a time (the grammar needs the host between tokens), so the ratio prices the lost decode bursts and the
bitmask work. Prints a table and one JSON line (device, date, commit).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from deltaserve.config import EngineConfig
from deltaserve.core.engine import Engine
from deltaserve.sampling_params import SamplingParams, StructuredOutputsParams

ROOT = Path(__file__).resolve().parent.parent


def schema(output_len: int, max_length: int = 0) -> dict:
    """An object whose array needs more items than output_len tokens can hold (an item is >= 2 tokens); its strings
    have at most max_length characters (0: unbounded)."""
    item = {"type": "string", **({"maxLength": max_length} if max_length else {})}
    return {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                             "items": {"type": "array", "items": item, "minItems": output_len}},
            "required": ["id", "items"]}


def model_folder(args, tmp: Path) -> str:
    if args.model:
        return args.model
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.kimi_tokenizer import PUBLISHED_NUM_RANKS, synthetic_ranks, write_kimi_files

    write_kimi_files(tmp, synthetic_ranks(PUBLISHED_NUM_RANKS))
    shutil.copy(args.config, tmp / "config.json")
    return str(tmp)


def run(engine: Engine, prompts: list[list[int]], constrained: int, output_len: int, spec) -> dict:
    """All prompts at once, the first `constrained` of them under spec; output tok/s over the whole run and over its
    decode phase (from the step where every request has its first token), and output tokens per second of this
    process's CPU time (on a shared CPU, wall time mostly measures the other jobs)."""
    free = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    bound = SamplingParams(max_tokens=output_len, temperature=0, structured_outputs=spec)
    ids = [engine.add_request(p, bound if i < constrained else free) for i, p in enumerate(prompts)]
    start, cpu_start = time.perf_counter(), time.process_time()
    started, tokens, decode_start, decode_tokens = set(), {}, None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            started.add(out.request_id)
            tokens[out.request_id] = len(out.outputs[0].token_ids)
        if decode_start is None and len(started) == len(ids):
            decode_start, decode_tokens = time.perf_counter(), sum(tokens.values())
    end, cpu_end = time.perf_counter(), time.process_time()
    total = sum(tokens.values())
    assert total == len(ids) * output_len, f"{total} tokens, expected {len(ids) * output_len}: a request ended early"
    return {"output_tok_s": total / (end - start), "decode_tok_s": (total - decode_tokens) / (end - decode_start),
            "output_tok_per_cpu_s": total / (cpu_end - cpu_start)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a config.json: dummy weights at its shape, synthetic Kimi tokenizer")
    source.add_argument("--model", help="a model folder with its tokenizer (real weights)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-decode-steps", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=0, help="the schema's strings' maxLength (0: unbounded)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    for name in ("concurrency", "prompt_len", "output_len", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a positive integer")
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(model_folder(args, Path(tmp)), EngineConfig(
            dtype="float32" if args.device == "cpu" else "bfloat16", device=args.device,
            load_format="dummy" if args.config else "auto", max_num_seqs=args.concurrency,
            max_num_batched_tokens=8192, enable_prefix_caching=False, num_decode_steps=args.num_decode_steps,
            max_model_len=args.prompt_len + args.output_len + 8, threads=1 if args.device == "cpu" else None))
        return measure(engine, args)


def measure(engine: Engine, args) -> dict:
    gen = torch.Generator().manual_seed(0)
    tokenizer = engine.tokenizer
    vocab = min(tokenizer.all_special_ids, default=tokenizer.vocab_size)  # text tokens only (specials come last)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.concurrency)]
    spec = StructuredOutputsParams(json=schema(args.output_len, args.max_length))
    run(engine, prompts[:4], 2, 8, spec)  # warm-up: CUDA graphs, xgrammar's tokenizer info, the schema's grammar
    rows = {"none": [], "half": []}
    for round_ in range(args.rounds):
        for label, constrained in (("half", args.concurrency // 2), ("none", 0)):
            rows[label].append(run(engine, prompts, constrained, args.output_len, spec))
            row = rows[label][-1]
            print(f"round {round_} {label:>4}: {row['output_tok_s']:9.1f} output tok/s, decode "
                  f"{row['decode_tok_s']:9.1f} tok/s, {row['output_tok_per_cpu_s']:9.1f} tok per CPU s", flush=True)
    median = {label: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for label, runs in rows.items()}
    ratio = median["half"]["output_tok_s"] / median["none"]["output_tok_s"]
    print("\n| constrained | output tok/s | decode tok/s | output tok per CPU s |\n|---|---|---|---|")
    for label, m in median.items():
        print(f"| {label} | {m['output_tok_s']:.1f} | {m['decode_tok_s']:.1f} | {m['output_tok_per_cpu_s']:.1f} |")
    cpu_ratio = median["half"]["output_tok_per_cpu_s"] / median["none"]["output_tok_per_cpu_s"]
    print(f"half / none: {ratio:.3f}x output tok/s, {cpu_ratio:.3f}x per CPU second")
    result = {"device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": _commit(), "args": vars(args), "median": median, "ratio_half_over_none": ratio, "runs": rows}
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return result


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    main()
