"""The host's cost of one engine step: the model's forward and logits stubbed out (zeros), so what is timed is the
scheduler, the cache manager, the runner's host work, sampling's bookkeeping and the outputs, on the CPU.

    python benchmarks/host_step.py --batch 1 --steps 300
    python benchmarks/host_step.py --batch 256 --steps 40 --async-scheduling
    python benchmarks/host_step.py --prompt-len 1048000 --steps 30 --num-decode-steps 8   # at a 1M-token context

Compare two trees by running this script with each one's package first on PYTHONPATH, alternated. The requests are
greedy with ignore_eos and never finish within the steps timed; prefix caching is on (the engine's default).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from deltaserve import LLM, SamplingParams
from deltaserve.entrypoints.bench import prefill_phase
from deltaserve.entrypoints.make_tiny import make_tiny


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300, help="steps timed, after 5 untimed ones")
    parser.add_argument("--num-decode-steps", type=int, default=1)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompt-len", type=int, default=16,
                        help="tokens of each prompt (a long one: the host's per-step cost at a long context)")
    args = parser.parse_args()
    if args.batch < 1 or args.steps < 1 or args.prompt_len < 1:
        parser.error("--batch, --steps and --prompt-len must be at least 1")
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny(Path(folder) / "model", seed=0)
        max_len = max(4096, args.prompt_len + (args.steps + 10) * args.num_decode_steps)
        config = json.loads((model / "config.json").read_text())
        config["model_max_length"] = max(max_len, config["model_max_length"])  # the demo's limit raised
        (model / "config.json").write_text(json.dumps(config))
        llm = LLM(str(model), device="cpu", threads=1, max_model_len=max_len, max_num_seqs=max(args.batch, 2),
                  num_decode_steps=args.num_decode_steps, max_num_batched_tokens=8192,
                  async_scheduling=args.async_scheduling)
        engine = llm.engine
        vocab = engine.model_config.vocab_size
        engine.runner._forward = lambda ids, batch: torch.zeros(ids.shape[0], 4)
        engine.runner.model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], vocab)
        max_tokens = (args.steps + 10) * args.num_decode_steps
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=args.temperature, seed=0)
        for _ in range(args.batch):
            engine.add_request([1 + i % 200 for i in range(args.prompt_len)], params)
        prefill_phase(engine, args.batch)  # the prompts' chunks, untimed, until each has its first token
        for _ in range(5):
            engine.step()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        seconds = time.perf_counter() - start
    print(f"batch {args.batch}, {args.num_decode_steps} decode steps a step, async {args.async_scheduling}: "
          f"{1000 * seconds / args.steps:.3f} ms a step")


if __name__ == "__main__":
    main()
