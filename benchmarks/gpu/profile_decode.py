"""Where a decode step's GPU time goes: the kernels of `--steps` decode steps at batch `--batch` (torch.profiler,
which traces a CUDA graph's replay kernel by kernel), per step: wall time, kernel time, kernel count, the kernels
ranked by their time, and the GPU's idle time between them (the largest gaps with the kernels on either side).

With `--burst N` each engine step is a decode burst of N steps (the bench's default is 8), so the idle time shows
what a burst costs beyond its graphs' replays; `--prefill-len L` also profiles the prefill of one L-token prompt
(same engine, after the decode steps).

With programmatic dependent launch (the default on Hopper: kernels/pdl.py) a kernel is scheduled early and waits
inside itself for the one before, so the profiler's kernel times overlap and include those waits (their sum exceeded
the graph's replay by 30% in the sixth lease); for each kernel's own time, profile with --no-pdl (every Triton
kernel recompiles at the engine's start).

    python benchmarks/gpu/profile_decode.py --config benchmarks/configs/kimi-linear-48b-a3b.json --batch 1
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from deltaserve.config import QUANTIZATION_METHODS, EngineConfig
from deltaserve.core.tensor_parallel import start_engine, stop_engine
from deltaserve.entrypoints.bench import prefill_phase, run_batch
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
    parser.add_argument("--burst", type=int, default=1, help="decode steps an engine step (--num-decode-steps)")
    parser.add_argument("--prefill-len", type=int, default=0,
                        help="also profile the prefill of one prompt this long, after the decode steps")
    parser.add_argument("--gaps", type=int, default=8, help="the largest idle gaps of the GPU to list")
    parser.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=True,
                        help="programmatic dependent launch of the decode kernels (EngineConfig.pdl)")
    parser.add_argument("--timeline-out", default=None,
                        help="write the GPU's work (start and end in us, name) over the last profiled decode engine "
                             "step, with the host's runner calls, to this JSON file")
    parser.add_argument("--host-top", type=int, default=0,
                        help="also print the host's top functions (cProfile, by own time) over --steps engine steps")
    args = parser.parse_args()
    if args.burst < 1 or args.steps < 1 or args.prefill_len < 0:
        parser.error(f"--burst and --steps must be at least 1, --prefill-len at least 0; got --burst {args.burst}, "
                     f"--steps {args.steps}, --prefill-len {args.prefill_len}")
    # one decode step per engine step unless --burst: the kernels and the host time of one token's step
    # each request decodes a few warm-up engine steps, then three rounds of --steps (profiled, timed, host profile)
    decode_tokens = (3 * args.steps + 4) * args.burst + 16
    longest = max(args.prompt_len + decode_tokens + 16, args.prefill_len + 32)
    config = EngineConfig(dtype="bfloat16", device="cuda", load_format="dummy", max_num_seqs=max(args.batch, 1),
                          max_model_len=longest, max_num_batched_tokens=8192, quantization=args.quantization,
                          num_decode_steps=args.burst, pdl=args.pdl)
    engine, workers = start_engine(args.config, config)
    try:
        # warm-up: compiles, autotunes (a long prompt's shapes past 8k are its chunks', the same as 8k's)
        run_batch(engine, args.batch, min(args.prompt_len, 8192), 4, seed=1)
        decode = _profile_decode(engine, args)
        prefill = None
        if args.prefill_len:
            run_batch(engine, 1, args.prefill_len, 1, seed=2)  # warm-up: the long prompt's chunk shapes
            prefill = _profile_prefill(engine, args.prefill_len)
    finally:
        stop_engine(engine, workers)
    prof, wall, step, replay, host = decode
    print(f"batch {args.batch}, prompt {args.prompt_len}, {args.burst} decode step(s) an engine step: wall "
          f"{1000 * wall:.3f} ms an engine step under the profiler")
    print(f"without the profiler: engine step {1000 * step:.3f} ms ({1000 * step / args.burst:.3f} ms a decode step), "
          "graph replay alone " + ("-" if replay is None else f"{1000 * replay:.3f} ms"))
    if args.timeline_out:
        with open(args.timeline_out, "w") as f:
            json.dump(last_step_timeline(prof), f)
    result = {"batch": args.batch, "burst": args.burst, "wall_ms": 1000 * wall, "step_ms": 1000 * step,
              "replay_ms": None if replay is None else 1000 * replay,
              "decode": report(prof, args.steps * args.burst, "decode step", args.top, args.gaps)}
    if host:
        print(host)
    if prefill is not None:
        prof, wall = prefill
        print(f"\nprefill of one {args.prefill_len}-token prompt: {1000 * wall:.1f} ms under the profiler "
              f"({args.prefill_len / wall:.0f} tok/s)")
        result.update(prefill_len=args.prefill_len, prefill_ms=1000 * wall,
                      prefill=report(prof, 1, "prefill", args.top, args.gaps))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


def report(prof, units: int, unit: str, top: int, num_gaps: int) -> dict:
    """Print and return a profile's kernel time, kernel count and idle time per `unit` (the profile holds `units`
    of them), the GPU's largest idle gaps and the `top` kernels by time."""
    kernels: dict[str, list[float]] = defaultdict(list)
    for event in _device_events(prof):
        kernels[event.name].append(event.device_time_total if hasattr(event, "device_time_total")
                                   else event.cuda_time_total)
    total = sum(sum(times) for times in kernels.values()) / units
    count = sum(len(times) for times in kernels.values()) / units
    idle = gpu_idle(prof, num_gaps)
    print(f"kernel time {total / 1000:.3f} ms a {unit}, {count:.0f} kernels a {unit}; GPU idle between them "
          f"{idle['idle_us'] / units:.1f} us a {unit} ({idle['gaps_over_10us'] / units:.2f} gaps of over 10 us a "
          f"{unit}); the largest gaps:")
    for gap in idle["largest"]:
        print(f"  {gap['us']:9.1f} us at {gap['at_us'] / 1000:7.2f} ms  after {gap['after'][:50]}  before "
              f"{gap['before'][:50]}  host: {', '.join(gap['host'])}")
    print(f"{'us/' + unit[:7]:>11} {'calls':>6} {'us/call':>8}  kernel")
    rows = []
    for name, times in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]:
        per_unit, calls = sum(times) / units, len(times) / units
        rows.append({"kernel": name, "us_per_unit": per_unit, "calls_per_unit": calls})
        print(f"{per_unit:11.1f} {calls:6.1f} {per_unit / calls:8.2f}  {name[:110]}")
    return {"kernel_ms": total / 1000, "kernels": count, "idle": idle, "top": rows}


def _profile_decode(engine, args):
    """(profile, wall seconds an engine step under it, the same without it, graph replay seconds, host text) over
    args.steps engine steps of args.batch requests, each step args.burst decode steps."""
    params = SamplingParams(max_tokens=(3 * args.steps + 4) * args.burst + 16, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.batch):
        engine.add_request(torch.randint(0, engine.model_config.vocab_size, (args.prompt_len,),
                                         generator=gen).tolist(), params)
    prefill_phase(engine, args.batch)  # the prompts' chunks (a long prompt takes many steps), outside the profile
    for _ in range(3):  # and a few decode steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            with record_function("engine_step"):
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
    return prof, wall, step, replay, host


def _profile_prefill(engine, prompt_len: int):
    """(profile, wall seconds) of the prefill of one prompt of prompt_len tokens (every chunk, to its first token)."""
    gen = torch.Generator().manual_seed(3)
    engine.add_request(torch.randint(0, engine.model_config.vocab_size, (prompt_len,), generator=gen).tolist(),
                       SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return prof, wall


def last_step_timeline(prof) -> dict:
    """The last engine step of a profile: the GPU's work and the host's top-level calls that launch or
    wait (graph replays, copies, syncs), as [start us, end us, name] from the step's first host event."""
    host = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CPU and (
                      e.name.startswith("cuda") or e.name in ("aten::copy_", "aten::_local_scalar_dense", "aten::item",
                                                             "aten::to")))
    device = sorted((e.time_range.start, e.time_range.end, e.name) for e in _device_events(prof))
    step = [e for e in prof.events() if e.name == "engine_step"
            and e.device_type == torch.autograd.DeviceType.CPU]
    begin = max(e.time_range.start for e in step)
    keep = lambda events: [[a - begin, b - begin, n[:80]] for a, b, n in events if b >= begin]  # noqa: E731
    return {"host": keep(host), "device": keep(device)}


def _device_events(prof) -> list:
    """The GPU's kernels, copies and memsets (not the device-side span of an engine_step annotation)."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "engine_step"]


def gpu_idle(prof, top: int) -> dict:
    """The GPU's idle time between its kernels and copies over the profile: total, span, gaps over 10 us, and the
    `top` largest gaps with the names of the work on either side, where they fall (us from the first kernel) and
    the host's operators that overlap each most (what the host was doing while the GPU waited)."""
    events = sorted(((e.time_range.start, e.time_range.end, e.name) for e in _device_events(prof)))
    gaps, idle, reach, last = [], 0.0, None, ""
    for start, end, name in events:
        if reach is not None and start > reach:
            idle += start - reach
            gaps.append({"us": start - reach, "at_us": reach - events[0][0], "after": last, "before": name,
                         "window": (reach, start)})
        if reach is None or end > reach:
            reach, last = end, name
    span = (reach - events[0][0]) if events else 0.0
    largest = sorted(gaps, key=lambda g: -g["us"])[:top]
    host = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CPU and e.name != "engine_step"]
    for gap in largest:
        a, b = gap.pop("window")
        overlaps = sorted(((min(end, b) - max(start, a), name) for start, end, name in host if start < b and end > a),
                          reverse=True)
        gap["host"] = [f"{name[:40]} {us:.0f}" for us, name in overlaps[:3]]
    return {"idle_us": idle, "span_us": span, "gaps_over_10us": sum(g["us"] > 10 for g in gaps), "largest": largest}


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
