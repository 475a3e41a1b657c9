"""What a new chunk length costs MLA prefill's fused attention: the same sequence of ragged chunks (a server's
prompts split wherever a step's token budget ends) through the fused plan as it runs now (cuDNN on padded lengths,
the short cached tail folded into the causal call) and as it ran before (each call at its own length: the chunk's
keys causal, the cached ones apart), alternating. cuDNN builds an execution plan for every new shape, so the first
pass over the chunks pays those builds and the second shows the kernels alone.

    python benchmarks/gpu/prefill_shapes.py --json-out /tmp/prefill_shapes.json        # on a GPU
    python benchmarks/gpu/prefill_shapes.py --smoke                                     # anywhere: the script runs

Each chunk is (T new tokens, start cached ones) at the 48B shape's MLA widths (32 heads, keys 192, values 128, bf16);
the rows give milliseconds per chunk, first pass and second, and the outputs' relative difference between the
two plans.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from deltaserve.kernels.mla.attention import merge_blocks, mla_prefill_fused
from deltaserve.kernels.mla.prefill import _cudnn, _cudnn_as_is, attention_lse_naive, padded


def plan_before(attend):
    """The fused plan of before 2026-12-06: the chunk's own keys causal, then the whole cached prefix (short
    contexts: one block), each call at its own length."""
    def run(q_nope, q_rope, expand, scale, start):
        q = torch.cat([q_nope, q_rope], dim=-1)
        out, lse = attend(q, *expand(start, start + q.shape[0]), scale, causal=True)
        out = out.float()
        if start:
            part, part_lse = attend(q, *expand(0, start), scale, causal=False)
            out, lse = merge_blocks(out, lse, part.float(), part_lse)
        return out.to(q_nope.dtype)
    return run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=640, help="new tokens and cached ones each drawn up to this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, the twin for cuDNN")
    args = p.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    H, Dn, Dr, Dv = (2, 16, 8, 12) if args.smoke else (32, 128, 64, 128)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gen = torch.Generator().manual_seed(args.seed)
    chunks = [(int(t), int(s)) for t, s in zip(torch.randint(1, args.max_tokens, (args.chunks,), generator=gen),
                                               torch.randint(0, args.max_tokens, (args.chunks,), generator=gen))]
    L = 2 * args.max_tokens
    q = torch.randn(args.max_tokens, H, Dn + Dr, device=device, dtype=dtype)
    k = torch.randn(L, H, Dn + Dr, device=device, dtype=dtype)
    v = torch.randn(L, H, Dv, device=device, dtype=dtype)
    expand = lambda lo, hi: (k[lo:hi].clone(), v[lo:hi].clone())  # noqa: E731  (a copy, as expanding writes)
    now_attend = functools.partial(padded, attention_lse_naive) if args.smoke else _cudnn  # smoke: the padding too
    before_attend = attention_lse_naive if args.smoke else _cudnn_as_is
    plans = {
        "now": lambda qn, qr, s: mla_prefill_fused(torch.cat([qn, qr], -1), expand, Dn ** -0.5, s, 65536,
                                                   attend=now_attend),
        "before": lambda qn, qr, s, run=plan_before(before_attend): run(qn, qr, expand, Dn ** -0.5, s),
    }
    times = {name: [[], []] for name in plans}
    diffs = []
    for pass_ in range(2):
        for T, start in chunks:
            outs = {}
            for name, plan in (plans.items() if pass_ == 0 else reversed(plans.items())):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs[name] = plan(q[:T, :, :Dn], q[:T, :, Dn:], start)
                if device == "cuda":
                    torch.cuda.synchronize()
                times[name][pass_].append(1e3 * (time.perf_counter() - t0))
            if pass_ == 0:
                a, b = outs["now"].float(), outs["before"].float()
                diffs.append(((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "chunks": chunks,
              "ms": times, "max_rel_diff": max(diffs)}
    print(f"{len(chunks)} chunks (T, start) drawn up to {args.max_tokens}; ms a chunk (mean / median / max), "
          f"{result['device']}")
    for name, (first, second) in times.items():
        print(f"  {name:7s} first pass {statistics.mean(first):8.2f} / {statistics.median(first):7.2f} / "
              f"{max(first):7.2f}   second pass {statistics.mean(second):7.2f} / {statistics.median(second):7.2f}"
              f" / {max(second):7.2f}")
    print(f"  outputs: largest relative difference between the plans {result['max_rel_diff']:.2e}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
