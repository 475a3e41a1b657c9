"""Where a decode step's GPU time goes: the kernels of `--steps` decode steps at batch `--batch` (torch.profiler,
which traces a CUDA graph's replay kernel by kernel), per step: wall time, kernel time, kernel count, and the
kernels ranked by their time.

    python benchmarks/gpu/profile_decode.py --config benchmarks/configs/kimi-linear-48b-a3b.json --batch 1
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from deltaserve.config import QUANTIZATION_METHODS, EngineConfig
from deltaserve.core.tensor_parallel import start_engine, stop_engine
from deltaserve.entrypoints.bench import run_batch
from deltaserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a config.json (dummy weights)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--host-top", type=int, default=0,
                        help="also print the host's top functions (cProfile, by own time) over --steps engine steps")
    args = parser.parse_args()
    # one decode step per engine step (no bursts): the kernels and the host time of one token's step
    config = EngineConfig(dtype="bfloat16", device="cuda", load_format="dummy", max_num_seqs=max(args.batch, 1),
                          max_model_len=args.prompt_len + 3 * args.steps + 32, max_num_batched_tokens=8192,
                          quantization=args.quantization, num_decode_steps=1)
    engine, workers = start_engine(args.config, config)
    try:
        run_batch(engine, args.batch, args.prompt_len, 4, seed=1)  # warm-up: compiles, autotunes
        params = SamplingParams(max_tokens=3 * args.steps + 16, temperature=0, ignore_eos=True)
        gen = torch.Generator().manual_seed(0)
        for _ in range(args.batch):
            engine.add_request(torch.randint(0, engine.model_config.vocab_size, (args.prompt_len,),
                                             generator=gen).tolist(), params)
        for _ in range(4):  # prefill, then a few decode steps outside the profile
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / args.steps
        # the same steps without the profiler: the engine's step, and the graph's replay alone (the GPU's step
        # time with the gaps between its kernels; the rest of a step is host work the GPU waits for)
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        step = (time.perf_counter() - start) / args.steps
        replay = graph_replay_seconds(engine, args.batch, args.steps)
        host = host_profile(engine, args.steps, args.host_top) if args.host_top else None
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        stop_engine(engine, workers)
    kernels: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name].append(event.device_time_total if hasattr(event, "device_time_total")
                                       else event.cuda_time_total)
    total = sum(sum(times) for times in kernels.values()) / args.steps
    count = sum(len(times) for times in kernels.values()) / args.steps
    print(f"batch {args.batch}, prompt {args.prompt_len}: wall {1000 * wall:.3f} ms/step under the profiler, kernel "
          f"time {total / 1000:.3f} ms/step, {count:.0f} kernels/step")
    print(f"without the profiler: engine step {1000 * step:.3f} ms, graph replay alone "
          + ("-" if replay is None else f"{1000 * replay:.3f} ms"))
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    print(f"{'us/step':>9} {'calls':>6} {'us/call':>8}  kernel")
    rows = []
    for name, times in ranked[: args.top]:
        per_step, calls = sum(times) / args.steps, len(times) / args.steps
        rows.append({"kernel": name, "us_per_step": per_step, "calls_per_step": calls})
        print(f"{per_step:9.1f} {calls:6.1f} {per_step / calls:8.2f}  {name[:110]}")
    if host:
        print(host)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"batch": args.batch, "wall_ms": 1000 * wall, "kernel_ms": total / 1000, "step_ms": 1000 * step,
                       "replay_ms": None if replay is None else 1000 * replay,
                       "kernels_per_step": count, "top": rows}, f, indent=1)


def host_profile(engine, steps: int, top: int) -> str:
    """The host's own time per function over `steps` engine steps (cProfile), the top ones as text."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def graph_replay_seconds(engine, batch: int, steps: int) -> float | None:
    """Seconds per replay of the decode graph that serves `batch` rows, back to back (None: no graphs)."""
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    graph = graphs.graphs[next(s for s in graphs.sizes if s >= batch)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


if __name__ == "__main__":
    main()
