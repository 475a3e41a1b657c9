"""Asynchronous scheduling (one step in flight) against synchronous steps, in one process on one engine: the
same greedy tokens, and the time per output token and to the first token of each, alternated (ABBA) over rounds
(a lease's cards differ by more than the effect, so both sides run in the same call).

    python benchmarks/gpu/async_ab.py --config benchmarks/configs/kimi-linear-48b-a3b.json --batch 1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from deltaserve import SamplingParams
from deltaserve.config import EngineConfig
from deltaserve.core.engine import Engine
from deltaserve.entrypoints.bench import run_batch


def greedy_tokens(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
           for p, n in zip(prompts, max_tokens)]
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return [final[i] for i in ids]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a model's config.json (dummy weights)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a check of the script (float32)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    for name in ("batch", "prompt_len", "output_len", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a positive integer")
    config = EngineConfig(dtype="float32" if args.device == "cpu" else "bfloat16", device=args.device,
                          load_format="dummy", max_num_seqs=max(args.batch, 4), max_num_batched_tokens=8192,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          # off: a repeated prompt's cached prefix would change its prefill's chunks, and with them
                          # the rounding, so the runs would not be comparable token for token
                          enable_prefix_caching=False,
                          max_model_len=max(args.prompt_len, 300) + args.output_len + 64)
    engine = Engine(args.config, config)
    for batch in sorted({1, args.batch}):  # warm-up: compiles and autotunes at the rows' shapes
        run_batch(engine, batch, args.prompt_len, 8, seed=99)

    # the same tokens: four prompts whose lengths end the chain at different bursts, each way twice
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, engine.model_config.vocab_size, (n,), generator=gen).tolist() for n in (7, 40, 300, 77)]
    max_tokens = [20, 33, 41, 64]
    tokens = {}
    for label, in_flight in (("sync", False), ("async", True), ("sync again", False), ("async again", True)):
        engine.async_scheduling = in_flight
        tokens[label] = greedy_tokens(engine, prompts, max_tokens)
    same = {label: got == tokens["sync"] for label, got in tokens.items()}
    print(f"greedy tokens equal to the first synchronous run: {same}", flush=True)

    tpot, ttft = {"sync": [], "async": []}, {"sync": [], "async": []}
    for round_ in range(args.rounds):
        for label, in_flight in (("async", True), ("sync", False)) if round_ % 2 == 0 else (("sync", False),
                                                                                           ("async", True)):
            engine.async_scheduling = in_flight
            row = run_batch(engine, args.batch, args.prompt_len, args.output_len, seed=round_)
            tpot[label].append(row["tpot_ms"])
            ttft[label].append(row["ttft_ms"])
            print(f"round {round_} {label:>5}: TPOT {row['tpot_ms']:.3f} ms, {row['output_tok_s']:.1f} tok/s, "
                  f"TTFT {row['ttft_ms']:.1f} ms", flush=True)
    device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    result = {"device": device, "batch": args.batch, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "num_decode_steps": config.num_decode_steps, "same_tokens": same,
              "tpot_ms": tpot, "median_tpot_ms": {k: statistics.median(v) for k, v in tpot.items()},
              "ttft_ms": ttft, "median_ttft_ms": {k: statistics.median(v) for k, v in ttft.items()}}
    print(json.dumps(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
