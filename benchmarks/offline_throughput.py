"""Offline throughput: deltaserve against transformers' generate on the same random model, in the same run.

    python benchmarks/offline_throughput.py --preset medium --prompt-len 128 --output-len 32 --concurrency 32

Measures, float32 on the CPU: prefill tokens/s of one prompt, batch-1 time per output token, and output
tokens/s with `concurrency` requests together (transformers: the same requests one at a time). The prefill and
batch-1 runs are each the median of `--repeats` runs (single runs of this machine class spread by up to 2x);
the concurrent run, long enough to average itself, runs once. `--compile-decode` adds a row for deltaserve with
its decode steps compiled (EngineConfig.compile_decode), `--mkl-products` one with PyTorch's float32 products in
place of kernels.cpu_gemv (cpu_gemv=False). Prints a table and one JSON line with the machine, the date
and the commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

PRESETS = {  # ~10M and ~0.5B parameters, the model classes of the llama.cpp figures
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, kv_lora_rank=128, qk_nope_head_dim=64,
                  qk_rope_head_dim=32, v_head_dim=64, num_local_experts=8, num_experts_per_tok=2,
                  linear_num_heads=4, linear_head_dim=64,
                  layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"]),
    "medium": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
                   num_hidden_layers=8, num_attention_heads=8, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, num_local_experts=32, num_experts_per_tok=4,
                   linear_num_heads=8, linear_head_dim=128,
                   layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                   + ["full_attention"]),
}


def make_model(preset: str) -> Path:
    """A random transformers Kimi-Linear model of the preset, saved once under ~/.cache/deltaserve-bench."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    folder = Path.home() / ".cache" / "deltaserve-bench" / preset
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    cfg = KimiLinearConfig(**PRESETS[preset], n_group=1, topk_group=1, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0, max_position_embeddings=4096,
                           mlp_layer_types=["dense"] + ["sparse"] * (PRESETS[preset]["num_hidden_layers"] - 1))
    model = KimiLinearForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.1)  # routers far from ties
    model.save_pretrained(folder)
    return folder


def prompts(num: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(num)]


def bench_deltaserve(folder: Path, batch: list[list[int]], output_len: int, concurrency: int, repeats: int,
                     compile_decode: bool = False, cpu_gemv: bool = True) -> dict:
    from deltaserve import LLM, SamplingParams

    llm = LLM(folder, device="cpu", max_model_len=4096, max_num_seqs=max(concurrency, 1),
              max_num_batched_tokens=max(2048, len(batch[0])), compile_decode=compile_decode,
              cpu_gemv=cpu_gemv)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    # warm-up, a whole batch-1 run: with compile_decode its decode steps' graphs compile here, not in a timed run
    llm.generate([{"prompt_token_ids": batch[0]}], greedy(output_len + 1), use_tqdm=False)
    prefill = _timed(lambda: llm.generate([{"prompt_token_ids": batch[0]}], greedy(1), use_tqdm=False), repeats)
    full = _timed(lambda: llm.generate([{"prompt_token_ids": batch[0]}], greedy(output_len + 1), use_tqdm=False),
                  repeats)
    requests = [{"prompt_token_ids": p} for p in batch[:concurrency]]
    many = _timed(lambda: llm.generate(requests, greedy(output_len), use_tqdm=False))
    return _figures(len(batch[0]), output_len, prefill, full, concurrency * output_len / many)


def bench_transformers(folder: Path, batch: list[list[int]], output_len: int, concurrency: int,
                       repeats: int) -> dict:
    from transformers import KimiLinearForCausalLM

    model = KimiLinearForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def run(ids, n):
        with torch.inference_mode():
            return model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)

    run(batch[0], 2)
    prefill = _timed(lambda: run(batch[0], 1), repeats)
    full = _timed(lambda: run(batch[0], output_len + 1), repeats)
    many = _timed(lambda: [run(p, output_len) for p in batch[:concurrency]])
    return _figures(len(batch[0]), output_len, prefill, full, concurrency * output_len / many)


def _timed(fn, repeats: int = 1) -> float:
    """The median wall time of `repeats` calls of fn."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _figures(prompt_len, output_len, prefill_s, full_s, concurrent_tok_s) -> dict:
    tpot = (full_s - prefill_s) / output_len
    return {"prefill_tok_s": prompt_len / prefill_s, "tpot_ms": 1000 * tpot, "decode_tok_s": 1 / tpot,
            "concurrent_tok_s": concurrent_tok_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--compile-decode", action="store_true",
                        help="also run deltaserve with compile_decode (decode steps through torch.compile)")
    parser.add_argument("--mkl-products", action="store_true",
                        help="also run deltaserve with cpu_gemv=False (PyTorch's float32 products, not ours)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of the prefill and batch-1 figures (median)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = make_model(args.preset)
    batch = prompts(max(args.concurrency, 1), args.prompt_len, PRESETS[args.preset]["vocab_size"])
    results = {"deltaserve": bench_deltaserve(folder, batch, args.output_len, args.concurrency, args.repeats)}
    if args.mkl_products:
        results["ds-mkl"] = bench_deltaserve(folder, batch, args.output_len, args.concurrency, args.repeats,
                                             cpu_gemv=False)
    if args.compile_decode:
        results["ds-compiled"] = bench_deltaserve(folder, batch, args.output_len, args.concurrency, args.repeats,
                                                  compile_decode=True)
    if not args.skip_transformers:
        results["transformers"] = bench_transformers(folder, batch, args.output_len, args.concurrency, args.repeats)
    _report(args, results)


def _report(args, results: dict) -> None:
    keys = ("prefill_tok_s", "tpot_ms", "decode_tok_s", "concurrent_tok_s")
    print(f"{'engine':<14}" + "".join(f"{k:>18}" for k in keys))
    for engine, figures in results.items():
        print(f"{engine:<14}" + "".join(f"{figures[k]:>18.2f}" for k in keys))
    for engine in ("deltaserve", "ds-mkl", "ds-compiled"):
        if "transformers" in results and engine in results:
            ratio = {k: results[engine][k] / results["transformers"][k] for k in keys}
            ratio["tpot_ms"] = 1 / ratio["tpot_ms"]
            label = "ratio" if engine == "deltaserve" else f"ratio {engine[3:]}"
            print(f"{label:<14}" + "".join(f"{ratio[k]:>17.2f}x" for k in keys))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"preset": args.preset, "prompt_len": args.prompt_len, "output_len": args.output_len,
                      "concurrency": args.concurrency, "repeats": args.repeats, "threads": torch.get_num_threads(),
                      "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                      "date": datetime.date.today().isoformat(), "commit": commit, "results": results}))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
