"""Prefill throughput alone, for A/B comparisons of two trees: prompts prefilled to their first token (one engine
step each at the default budget), timed end to end (host work included) and repeated; the median tokens/s of each
shape. Alternate the trees' processes on one card (their packages first on PYTHONPATH), e.g. for ab/base a commit's
`git archive COMMIT deltaserve | tar -x -C ab/base`:

    for side in new base new base; do PYTHONPATH=.gpu/site:$([ $side = base ] && echo ab/base || echo .) \\
        python3 benchmarks/gpu/prefill_ab.py --tag $side --json-out $OUT/prefill_$side.json; done

Dummy weights in bf16 of --config (default: the 48B layer shapes in 12 layers, which fit an 80 GB card); shapes:
one prompt of --prompt-len tokens, and 16 prompts of 512 (a server's prefill step of many sequences).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from deltaserve.config import EngineConfig
from deltaserve.core.engine import Engine
from deltaserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="benchmarks/configs/kimi-linear-48b-a3b-12layers.json")
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions of each shape, after one untimed")
    parser.add_argument("--tag", default="", help="printed with each row (which tree)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if args.prompt_len < 1 or args.reps < 1:
        parser.error(f"--prompt-len and --reps must be at least 1; got {args.prompt_len}, {args.reps}")
    engine = Engine(args.config, EngineConfig(dtype="bfloat16", device="cuda", load_format="dummy", max_num_seqs=16,
                                              max_model_len=args.prompt_len + 64, max_num_batched_tokens=8192))
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size

    def tokens_per_second(prompts: int, length: int) -> float:
        for _ in range(prompts):
            engine.add_request(torch.randint(0, vocab, (length,), generator=gen).tolist(),
                               SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        return prompts * length / (time.perf_counter() - start)

    result = {"tag": args.tag, "device": torch.cuda.get_device_name()}
    for name, prompts, length in ((f"1x{args.prompt_len}", 1, args.prompt_len), ("16x512", 16, 512)):
        tokens_per_second(prompts, length)  # compiles, tunes, plans
        runs = [tokens_per_second(prompts, length) for _ in range(args.reps)]
        result[name] = {"median_tok_s": statistics.median(runs), "runs": runs}
        print(f"{args.tag} {name}: median {statistics.median(runs):.0f} tok/s, runs {[round(r) for r in runs]}",
              flush=True)
    from deltaserve.kernels.mla import prefill  # the fused attention backend each tree's MLA prefill took

    chosen = getattr(prefill, "_chosen", {})  # a tree older than the backend probe has none
    result["attention_backends"] = {f"{device} {dtype}": name for (device, dtype), name in chosen.items()}
    print(f"{args.tag} attention backends: {result['attention_backends']}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
