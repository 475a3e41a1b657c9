"""Kernel-level timings at the 48B model's shapes, each against the alternative it replaced or could replace, with the
outputs cross-checked (relative error against the first variant) so a fast wrong kernel shows:

  mla_decode    paged Triton MLA decode, its table as wide as a CUDA graph's (the model length), against the torch
                twin as it ran before (every page of a 4k-wide graph table gathered, or the batch's width past 4k)
  mla_prefill   one 8k-token chunk after L cached tokens: PyTorch's fused attention as deltaserve calls it (values
                128 wide: the memory-efficient kernel) against values zero-padded to the keys' 192 (flash may run)
  fp8_experts   routed experts on FP8 weights: the grouped FP8 kernel against dequantizing the experts to bf16 a
                chunk at a time and running the bf16 grouped GEMMs (and bf16 weights, for scale), per token count
  decode_experts  the few-token expert GEMVs with the shared expert as a slot: autotuned, every candidate tile, and
                the shared expert run on its own as before
  batch_experts  a decode batch's routed experts (8, 64 and 256 tokens): the sorted-block Triton kernels at their
                launch knobs against torch._grouped_mm
  gemv          the few-token dense projections (o_proj, in_proj, ...): our GEMV, autotuned and each tile, against
                cuBLAS
  router        the router's logits for a few tokens: our GEMV, autotuned and each tile, against the float32 copy
                and cuBLAS GEMV
  norm_gemv     a decoder layer's norms inside the GEMVs that read them, one token, against norm and projection apart
  norms         the RMSNorms as Triton kernels (kernels.triton_norm) against torch.compile of their eager twins (the
                GPU path before 2ecc16d) and the eager ops, from one token to a prefill chunk
  kda_prefill   a short prefill's KDA recurrence: our recurrent kernel against fla-core's chunked one (both include
                the state copy each variant starts from), 1 to 512 tokens
  activation    SwiGLU's silu(gate) * up: our one-pass Triton kernel against PyTorch's two ops, up to an 8k prefill
                chunk's routed-expert rows
  conv          KDA's short conv over a prefill chunk: the interior tiles' path against the general one, q, k and v
                stored apart against together

Times are CUDA-graph replays (triton.testing.do_bench_cudagraph), in microseconds per call; with the bytes each
variant must read, the achieved bandwidth. `--smoke` runs tiny shapes on the CPU (Triton through its interpreter)
to check the script, not to time anything.

    python benchmarks/gpu/kernels_bench.py --json-out /tmp/kernels.json            # on a GPU
    TRITON_INTERPRET=1 python benchmarks/gpu/kernels_bench.py --smoke                # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

BLOCK = (128, 128)
OLD_GRAPH_TOKENS = 4096  # the CUDA graphs' block-table width before the paged kernel


def timed(fn, device: str) -> float:
    """Microseconds per call (a CUDA graph's replay on a GPU; one call on the CPU, smoke only)."""
    if device == "cpu":
        start = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - start)
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


_SINK: dict = {}  # main's result and --json-out path: emit rewrites the file after every row


def emit(part: str, rows: list[dict], row: dict) -> None:
    """Keep a row, print it and rewrite --json-out with every row so far at once: a later row may run past the
    stage's time limit, and the rows before it are then kept whole."""
    rows.append(row)
    print(part, json.dumps(row), flush=True)
    if _SINK.get("path"):
        _SINK["result"][part] = rows
        _write_json(_SINK["result"], _SINK["path"])


def _write_json(result: dict, path: str) -> None:
    """Written beside, then renamed: a process killed mid-write leaves the previous file, never half of one."""
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def mla_decode_rows(device: str, smoke: bool) -> list[dict]:
    from deltaserve.kernels.mla.attention import torch_mla_decode
    from deltaserve.kernels.mla.triton_decode import triton_mla_decode

    H, R, DR, page = (4, 32, 16, 4) if smoke else (32, 512, 64, 16)
    cases = [(1, 40, 256), (3, 100, 256)] if smoke else [
        (1, 512, 1 << 20), (1, 4096, 1 << 20), (1, 32768, 1 << 20), (1, 131072, 1 << 20), (1, 262144, 1 << 20),
        (1, 1 << 20, 1 << 20), (64, 512, 65536), (64, 4096, 65536), (256, 512, 65536)]
    dtype = torch.float32 if smoke else torch.bfloat16
    copy = _copy_bandwidth(device)
    rows = []
    for B, ctx, model_len in cases:
        args = _decode_inputs(B, H, R, DR, page, ctx, model_len, dtype, device)
        kernel = triton_mla_decode(*args)
        row = {"batch": B, "context": ctx, "table_tokens": model_len, "copy_GBps": copy / 1e9,
               "bytes_read": B * ctx * (R + DR) * args[2].element_size()}
        row["rel_err"] = rel_err(kernel, torch_mla_decode(*args)) if B * ctx <= 1 << 18 else None
        row["triton_us"] = timed(lambda: triton_mla_decode(*args), device)
        # the launch before this change: slices of >= 32 tokens, at most 64 a sequence, 16 heads a program
        head_blocks = -(-H // 16)
        old = dict(min_split=32, max_head_block=16, num_warps=4, block_n=32,
                   splits=max(1, min(64, -(-528 // (B * head_blocks)), -(-model_len // 32))))
        row["before_us"] = timed(lambda: triton_mla_decode(*args, **old), device)
        # the same latents in a float8 cache (--kv-cache-dtype fp8): one byte a value to read
        fp8_args = (*args[:2], args[2].to(torch.float8_e4m3fn), *args[3:])
        row["fp8_cache_us"] = timed(lambda: triton_mla_decode(*fp8_args), device)
        row["fp8_cache_GBps"] = row["bytes_read"] / args[2].element_size() / row["fp8_cache_us"] / 1e3
        for name in ("triton", "before"):
            row[f"{name}_GBps"] = row["bytes_read"] / row[f"{name}_us"] / 1e3
            row[f"{name}_of_copy"] = row[f"{name}_GBps"] * 1e9 / copy
        if not smoke:
            row["sweep"] = _decode_sweep(args, device, row["bytes_read"])
            row["fp8_sweep"] = _decode_sweep(fp8_args, device, row["bytes_read"] // args[2].element_size(),
                                             FP8_DECODE_KNOBS)
        emit("mla_decode", rows, row)
    return rows


def _copy_bandwidth(device: str) -> float:
    from deltaserve.entrypoints.bench import copy_bandwidth

    return copy_bandwidth(device)


def _decode_inputs(B, H, R, DR, page, ctx, model_len, dtype, device):
    """(q_latent, q_rope, cache, block_tables, context_lens, scale) of B sequences of ctx tokens, their pages in a
    random order, the tables model_len tokens wide (a CUDA graph's)."""
    pages_per_seq = -(-ctx // page)
    cache = torch.randn(B * pages_per_seq + 1, page, R + DR, device=device).to(dtype)
    tables = torch.zeros(B, -(-model_len // page), dtype=torch.int64, device=device)
    tables[:, :pages_per_seq] = torch.randperm(B * pages_per_seq, device=device).view(B, -1) + 1
    lens = torch.full((B,), ctx, dtype=torch.int64, device=device)
    q = (torch.randn(B, H, R, device=device) * 0.05).to(dtype)
    qr = (torch.randn(B, H, DR, device=device) * 0.05).to(dtype)
    return q, qr, cache, tables, lens, 192 ** -0.5


# launch knobs around the defaults: the first eight (shortest slice / heads a program / warps / stages, 32 tokens a
# step) as timed since 08f3ee5; then more programs than num_splits' ~2 an SM, other context tokens an inner step, and
# the pipeline's depth
DECODE_KNOBS = [dict(min_split=m, max_head_block=h, num_warps=w, num_stages=st, block_n=32) for m, h, w, st in [
    (32, 16, 4, 2), (64, 16, 4, 2), (32, 32, 4, 2), (64, 32, 4, 2), (256, 32, 4, 2), (1024, 32, 4, 2), (64, 32, 4, 3),
    (64, 32, 8, 2)]] + [dict(max_head_block=32, splits=n) for n in (528, 1056)] + [
    dict(max_head_block=16, splits=528), dict(max_head_block=32, block_n=16), dict(max_head_block=32, block_n=64),
    dict(max_head_block=32, block_n=64, num_warps=8), dict(num_stages=2), dict(max_head_block=32, num_stages=3),
    dict(max_head_block=16, num_warps=4, block_n=32),  # the one-buffer pipeline before; 32 heads; a batch's 16
    dict(wide_from=1), dict(wide_from=None)]  # every head a program at every context; 16 heads at every context


# the float8 cache: a tile of block_n tokens holds half bf16's bytes, so more tokens an inner step may keep as many
# loads in flight (issue 24: it streamed 438 GB/s against bf16's 1,169 at 256k on an H100 with bf16's launch); and the
# tile read once (reread_tile off: the float8 default before, its one load not pipelined)
FP8_DECODE_KNOBS = [dict(max_head_block=h, block_n=n, num_warps=w) for h in (16, 32) for n in (32, 64, 128)
                    for w in (4, 8)] + [dict(reread_tile=False), dict(reread_tile=False, max_head_block=32)]


def _knob_name(knobs: dict) -> str:
    """"slice/heads/warps/stages" for the first eight (the key of earlier rows), else the knobs as k=v pairs."""
    if set(knobs) == {"min_split", "max_head_block", "num_warps", "num_stages", "block_n"} and knobs["block_n"] == 32:
        return "/".join(str(knobs[k]) for k in ("min_split", "max_head_block", "num_warps", "num_stages"))
    return ",".join(f"{k}={v}" for k, v in knobs.items())


def _decode_sweep(args, device: str, bytes_read: int, knob_list: list[dict] = DECODE_KNOBS) -> dict:
    """GB/s of the launch knobs (DECODE_KNOBS by default) around the defaults, keyed by _knob_name; a launch that
    fails (e.g. too much shared memory for its tile) is recorded as its error."""
    from deltaserve.kernels.mla.triton_decode import triton_mla_decode

    out = {}
    for knobs in knob_list:
        try:
            us = timed(lambda: triton_mla_decode(*args, **knobs), device)
            out[_knob_name(knobs)] = round(bytes_read / us / 1e3)
        except Exception as e:  # noqa: BLE001 -- a knob the card cannot run is a result, not the end of the sweep
            out[_knob_name(knobs)] = f"{type(e).__name__}: {str(e)[:80]}"
    return out


def mla_prefill_rows(device: str, smoke: bool) -> list[dict]:
    """Causal prefill of T tokens (the issue's figure: FLOPs 2 x (192 + 128) x H x T^2 / 2) and an 8k chunk after a
    cached prefix, through each fused backend and through the SDPA call of before (values 128 wide: the
    memory-efficient kernel), outputs checked against the first backend that ran."""
    from deltaserve.kernels.mla.attention import _sdpa_prefill, mla_prefill_fused
    from deltaserve.kernels.mla.prefill import BACKENDS, attention_lse, attention_lse_naive

    H, Dn, Dr, Dv = (2, 16, 8, 12) if smoke else (32, 128, 64, 128)
    cases = [(16, 0), (8, 40)] if smoke else [(32768, 0), (8192, 0), (8192, 131072), (16384, 245760)]
    dtype = torch.float32 if smoke else torch.bfloat16
    rows = []
    for T, start in cases:
        L = start + T
        q = torch.randn(T, H, Dn + Dr, device=device, dtype=dtype)
        k_rope = torch.randn(L, 1, Dr, device=device, dtype=dtype)  # one rope key for all heads, as MLA's
        k = torch.cat([torch.randn(L, H, Dn, device=device, dtype=dtype), k_rope.expand(L, H, Dr)], dim=-1)
        v = torch.randn(L, H, Dv, device=device, dtype=dtype)
        scale = (Dn + Dr) ** -0.5
        row = {"chunk": T, "prefix": start, "flops": 2 * T * (start + T / 2) * H * (Dn + Dr + Dv)}
        before = lambda: _sdpa_prefill(q[..., :Dn], q[..., Dn:], k[..., :Dn], k_rope[:, 0], v, scale, start)  # noqa: E731
        reference = before()
        row["before_us"] = timed(before, device)
        expand = lambda lo, hi: (k[lo:hi].clone(), v[lo:hi].clone())  # noqa: E731  (a copy, as expanding writes)
        backends = {"naive": attention_lse_naive} if smoke else {  # smoke: the fused plan with the twin's attention
            name: lambda *a, name=name, **kw: attention_lse(*a, **kw, backend=name) for name in BACKENDS}
        for name, attend in backends.items():
            fused = lambda attend=attend: mla_prefill_fused(  # noqa: E731
                q, expand, scale, start, 65536, attend=attend)
            try:
                row[f"{name}_rel_err"] = rel_err(fused(), reference)
            except RuntimeError as e:  # this build has no such kernel for these shapes
                row[f"{name}_error"] = str(e)[:100]
                continue
            row[f"{name}_us"] = timed(fused, device)
        for key in [k_ for k_ in row if k_.endswith("_us")]:
            row[key.replace("_us", "_TFLOPs")] = row["flops"] / row[key] / 1e6
        emit("mla_prefill", rows, row)
    return rows


def fp8_expert_rows(device: str, smoke: bool) -> list[dict]:
    from deltaserve.kernels.moe.experts import fused_experts
    from deltaserve.kernels.quant import quantize_fp8
    from deltaserve.kernels.quant.experts import dequantized_grouped_experts
    from deltaserve.kernels.quant.triton_grouped import fp8_grouped_experts

    E, k, D, I = (8, 2, 256, 128) if smoke else (256, 8, 2304, 1024)
    token_counts = [4, 40] if smoke else [64, 512, 1024, 2048, 8192]  # 1024: the switch, 8192 pairs
    act = torch.float32 if smoke else torch.bfloat16  # the interpreter's bfloat16 tl.dot is not to be trusted
    w13_b = (torch.randn(E, 2 * I, D, device=device) * 0.02).to(act)
    w2_b = (torch.randn(E, D, I, device=device) * 0.02).to(act)
    w13, s13 = quantize_fp8(w13_b, BLOCK)
    w2, s2 = quantize_fp8(w2_b, BLOCK)
    rows = []
    for T in token_counts:
        x = torch.randn(T, D, device=device).to(act)
        ids = torch.rand(T, E, device=device).topk(k, dim=-1).indices
        weights = torch.rand(T, k, device=device)

        def dequantized():  # what kernels.quant.experts does for prefill-sized steps
            return dequantized_grouped_experts(x, w13, s13, w2, s2, weights, ids, BLOCK)

        fp8 = fp8_grouped_experts(x, w13, s13, w2, s2, weights, ids, BLOCK)
        row = {"tokens": T, "pairs": T * k, "rel_err_dequantized": rel_err(dequantized(), fp8),
               "fp8_grouped_us": timed(lambda: fp8_grouped_experts(x, w13, s13, w2, s2, weights, ids, BLOCK), device),
               "dequantize_then_bf16_us": timed(dequantized, device),
               "bf16_weights_us": timed(lambda: fused_experts(x, w13_b, w2_b, weights, ids), device)}
        emit("fp8_experts", rows, row)
    return rows


def decode_expert_rows(device: str, smoke: bool) -> list[dict]:
    """The few-token experts with the shared expert as a ninth slot: the autotuned tiles, each candidate tile pair,
    and the path before (routed GEMVs, then the shared expert's own SwiGLU and an add)."""
    from deltaserve.kernels.moe.triton_decode import _DOWN_TILES, _GATE_UP_TILES, decode_experts

    E, k, D, I = (8, 2, 160, 72) if smoke else (256, 8, 2304, 1024)
    dtype = torch.float32 if smoke else torch.bfloat16
    w13 = (torch.randn(E + 1, 2 * I, D, device=device) * 0.02).to(dtype)  # the last one serves as the shared expert
    w2 = (torch.randn(E + 1, D, I, device=device) * 0.02).to(dtype)
    shared = (w13[E], w2[E])
    rows = []
    for T in (1, 2) if smoke else (1, 4):
        x = torch.randn(T, D, device=device).to(dtype)
        ids = torch.rand(T, E, device=device).topk(k, dim=-1).indices
        weights = torch.rand(T, k, device=device)
        weight_bytes = T * (k + 1) * 3 * D * I * w13.element_size()

        def before():
            gate, up = F.linear(x, shared[0]).chunk(2, dim=-1)
            return decode_experts(x, w13[:E], w2[:E], weights, ids) + F.linear(F.silu(gate) * up, shared[1])

        tuned = decode_experts(x, w13[:E], w2[:E], weights, ids, shared=shared)
        variants = {"autotuned": lambda: decode_experts(x, w13[:E], w2[:E], weights, ids, shared=shared),
                    "before": before}
        for tiles in zip(_GATE_UP_TILES, _DOWN_TILES):
            variants["x".join(map(str, tiles[0])) + "," + "x".join(map(str, tiles[1]))] = (
                lambda tiles=tiles: decode_experts(x, w13[:E], w2[:E], weights, ids, shared=shared, tiles=tiles))
        for name, fn in variants.items():
            us = timed(fn, device)
            emit("decode_experts", rows, {"tokens": T, "variant": name, "us": us, "rel_err": rel_err(fn(), tuned),
                                          "GBps": weight_bytes / us / 1e3})
    return rows


# (gate/up tile, down tile, warps, stages) of kernels.moe.triton_blocks around its defaults
BLOCK_KNOBS = [((64, 128), (64, 128), 4, 4), ((64, 128), (64, 128), 4, 3), ((128, 128), (128, 128), 4, 3),
               ((128, 64), (128, 64), 4, 4), ((64, 256), (64, 256), 4, 3), ((64, 128), (128, 128), 8, 4),
               ((32, 128), (32, 128), 4, 4)]


def batch_expert_rows(device: str, smoke: bool) -> list[dict]:
    """A decode batch's routed experts (8, 64 and 256 tokens, 8 of 256 experts each, chosen uniformly as balanced
    routing does): the sorted-block Triton kernels (kernels.moe.triton_blocks) at each launch of BLOCK_KNOBS against
    torch._grouped_mm (experts.grouped_experts, the path they replaced up to 2,048 pairs). GB/s of the chosen
    experts' weights."""
    from deltaserve.kernels.moe.experts import grouped_experts
    from deltaserve.kernels.moe.triton_blocks import block_experts

    E, k, D, I = (8, 2, 160, 72) if smoke else (256, 8, 2304, 1024)
    dtype = torch.float32 if smoke else torch.bfloat16
    w13 = (torch.randn(E, 2 * I, D, device=device) * 0.02).to(dtype)
    w2 = (torch.randn(E, D, I, device=device) * 0.02).to(dtype)
    rows = []
    for T in (3, 9) if smoke else (8, 64, 256):
        x = torch.randn(T, D, device=device).to(dtype)
        ids = torch.rand(T, E, device=device).topk(k, dim=-1).indices
        weights = torch.rand(T, k, device=device)
        weight_bytes = ids.unique().numel() * 3 * D * I * w13.element_size()
        reference = grouped_experts(x, w13, w2, weights, ids)
        variants = {"grouped_mm": lambda: grouped_experts(x, w13, w2, weights, ids)}
        for gate_up, down, warps, stages in BLOCK_KNOBS[:1] if smoke else BLOCK_KNOBS:
            name = f"blocks {gate_up[0]}x{gate_up[1]},{down[0]}x{down[1]}/{warps}/{stages}"
            variants[name] = (lambda g=gate_up, d=down, w=warps, st=stages:
                              block_experts(x, w13, w2, weights, ids, g, d, w, st))
        for name, fn in variants.items():
            try:
                us = timed(fn, device)
                emit("batch_experts", rows, {"tokens": T, "variant": name, "us": us, "GBps": weight_bytes / us / 1e3,
                                             "rel_err": rel_err(fn(), reference)})
            except Exception as e:  # noqa: BLE001 -- a launch the card cannot run is a result, not the end
                emit("batch_experts", rows, {"tokens": T, "variant": name, "error": f"{type(e).__name__}: {e}"[:200]})
    return rows


# expert_blocks' launches: (pairs a program, warps)
BLOCK_SORT_KNOBS = [(64, 4), (128, 4), (128, 8), (256, 8)]


def bookkeeping_rows(device: str, smoke: bool) -> list[dict]:
    """Per-step bookkeeping a batched decode step pays: the placing of a step's (token, slot) pairs into expert
    blocks (once a MoE layer; kernels.moe.triton_blocks: a Triton launch at each of BLOCK_SORT_KNOBS against its
    torch twin), and the copy of requests' KDA states into prefix-caching snapshots (kernels.cache_ops.copy_rows:
    one pass against the twin's gather, then scatter; the 48B model's recurrent state in 20 layers). GB/s of the
    copy counts its rows' bytes read and written once; `rel_err` is 0 where a variant's output equals the twin's."""
    from deltaserve.kernels.moe.triton_blocks import expert_blocks, torch_expert_blocks
    from deltaserve.kernels.triton_copy import triton_copy_rows

    rows, E, k = [], (8 if smoke else 256), (2 if smoke else 8)
    for T in (3, 9) if smoke else (8, 64, 256):
        ids = torch.rand(T, E, device=device).topk(k, dim=-1).indices
        want = torch_expert_blocks(ids, E)
        variants = {"kernel": lambda: expert_blocks(ids, E), "torch": lambda: torch_expert_blocks(ids, E)}
        variants.update({f"chunk {c}, {w} warps": (lambda c=c, w=w: expert_blocks(ids, E, chunk=c, num_warps=w))
                         for c, w in BLOCK_SORT_KNOBS})
        for variant, fn in variants.items():
            equal = all(torch.equal(got, expected) for got, expected in zip(fn(), want))
            emit("bookkeeping", rows, {"op": "expert_blocks", "tokens": T, "variant": variant, "us": timed(fn, device),
                                       "rel_err": 0.0 if equal else 1.0})
    L, S, state = (2, 6, (3, 8, 8)) if smoke else (20, 64, (32, 128, 128))
    source = torch.randn(L, S, *state, device=device)
    for pairs in (1, 4) if smoke else (1, 16):
        src, dst = torch.arange(pairs, device=device), torch.arange(pairs, device=device) + S - pairs
        row_bytes = 2 * L * pairs * source[0, 0].numel() * source.element_size()
        targets = {"kernel": torch.zeros_like(source), "torch": torch.zeros_like(source)}
        copies = {"kernel": lambda: triton_copy_rows(source, targets["kernel"], src, dst),
                  "torch": lambda: targets["torch"].__setitem__((slice(None), dst), source[:, src])}
        for variant, fn in copies.items():
            us = timed(fn, device)
            equal = torch.equal(targets[variant][:, dst], source[:, src])
            emit("bookkeeping", rows, {"op": "copy_rows", "pairs": pairs, "variant": variant, "us": us,
                                       "GBps": row_bytes / us / 1e3, "rel_err": 0.0 if equal else 1.0})
    return rows


def gemv_rows(device: str, smoke: bool) -> list[dict]:
    """The few-token dense projections: cuBLAS (F.linear, which Linear ran before), our GEMV autotuned, and each
    candidate tile, at the 48B model's projection shapes."""
    from deltaserve.kernels.gemv import GEMV_TILES, gemv

    shapes = {"small": (70, 300)} if smoke else {"o_proj": (2304, 4096), "mla in_proj": (6720, 2304),
                                                  "kda in_proj": (12576, 2304), "dense down": (2304, 9216),
                                                  "kda fg_b (one of two)": (4096, 128)}
    dtype = torch.float32 if smoke else torch.bfloat16
    rows = []
    for name, (N, K) in shapes.items():
        weight = (torch.randn(N, K, device=device) * 0.02).to(dtype)
        weight_bytes = N * K * weight.element_size()
        for T in (1, 3) if smoke else (1, 4):
            x = torch.randn(T, K, device=device).to(dtype)
            variants = {"cublas": lambda: F.linear(x, weight), "autotuned": lambda: gemv(x, weight)}
            variants.update({"x".join(map(str, tile)): (lambda tile=tile: gemv(x, weight, tile))
                             for tile in GEMV_TILES})
            expected = F.linear(x.float(), weight.float())
            for variant, fn in variants.items():
                us = timed(fn, device)
                emit("gemv", rows, {"shape": name, "tokens": T, "variant": variant, "us": us,
                                    "rel_err": rel_err(fn(), expected), "GBps": weight_bytes / us / 1e3})
    return rows


def router_rows(device: str, smoke: bool) -> list[dict]:
    """The router's logits for a few tokens: the float32 copy and cuBLAS GEMV (before), our GEMV autotuned, and
    each candidate tile."""
    from deltaserve.kernels.moe.triton_routing import _ROUTER_TILES, router_logits

    E, D = (10, 100) if smoke else (256, 2304)
    weight = torch.randn(E, D, device=device) * 0.05
    rows = []
    for T in (1, 3) if smoke else (1, 4):
        x = torch.randn(T, D, device=device).to(torch.float32 if smoke else torch.bfloat16)
        variants = {"before": lambda: F.linear(x.float(), weight), "autotuned": lambda: router_logits(x, weight)}
        variants.update({"x".join(map(str, tile)): (lambda tile=tile: router_logits(x, weight, tile))
                         for tile in _ROUTER_TILES})
        expected = F.linear(x.float(), weight)
        for variant, fn in variants.items():
            us = timed(fn, device)
            emit("router", rows, {"tokens": T, "variant": variant, "us": us, "rel_err": rel_err(fn(), expected),
                                  "GBps": E * D * 4 / us / 1e3})
    return rows


def norm_gemv_rows(device: str, smoke: bool) -> list[dict]:
    """A decoder layer's norms inside the GEMVs that read them (kernels.norm_gemv), one token, against the norm and
    the projection apart as the layers run them otherwise: the norm (kernels.triton_norm's kernel on a GPU), then
    cuBLAS (KDA's in_proj), our GEMV (MLA's in_proj, o_proj) or the router's GEMV. A graph of the two launches
    against one, so the time between them counts."""
    from deltaserve.kernels.gemv import gemv
    from deltaserve.kernels.moe.triton_routing import router_logits
    from deltaserve.kernels.norm import add_rms_norm, gated_rms_norm
    from deltaserve.kernels.norm_gemv import (
        add_norm_gemv,
        gated_norm_gemv,
        naive_add_norm_linear,
        naive_gated_norm_linear,
    )

    dtype = torch.float32 if smoke else torch.bfloat16
    D, H, Kh = (100, 3, 16) if smoke else (2304, 32, 128)
    x, residual = torch.randn(2, 1, D, device=device).to(dtype)
    norm_weight = (torch.rand(D, device=device) + 0.5).to(dtype)
    rows = []
    adds = {"kda in_proj": (70 if smoke else 12576, dtype, F.linear),
            "mla in_proj": (50 if smoke else 6720, dtype, gemv),
            "router": (10 if smoke else 256, torch.float32, router_logits)}
    for name, (N, weight_dtype, project) in adds.items():
        weight = (torch.randn(N, D, device=device) * 0.02).to(weight_dtype)
        variants = {"apart": lambda: project(add_rms_norm(x, residual, norm_weight, 1e-6)[0], weight),
                    "fused": lambda: add_norm_gemv(x, residual, norm_weight, 1e-6, weight)[0]}
        expected = naive_add_norm_linear(x, residual, norm_weight, 1e-6, weight)[0]
        for variant, fn in variants.items():
            emit("norm_gemv", rows, {"shape": name, "variant": variant, "us": timed(fn, device),
                                     "rel_err": rel_err(fn(), expected)})
    o = torch.randn(1, H, Kh, device=device).to(dtype)
    gate = torch.randn(1, H * Kh, device=device).to(dtype)
    head_weight = (torch.rand(Kh, device=device) + 0.5).to(dtype)
    weight = (torch.randn(D, H * Kh, device=device) * 0.02).to(dtype)
    variants = {"apart": lambda: gemv(gated_rms_norm(o, gate.view(o.shape), head_weight, 1e-6).view(1, -1), weight),
                "fused": lambda: gated_norm_gemv(o, gate, head_weight, 1e-6, weight)}
    expected = naive_gated_norm_linear(o, gate, head_weight, 1e-6, weight)
    for variant, fn in variants.items():
        emit("norm_gemv", rows, {"shape": "kda o_proj (gated)", "variant": variant, "us": timed(fn, device),
                                 "rel_err": rel_err(fn(), expected)})
    return rows


def norm_rows(device: str, smoke: bool) -> list[dict]:
    """The norms a step runs apart from the GEMVs: add_rms_norm over the hidden width, rms_norm over MLA's latent
    and KDA's gated norm per head, at 1 token to a prefill chunk; kernels.triton_norm's kernel against
    torch.compile of the eager function (dynamic shapes, whole graph: how the GPU ran them before) and the eager
    ops. GB/s of the bytes each must move (read and written once). Smoke: the kernel through the interpreter and
    the eager ops only."""
    from deltaserve.kernels import triton_norm
    from deltaserve.kernels.norm import add_rms_norm, gated_rms_norm, rms_norm

    dtype = torch.float32 if smoke else torch.bfloat16
    D, R, H, K = (100, 48, 3, 16) if smoke else (2304, 512, 32, 128)
    rows = []
    for T in (1, 5) if smoke else (1, 64, 256, 8192):
        x, residual = torch.randn(2, T, D, device=device).to(dtype)
        latent = torch.randn(T, R, device=device).to(dtype)
        o, gate = torch.randn(2, T, H, K, device=device).to(dtype)
        w_d, w_r, w_k = ((torch.rand(n, device=device) + 0.5).to(dtype) for n in (D, R, K))
        size = x.element_size()
        cases = {"add_rms_norm": (add_rms_norm, (x, residual, w_d, 1e-6), 4 * T * D * size),
                 "rms_norm (latent)": (rms_norm, (latent, w_r, 1e-6), 2 * T * R * size),
                 "gated_rms_norm": (gated_rms_norm, (o, gate, w_k, 1e-6), 3 * T * H * K * size)}
        for name, (norm, args, moved) in cases.items():
            kernel = getattr(triton_norm, norm.__name__)
            variants = {"triton": lambda: kernel(*args), "eager": lambda: norm.eager(*args)}
            if not smoke:
                compiled = torch.compile(norm.eager, dynamic=True, fullgraph=True)
                variants["compiled"] = lambda: compiled(*args)
            expected = norm.eager(*args)
            for variant, fn in variants.items():
                us = timed(fn, device)
                error = max(rel_err(a, b) for a, b in zip(_as_tuple(fn()), _as_tuple(expected)))
                emit("norms", rows, {"norm": name, "tokens": T, "variant": variant, "us": us, "GBps": moved / us / 1e3,
                                     "rel_err": error})
    return rows


def kda_prefill_rows(device: str, smoke: bool) -> list[dict]:
    """A prefill's KDA recurrence for B sequences of T tokens each (32 heads of 128, the 48B shape's): our recurrent
    kernel (kernels.kda.kda_recurrent_varlen: each program walks its sequence's tokens) against fla-core's chunked
    kernel, from the same states; where the first stops winning is kernels.kda.RECURRENT_PREFILL_MAX_LEN's
    measure. Smoke: the recurrent kernel through the interpreter at tiny shapes."""
    from deltaserve.kernels.kda.triton_decode import kda_recurrent_varlen
    from deltaserve.kernels.varlen import pack_seqs

    dtype = torch.float32 if smoke else torch.bfloat16
    H, K = (2, 16) if smoke else (32, 128)
    rows = []
    for B, T in ((1, 4), (2, 3)) if smoke else [(1, t) for t in (1, 8, 32, 64, 128, 256, 512)] + \
            [(16, t) for t in (8, 32, 64, 128, 256)]:
        N, cu = B * T, list(range(0, B * T + 1, T))
        qkv = torch.randn(N, 3, H, K, device=device).to(dtype)
        g_raw, b_raw = torch.randn(N, H * K, device=device).to(dtype), torch.randn(N, H, device=device).to(dtype)
        dt_bias, a_log = torch.randn(H * K, device=device) - 3, torch.rand(H, device=device).add(1).log()
        state = torch.randn(B + 1, H, K, K, device=device) * 0.1
        packed = pack_seqs(list(range(1, B + 1)), cu, torch.device(device))
        scale = K ** -0.5
        variants = {"recurrent": lambda: kda_recurrent_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], g_raw, b_raw, dt_bias,
                                                              a_log, state.clone(), packed, scale)}
        if not smoke:
            from deltaserve.kernels.kda.fla_chunk import fla_chunk_kda

            variants["fla chunk"] = lambda: fla_chunk_kda(qkv[:, 0], qkv[:, 1], qkv[:, 2], g_raw, b_raw, dt_bias,
                                                          a_log, scale, state.clone(), packed)
        expected = variants["recurrent"]()
        for variant, fn in variants.items():
            emit("kda_prefill", rows, {"sequences": B, "tokens": T, "variant": variant, "us": timed(fn, device),
                                       "rel_err": rel_err(fn(), expected)})
    return rows


def activation_rows(device: str, smoke: bool) -> list[dict]:
    """SwiGLU's activation silu(gate) * up over a projection's [T, 2I] output: kernels.activation's Triton kernel
    against PyTorch's two ops (the GPU path before it), at the routed experts' rows of an 8k prefill chunk (8,192
    tokens x 8 experts, I = 1,024), the shared expert's and the dense MLP's (I = 9,216). GB/s of the bytes the fused
    pass must move (2I read, I written a row). Smoke: the kernel through the interpreter."""
    from deltaserve.kernels.triton_activation import triton_silu_and_mul

    dtype = torch.float32 if smoke else torch.bfloat16
    rows = []
    for T, I in ((3, 40), (2, 1100)) if smoke else ((64, 1024), (8192, 1024), (65536, 1024), (8192, 9216)):
        x = torch.randn(T, 2 * I, device=device).to(dtype)
        gate, up = x.chunk(2, dim=-1)
        variants = {"triton": lambda: triton_silu_and_mul(x), "torch": lambda: F.silu(gate) * up}
        expected = F.silu(gate.float()) * up.float()
        for variant, fn in variants.items():
            us = timed(fn, device)
            emit("activation", rows, {"rows": T, "I": I, "variant": variant, "us": us,
                                      "GBps": 3 * T * I * x.element_size() / us / 1e3,
                                      "rel_err": rel_err(fn(), expected)})
    return rows


def gather_rows(device: str, smoke: bool) -> list[dict]:
    """The grouped experts' input rows: x[token] for an 8k prefill chunk's tokens x 8 experts sorted by expert
    (65,536 rows of 2,304), index_select (the path before it) against kernels.triton_copy's gather at a few
    launches (GB/s of the bytes that must cross memory: the rows written, and x read once, since each of its rows
    repeats k times and the repeats come from L2; counting every row read as memory traffic would give a figure
    above the card's bandwidth); and the sort before it on int64 keys and on sort_by_expert's narrow ones. Smoke:
    the interpreter at tiny shapes."""
    from deltaserve.kernels.moe.experts import sort_by_expert, sort_key_dtype
    from deltaserve.kernels.triton_copy import triton_gather_rows

    dtype = torch.float32 if smoke else torch.bfloat16
    (T, D, E, k) = (24, 40, 8, 2) if smoke else (8192, 2304, 256, 8)
    x = torch.randn(T, D, device=device).to(dtype)
    ids = torch.rand(T, E, device=device).topk(k, dim=-1).indices
    token = sort_by_expert(ids, E)[1]
    variants = {"index_select": lambda: x.index_select(0, token)}
    for r, c, warps in ((8, 256, 4), (4, 512, 4), (16, 256, 8), (2, 1024, 4), (1, 2048, 8), (32, 128, 4)):
        variants[f"triton {r}x{c}, {warps} warps"] = \
            lambda r=r, c=c, warps=warps: triton_gather_rows(x, token, rows=r, cols=c, num_warps=warps)
    expected = x.index_select(0, token)
    rows = []
    for variant, fn in variants.items():
        us = timed(fn, device)
        emit("gather", rows, {"rows": token.shape[0], "D": D, "variant": variant, "us": us,
                              "GBps": (token.shape[0] + T) * D * x.element_size() / us / 1e3,
                              "rel_err": rel_err(fn(), expected)})
    flat = ids.flatten()  # the sort before the gather: on int64 keys (before) and on sort_by_expert's narrow ones
    sorts = {"sort int64 keys": lambda: flat.argsort(stable=True),
             f"sort {sort_key_dtype(E)} keys": lambda: flat.to(sort_key_dtype(E)).argsort(stable=True)}
    for variant, fn in sorts.items():
        emit("gather", rows, {"rows": flat.shape[0], "variant": variant, "us": timed(fn, device),
                              "rel_err": rel_err(fn().float(), flat.argsort(stable=True).float())})
    return rows


def keys_rows(device: str, smoke: bool) -> list[dict]:
    """MLA prefill's keys [L, 32, 192] from kv_b_proj's k_nope columns and the latents' shared k_rope:
    kernels.mla.keys' Triton pass against torch.cat of the broadcast k_rope (the path before it), at an 8k chunk's
    own keys and a long prefill's block of 65,536 cached keys. GB/s of the k_nope and k_rope read and the keys
    written once. Smoke: the kernel through the interpreter."""
    from deltaserve.kernels.mla.triton_keys import triton_expand_keys

    dtype = torch.bfloat16
    H, DN, DV, R, DR = (2, 8, 8, 16, 4) if smoke else (32, 128, 128, 512, 64)
    rows = []
    for L in (3, 40) if smoke else (8192, 65536):
        kv = torch.randn(L, H, DN + DV, device=device).to(dtype)
        latents = torch.randn(L, R + DR, device=device).to(dtype)
        k_nope, k_rope = kv[..., :DN], latents[:, R:]
        variants = {"triton": lambda: triton_expand_keys(k_nope, k_rope),
                    "cat": lambda: torch.cat([k_nope, k_rope[:, None].expand(-1, H, -1)], dim=-1)}
        expected = variants["cat"]()
        for variant, fn in variants.items():
            us = timed(fn, device)
            emit("keys", rows, {"keys": L, "variant": variant, "us": us, "rel_err": rel_err(fn(), expected),
                                "GBps": L * (H * (2 * DN + DR) + DR) * kv.element_size() / us / 1e3})
    return rows


def conv_rows(device: str, smoke: bool) -> list[dict]:
    """KDA's short conv over a prefill chunk's packed sequences (12,288 channels: q, k and v of 32 heads of 128, read
    from in_proj's strided output): the kernel as the layer runs it (q, k and v stored apart; tiles past a sequence's
    first through the interior path), with every tile through the general path, with one output group, and at other
    launches (channels a program, warps). GB/s of the inputs read and outputs written once. Smoke: the interpreter
    at tiny shapes."""
    from deltaserve.kernels.conv1d_triton import conv1d_varlen
    from deltaserve.kernels.varlen import pack_seqs

    dtype = torch.float32 if smoke else torch.bfloat16
    C, W = (3 * 32, 4) if smoke else (3 * 32 * 128, 4)
    rows = []
    for lengths in ([40], [3, 33]) if smoke else ([512], [8192], [512] * 16):
        N = sum(lengths)
        cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
        x = torch.randn(N, C + 288, device=device).to(dtype)[:, :C]
        weight = torch.randn(C, W, device=device).to(dtype)
        state = torch.randn(len(lengths) + 1, C, W - 1, device=device).to(dtype)
        packed = pack_seqs(list(range(1, len(lengths) + 1)), cu, torch.device(device))
        variants = {"groups 3, interior": lambda: conv1d_varlen(x, weight, state.clone(), packed, 3),
                    "groups 3, general": lambda: conv1d_varlen(x, weight, state.clone(), packed, 3, interior=False),
                    "groups 1, interior": lambda: conv1d_varlen(x, weight, state.clone(), packed).view(N, 3, -1)}
        for block_c, warps in ((64, 2), (64, 4), (128, 2), (128, 8), (256, 4), (256, 8)):  # the launch, swept
            variants[f"groups 3, interior, {block_c} channels, {warps} warps"] = \
                lambda block_c=block_c, warps=warps: conv1d_varlen(x, weight, state.clone(), packed, 3,
                                                                   block_c=block_c, num_warps=warps)
        expected = variants["groups 3, general"]()
        for variant, fn in variants.items():
            us = timed(fn, device)
            emit("conv", rows, {"tokens": N, "sequences": len(lengths), "variant": variant, "us": us,
                                "GBps": 2 * N * C * x.element_size() / us / 1e3, "rel_err": rel_err(fn(), expected)})
    return rows


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


PARTS = {"mla_decode": mla_decode_rows, "mla_prefill": mla_prefill_rows, "fp8_experts": fp8_expert_rows,
         "decode_experts": decode_expert_rows, "batch_experts": batch_expert_rows, "gemv": gemv_rows,
         "router": router_rows, "norm_gemv": norm_gemv_rows,
         "norms": norm_rows, "kda_prefill": kda_prefill_rows, "bookkeeping": bookkeeping_rows,
         "activation": activation_rows, "conv": conv_rows, "keys": keys_rows, "gather": gather_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script only")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke")
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"}
    _SINK.update(result=result, path=args.json_out)
    with torch.inference_mode():
        for part in parts:
            result[part] = PARTS[part](device, args.smoke)
    if args.json_out:
        _write_json(result, args.json_out)


if __name__ == "__main__":
    main()
