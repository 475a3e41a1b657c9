"""The MLA decode kernel of this tree against another tree's (a copy of its kernels/mla/triton_decode.py), same
inputs, same launch knobs, alternated (ABAB, --rounds each), medians: GB/s of latents read per row and launch (the
JSON has every launch; the table, the default and 32-head launches of both trees and this tree's best). Rows: most
of kernels_bench's mla_decode cases (48B shapes: 32 heads, 512 + 64 wide latents, pages of 16, tables as wide as a
CUDA graph's).

    git show HEAD:deltaserve/kernels/mla/triton_decode.py > /tmp/triton_decode_before.py
    python benchmarks/gpu/mla_decode_ab.py --before /tmp/triton_decode_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from kernels_bench import _copy_bandwidth, _decode_inputs, _write_json, rel_err, timed  # noqa: E402

from deltaserve.kernels.mla import triton_decode as current  # noqa: E402

ROWS = [(1, 4096, 1 << 20), (1, 32768, 1 << 20), (1, 131072, 1 << 20), (1, 262144, 1 << 20), (1, 1 << 20, 1 << 20),
        (4, 32768, 1 << 18), (16, 4096, 65536), (64, 512, 65536), (64, 4096, 65536), (256, 512, 65536)]
# launch knobs both trees take (each tree's defaults for the rest), then knobs of this tree only
SHARED_KNOBS = [{}, {"max_head_block": 32}, {"max_head_block": 32, "num_warps": 8},
                {"max_head_block": 32, "num_warps": 8, "num_stages": 3}, {"pdl": False}]
# (the merge before merge_tiles; every head a program from a context of wide_from tokens, 16 heads a program below;
# None: 16 heads at every context)
CURRENT_ONLY = [{"merge_slices": 1, "merge_cols": 512}, {"wide_from": None}, {"wide_from": 1}, {"wide_from": 262144},
                {"wide_from": 524288}]


def load(path: str):
    spec = importlib.util.spec_from_file_location("triton_decode_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the other tree's kernels/mla/triton_decode.py")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): the "
                                                              "script's own test")
    args = parser.parse_args()
    before = load(args.before)
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    H, R, DR, page = (4, 32, 16, 4) if args.smoke else (32, 512, 64, 16)
    copy = _copy_bandwidth(device)
    print(f"copy {copy / 1e9:.0f} GB/s, {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}", flush=True)
    results = []
    for B, ctx, width in [(1, 40, 64), (3, 9, 64)] if args.smoke else ROWS:
        inputs = _decode_inputs(B, H, R, DR, page, ctx, width, dtype, device)
        read = B * ctx * (R + DR) * inputs[2].element_size()
        row = {"batch": B, "context": ctx, "rel_err_vs_before": rel_err(current.triton_mla_decode(*inputs),
                                                                        before.triton_mla_decode(*inputs))}
        variants = [(f"before {k}", before, k) for k in SHARED_KNOBS] + [
            (f"after {k}", current, k) for k in SHARED_KNOBS + CURRENT_ONLY]
        times = {name: [] for name, _, _ in variants}
        for r in range(args.rounds):  # alternate: the order flips every round
            for name, module, knobs in (variants if r % 2 == 0 else variants[::-1]):
                times[name].append(timed(lambda: module.triton_mla_decode(*inputs, **knobs), device))
        row["GBps"] = {name: read / statistics.median(t) / 1e3 for name, t in times.items()}
        row["copy_fraction_best"] = max(row["GBps"].values()) * 1e9 / copy
        results.append(row)
        print(json.dumps(row), flush=True)
        if args.json_out:  # rewritten after every row: a later row may run past the call's time limit
            _write_json({"device": device, "copy_GBps": copy / 1e9, "rows": results}, args.json_out)
    columns = [f"before {k}" for k in SHARED_KNOBS[:2]] + [f"after {k}" for k in SHARED_KNOBS[:2]]
    print("\nGB/s: batch, context, " + ", ".join(columns) + ", the best launch of this tree")
    for row in results:
        g = row["GBps"]
        best = max((v, k) for k, v in g.items() if k.startswith("after"))
        print(f"{row['batch']:>5} {row['context']:>8} " + " ".join(f"{g[c]:>8.0f}" for c in columns)
              + f" {best[0]:>8.0f} ({best[1]}, {best[0] * 1e9 / copy:.0%} of copy)")


if __name__ == "__main__":
    main()
