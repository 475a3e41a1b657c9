"""Baseline on the same card: transformers' KimiLinearForCausalLM (with fla-core's kernels when installed) at the
real 48B layer shapes but fewer layers, bf16, random weights. Prints TPOT at batch 1 and prefill tokens/s.

    python benchmarks/gpu/transformers_baseline.py --config benchmarks/configs/kimi-linear-48b-a3b.json --layers 4
"""

import argparse
import json
import time

import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM


def timed(fn, repeat=3):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    raw = json.load(open(args.config))
    raw["num_hidden_layers"] = args.layers
    lin = raw["linear_attn_config"]
    lin["full_attn_layers"] = [i for i in lin["full_attn_layers"] if i <= args.layers] or [args.layers]
    lin["kda_layers"] = [i for i in range(1, args.layers + 1) if i not in lin["full_attn_layers"]]
    cfg = KimiLinearConfig(**raw)
    with torch.device("meta"):
        model = KimiLinearForCausalLM(cfg)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), device="cuda")

    def gen(n):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    prefill = timed(lambda: gen(1), repeat=2)
    full = timed(lambda: gen(args.output_len + 1), repeat=2)
    tpot = (full - prefill) / args.output_len
    print(json.dumps({"engine": "transformers", "layers": args.layers, "prompt_len": args.prompt_len,
                      "prefill_tok_s": args.prompt_len / prefill, "tpot_ms": 1000 * tpot}))


if __name__ == "__main__":
    main()
