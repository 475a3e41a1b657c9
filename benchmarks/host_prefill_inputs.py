"""The host's work on a prefill step's inputs at a step's token budget, on the CPU: the MLA cache slots of a chunk
(runner.host_batch.cache_slots, a run a page, against cache_slot a token), an int64 list to a tensor
(kernels.varlen.to_device's buffer path against torch.tensor), and a prefix-caching snapshot split's passes
(HostBatch._snapshot_split: one prompt split, and 16 prompts each split).

    python benchmarks/host_prefill_inputs.py --tokens 8192
"""

from __future__ import annotations

import argparse
import time

import torch

from deltaserve.kernels.varlen import to_device
from deltaserve.runner.host_batch import HostBatch, cache_slot, cache_slots


def per_call_ms(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=100)
    args = parser.parse_args()
    if args.tokens < 256 or args.reps < 1:
        parser.error(f"--tokens must be at least 256 and --reps at least 1; got {args.tokens}, {args.reps}")
    n, block = args.tokens, 16
    pages = list(range(1000, 1000 + n // block + 1))
    values = list(range(100_000, 100_000 + n))
    rows = {
        "cache slots, a run a page": lambda: cache_slots(pages, 0, n, block),
        "cache slots, a call a token": lambda: [cache_slot(pages, p, block) for p in range(n)],
        "int64 list to a tensor, to_device": lambda: to_device(values, torch.int64, "cpu"),
        "int64 list to a tensor, torch.tensor": lambda: torch.tensor(values, dtype=torch.int64),
    }
    for prompts in (1, 16):
        length = n // prompts
        batch = HostBatch(values, values, values, [length] * prompts, [0] * prompts, list(range(prompts)),
                          [pages] * prompts, [(i, length - 16, 40 + i) for i in range(prompts)])
        cu = [length * i for i in range(prompts + 1)]
        rows[f"snapshot split, {prompts} prompt(s) split"] = (
            lambda batch=batch, cu=cu: batch._snapshot_split(0, cu, torch.device("cpu")))
    for name, fn in rows.items():
        print(f"{name:40s} {per_call_ms(fn, args.reps):8.3f} ms")


if __name__ == "__main__":
    main()
