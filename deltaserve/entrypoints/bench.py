"""deltaserve bench: TTFT, TPOT, prefill and output tokens/s, peak memory, and the bandwidth floor of a decode step.

The floor is the bytes a decode step must move (the active weights: everything but the routed experts no token
of the step chose; the MLA latents read; the KDA states read and written) over the copy bandwidth measured in the
same process. The experts a step chose are measured (routing_stats.py) in a second, eager run of each row's
requests after its timed one (measure_routing); the uniform-routing expectation is kept beside them."""

from __future__ import annotations

import json
import math
import sys
import time

import torch

from deltaserve.cache.sizing import DTYPE_BYTES, format_bytes
from deltaserve.config import MLA, MOE, EngineConfig, ModelConfig
from deltaserve.core.engine import Engine
from deltaserve.entrypoints.routing_stats import RoutingRecorder, RoutingStats, uniform_distinct_experts
from deltaserve.runner.allocator_watch import allocator_retries
from deltaserve.sampling_params import SamplingParams


def _pdl_on(device: str, pdl: bool) -> bool:
    """Whether our decode kernels launch with PDL on device, pdl being the engine's choice (kernels.pdl imports
    triton, which a CPU install lacks)."""
    if device == "cpu":
        return False
    from deltaserve.kernels.pdl import pdl_args

    return pdl_args(torch.device(device), pdl)["PDL"]


def decode_step_bytes(cfg: ModelConfig, batch: int, context: int, dtype_bytes: int,
                      distinct_experts: float | None = None, latent_bytes: int | None = None) -> int:
    """Bytes one decode step of `batch` sequences at `context` tokens must read or write at least (weights as
    stored: FP8 ones and their scales with cfg.quantization). distinct_experts: the routed experts a step reads per
    MoE layer (measured); by default the expectation under uniform routing. latent_bytes: a cached latent value's
    (1 with a float8 latent cache; default dtype_bytes)."""
    E, k = cfg.num_experts, cfg.num_experts_per_token
    hit = uniform_distinct_experts(E, k, batch) if distinct_experts is None else distinct_experts
    num_moe = sum(t == MOE for t in cfg.mlp_types)
    other, routed = _weight_bytes(cfg, torch.float32 if dtype_bytes == 4 else torch.bfloat16)
    weights = other + num_moe * hit * routed / max(num_moe * E, 1)
    latents = batch * context * cfg.latent_dim * sum(t == MLA for t in cfg.layer_types) * (latent_bytes or dtype_bytes)
    kda_state = 2 * batch * len(cfg.kda_layer_ids) * cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4
    return int(weights + latents + kda_state)


def _weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the weights a decode step reads whatever the routing, bytes of all routed experts)."""
    from deltaserve.loader.model_loader import build_model

    model = build_model(cfg, dtype)  # meta device: no memory
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    routed = sum(size for name, size in sizes.items() if name.split(".")[-1].startswith(("w13", "w2")))
    embedding = sizes["embed_tokens.weight"]  # the embedding reads one row per token
    return sum(sizes.values()) - routed - embedding, routed


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write), median of 10."""
    src = torch.randn((64 if device == "cpu" else 256) << 20, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / sorted(times[2:])[len(times[2:]) // 2]


def run_batch(engine: Engine, batch: int, prompt_len: int, output_len: int, seed: int) -> dict:
    """Submit `batch` random prompts at once and run them to the end.

    Prefill phase: until every request has its first token (steps may mix decodes in). Decode phase: from then
    on every step is decode only, so its tokens over its time are the decode throughput, and its time over the
    tokens each request got in it the TPOT (a step may run several decode steps: lookahead). The decode phase
    drains: requests that started early (they decoded in the prefill phase's mixed steps) finish first, so its later
    steps carry fewer rows (at batch 256, prompt 512, output 32: 187 a step on average). Its steady part, from its
    start through the step in which the first request finishes, has every request in every step: the figures
    comparable to a step's floor at `batch` (steady_tok_s, steady_tpot_ms; nan where a request finished before the
    decode phase began)."""
    _add_requests(engine, batch, prompt_len, output_len, seed)
    start = time.perf_counter()
    finished, tokens_at_start = _prefill_phase(engine, batch)
    prefill_done, tokens_at_prefill_done = time.perf_counter(), sum(tokens_at_start.values())
    steps, steady_s, steady_tokens = 0, 0.0, 0
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.finished]
        steps += 1
        if done and not finished:  # the first request to finish: the steady part ends with this step
            steady_s = time.perf_counter() - prefill_done
            steady_tokens = _tokens_so_far(engine, done) - tokens_at_prefill_done
        finished += done
    end = time.perf_counter()
    tokens = batch * output_len - tokens_at_prefill_done
    # the request with the fewest tokens when the decode phase begins runs through all of its decode steps
    decode_steps = output_len - min(tokens_at_start.values())
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in finished]
    return {"batch": batch, "ttft_ms": 1000 * sum(ttft) / batch,
            "tpot_ms": 1000 * (end - prefill_done) * batch / max(tokens, 1),
            "prefill_tok_s": batch * prompt_len / (prefill_done - start),
            "output_tok_s": tokens / (end - prefill_done) if steps else float("nan"),
            "steady_tok_s": steady_tokens / steady_s if steady_tokens else float("nan"),
            "steady_tpot_ms": 1000 * steady_s * batch / steady_tokens if steady_tokens else float("nan"),
            "steady_tokens": steady_tokens,
            "decode_rows_mean": tokens / decode_steps if decode_steps else float("nan"),
            "total_s": end - start}


def measure_routing(engine: Engine, batch: int, prompt_len: int, output_len: int, seed: int) -> RoutingStats | None:
    """The experts chosen in the steady decode steps (every request in the step) of run_batch(engine, batch,
    prompt_len, output_len, seed), from a second run of the same requests (same prompts, greedy), eager and untimed,
    with a RoutingRecorder on; in all its decode steps where a request finished before them (the stats' tokens per
    step then fall short of the batch).

    Why a second run and not a counter inside the timed one: a timed decode step is a CUDA graph replay (its batch
    padded to a captured size with rows that must not count), or several of them queued without a host sync; a
    counter would add kernels to what is timed and need the real rows' count on the device. The eager run executes
    the same model code on the real rows only. Its tokens equal the timed run's but where the graphs' rounding
    tips a near-tie of the sampled token, which changes no routing statistic."""
    _add_requests(engine, batch, prompt_len, output_len, seed)
    with engine.eager():
        prefill_phase(engine, batch)
        with RoutingRecorder(engine.model) as recorder:  # from here on every step is decode only
            while engine.has_unfinished_requests():
                engine.step()
    return recorder.stats(tokens=batch) or recorder.stats()  # every decode step where no step had the whole batch


def _add_requests(engine: Engine, batch: int, prompt_len: int, output_len: int, seed: int) -> None:
    """`batch` prompts of random tokens (drawn from seed), each to run for output_len tokens, greedy."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for _ in range(batch):
        ids = torch.randint(0, engine.model_config.vocab_size, (prompt_len,), generator=gen).tolist()
        engine.add_request(ids, params)


def prefill_phase(engine: Engine, batch: int) -> list:
    """Step until each of the `batch` requests has its first token; the outputs of those that finished."""
    return _prefill_phase(engine, batch)[0]


def _prefill_phase(engine: Engine, batch: int) -> tuple[list, dict[str, int]]:
    """prefill_phase, and each request's output tokens when it ends."""
    tokens: dict[str, int] = {}
    finished = []
    while len(tokens) < batch:
        outputs = engine.step()
        tokens.update((o.request_id, len(o.outputs[0].token_ids)) for o in outputs)
        finished += [o for o in outputs if o.finished]
    return finished, tokens


def _tokens_so_far(engine: Engine, finished: list) -> int:
    """Output tokens generated so far by the requests in the engine and those already finished."""
    return engine.num_unfinished_output_tokens() + sum(len(o.outputs[0].token_ids) for o in finished)


# output tokens of a long-prompt row: its decode steps time TPOT at that context. Enough that the row's fixed costs
# (its first decode step's, and releasing 65k pages at 1M tokens when it ends) weigh little on each token
LONG_OUTPUT_LEN = 64
# A long row's warm-up prompt: as many tokens compile and tune every kernel shape a longer prompt's chunks meet (the
# chunks are the same shapes; only their attention's prefix grows), so a ~1M row does not prefill twice.
LONG_WARMUP_TOKENS = 32_768


def bench(model: str, engine_config: EngineConfig, batch_sizes: list[int], prompt_len: int, output_len: int,
          long_prompt_lens: list[int] = ()) -> dict:
    """Rows for each batch size at prompt_len, then one row per long prompt length: a single prompt that long (the
    prefill figure of a long prompt, and TPOT at that context), each after a warm-up at its own shape."""
    from deltaserve.core.tensor_parallel import start_engine, stop_engine

    engine, workers = start_engine(model, engine_config)
    try:
        return _bench(engine, batch_sizes, prompt_len, output_len, long_prompt_lens)
    finally:
        stop_engine(engine, workers)


def _bench(engine: Engine, batch_sizes: list[int], prompt_len: int, output_len: int,
           long_prompt_lens: list[int]) -> dict:
    engine_config, cfg = engine.config, engine.model_config
    device, world = engine_config.device, engine_config.tensor_parallel_size
    dtype_bytes, latent_bytes = DTYPE_BYTES[engine_config.dtype], DTYPE_BYTES[engine_config.latent_dtype]
    bandwidth = copy_bandwidth(device)
    rows, peak = [], 0
    runs = [(batch, prompt_len, output_len) for batch in batch_sizes]
    runs += [(1, n, LONG_OUTPUT_LEN) for n in long_prompt_lens]
    for batch, prompt, output in runs:
        # warm-up at the row's shape: a batch's prefill chunks (and their token-expert pairs) are shapes of their
        # own, and the kernels compile and autotune on a shape's first call
        warmup = prompt if prompt <= LONG_WARMUP_TOKENS or batch > 1 else LONG_WARMUP_TOKENS
        run_batch(engine, batch, warmup, 2, seed=2**31 + batch + prompt)  # not a measured row's prompts (cached)
        if device != "cpu":
            torch.cuda.reset_peak_memory_stats(device)  # the row's own peak: a long prompt's prefill shows here
            retries = allocator_retries(device)
        row = {"prompt_len": prompt, **run_batch(engine, batch, prompt, output, seed=batch + prompt)}
        row["peak_memory_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30 if device != "cpu" else None
        # times the caching allocator freed its cache to fit an allocation in this row (each stalls a step)
        row["alloc_retries"] = allocator_retries(device) - retries if device != "cpu" else None
        # a single token's k experts are k distinct ones: batch 1 needs no second run (nor a long prompt's prefill)
        routing = measure_routing(engine, batch, prompt, output, seed=batch + prompt) if batch > 1 else None
        # each GPU reads its own memory; CPU ranks share one memory bus, so there the bandwidth is the machine's
        ranks_bandwidth = bandwidth * world if device != "cpu" else bandwidth
        row.update(floor_fields(cfg, row, routing, prompt + output // 2, dtype_bytes, ranks_bandwidth, latent_bytes))
        rows.append(row)
        peak = max(peak, row["peak_memory_GiB"] or 0)
        print(f"row {json.dumps(row)}", file=sys.stderr, flush=True)  # kept if a later row runs past a time limit
        if row["faster_than_floor"]:
            print(floor_warning(row), file=sys.stderr, flush=True)
    return {"device": torch.cuda.get_device_name(device) if device != "cpu" else "cpu", "dtype": engine_config.dtype,
            "quantization": cfg.quantization.method if cfg.quantization else None,
            "kv_cache_dtype": engine_config.latent_dtype, "load_format": engine_config.load_format,
            "tensor_parallel_size": world,
            "expert_parallel": engine_config.enable_expert_parallel,
            "programmatic_dependent_launch": _pdl_on(device, engine_config.pdl),
            "async_scheduling": engine.async_scheduling,
            "copy_GBps": bandwidth / 1e9, "peak_memory_GiB": peak or None,  # the rows' largest
            "prompt_len": prompt_len, "output_len": output_len, "capacity": cache_capacity(engine.cache_plan),
            "rows": rows}


def floor_fields(cfg: ModelConfig, row: dict, routing: RoutingStats | None, context: int, dtype_bytes: int,
                 bandwidth: float, latent_bytes: int | None = None) -> dict:
    """The row's routing and floor fields: the floor from the distinct experts measured (exactly k at batch 1),
    the uniform-routing floor beside it, and whether the row ran faster than its floor (then the floor, the
    timing or the routing measurement is wrong). bandwidth: of all ranks together (tensor parallel: each GPU reads
    about 1 / world of the bytes; the embedding and lm_head are replicated)."""
    batch, k = row["batch"], cfg.num_experts_per_token
    distinct = routing.distinct_experts if routing else (float(k) if batch == 1 else None)  # None: no MoE layer
    floor = decode_step_bytes(cfg, batch, context, dtype_bytes, distinct, latent_bytes) / bandwidth
    uniform = decode_step_bytes(cfg, batch, context, dtype_bytes, latent_bytes=latent_bytes) / bandwidth
    return {"distinct_experts": distinct,
            "distinct_experts_uniform": uniform_distinct_experts(cfg.num_experts, k, batch),
            "busiest_expert_load": routing.busiest_expert_load if routing else None,
            "routed_tokens_per_step": routing.tokens_per_step if routing else None,
            "floor_ms": 1000 * floor, "floor_tok_s": batch / floor,
            "floor_uniform_ms": 1000 * uniform, "floor_uniform_tok_s": batch / uniform,
            "faster_than_floor": _decode_tok_s(row) > batch / floor}


def _decode_tok_s(row: dict) -> float:
    """The row's decode throughput at its full batch: the steady part's where it has one, else the decode phase's."""
    steady = row.get("steady_tok_s", math.nan)
    return row["output_tok_s"] if math.isnan(steady) else steady


def floor_warning(row: dict) -> str:
    return (f"warning: batch {row['batch']} (prompt {row['prompt_len']}) decoded {_decode_tok_s(row):.0f} tok/s, "
            f"faster than its floor of {row['floor_tok_s']:.0f} tok/s (from {row['distinct_experts']} distinct experts "
            "per MoE layer per step): the floor, the timing or the routing measurement is wrong; do not report it")


def cache_capacity(plan) -> dict:
    """What the cache this engine allocated could hold: its bytes, the longest context one request could reach
    (pages of every MLA layer plus one KDA state slot) and how many 4k-token requests fit at once, if the same
    bytes were spent on pages and slots for that many (the KDA slots are fixed per request, the pages per token)."""
    cache = plan.num_blocks * plan.bytes_per_block + (plan.num_slots + plan.num_snapshot_slots) * plan.bytes_per_slot
    per_token = plan.bytes_per_block / plan.block_size
    per_4k = plan.bytes_per_slot + -(-4096 // plan.block_size) * plan.bytes_per_block
    return {"cache_GiB": cache / 2**30, "cache_bytes": cache, "page_tokens": plan.num_blocks * plan.block_size,
            "max_context_batch1": int((cache - plan.bytes_per_slot) // per_token) if per_token else None,
            "batch_at_4k": int(cache // per_4k)}


def print_report(result: dict) -> None:
    cols = ("batch", "prompt_len", "ttft_ms", "tpot_ms", "prefill_tok_s", "output_tok_s", "steady_tok_s", "floor_ms",
            "floor_tok_s", "distinct_experts", "peak_memory_GiB")
    weights = f" ({result['quantization']} weights)" if result.get("quantization") else ""
    pdl = ", programmatic dependent launch" if result.get("programmatic_dependent_launch") else ""
    ahead = ", asynchronous scheduling" if result.get("async_scheduling") else ""
    ahead += ", float8 latent cache" if result.get("kv_cache_dtype") == "float8_e4m3fn" else ""
    ranks = result.get("tensor_parallel_size") or 1
    ranks = f", {ranks} ranks" + (" (expert parallel)" if result.get("expert_parallel") else "") if ranks > 1 else ""
    peak = result["peak_memory_GiB"]
    peak = "" if peak is None else f", peak memory {peak:.1f} GiB"  # None on a CPU
    long = f" (long prompts: {LONG_OUTPUT_LEN})" if any(r["prompt_len"] != result["prompt_len"]
                                                        for r in result["rows"]) else ""
    print(f"device {result['device']}{ranks}, {result['dtype']}{weights}{pdl}{ahead}, copy "
          f"{result['copy_GBps']:.0f} GB/s{peak}, prompt {result['prompt_len']}, output {result['output_len']}{long}")
    capacity = result["capacity"]
    size = format_bytes(capacity["cache_bytes"]) if "cache_bytes" in capacity else f"{capacity['cache_GiB']:.1f} GiB"
    pages = f" ({capacity['page_tokens']} tokens of MLA pages)" if "page_tokens" in capacity else ""
    at_4k = capacity["batch_at_4k"]
    print(f"cache {size}{pages}; spent on pages and slots for them, its bytes would hold one request of up to "
          f"{capacity['max_context_batch1']} tokens, or {at_4k} request{'' if at_4k == 1 else 's'} of 4k tokens")
    print("".join(f"{c:>17}" for c in cols))
    for row in result["rows"]:
        cells = (row.get(c) for c in cols)  # None (no GPU memory on a CPU, no MoE layer) prints as "-"
        print("".join(f"{v:>17.2f}" if isinstance(v, float) else f"{'-' if v is None else v:>17}" for v in cells))
    for row in result["rows"]:
        if row["faster_than_floor"]:
            print(floor_warning(row))
    print(json.dumps(result))


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)
