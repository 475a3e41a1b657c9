"""The numeric regimes' logit error against the float32 reference, and the tie margins it justifies.

    python benchmarks/parity_tie_margin.py [--model DIR]... [--num-prompts 8 --prompt-len 32 --max-tokens 32]

Without --model: three small random models (`make-tiny`, seeds 0-2), their weights rounded to bfloat16 as a
published checkpoint's are, so that the comparison measures each regime's arithmetic and not a change of
weights. Per model: a float32 golden from transformers (what `parity capture` records); then deltaserve in
float32 and in bfloat16, at every generated position of the golden's sequences, on both of the engine's paths
(one prefill pass over prompt + continuation; prefill + one decode step a token), against the reference's
float32 logits; for comparison, transformers itself in bfloat16. The per-position error is the largest
|logit error| over the vocabulary; `margin` is the decode path's error of the golden's top-2 margin. Prints the
distributions per model and pooled, each regime's tie margin (3 x its pooled p99), `parity check`'s figures at
that margin, and one JSON line with machine, date and commit."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

KEEP_FLOAT32 = ("A_log", "dt_bias", "e_score_correction_bias", "gate.weight")  # f32 in both regimes
MARGIN_FACTOR = 3
REGIMES = ("float32", "bfloat16")
REFERENCE_BF16 = "transformers bfloat16"  # for comparison: the reference itself in bfloat16, prefill only


def random_models(root: Path, seeds=(0, 1, 2)) -> list[Path]:
    from safetensors.torch import load_file, save_file

    from deltaserve.entrypoints.make_tiny import make_tiny

    folders = []
    for seed in seeds:
        folder = make_tiny(root / f"tiny-seed{seed}", seed)
        path = folder / "model.safetensors"
        tensors = {name: t if name.endswith(KEEP_FLOAT32) else t.to(torch.bfloat16).float()
                   for name, t in load_file(str(path)).items()}
        save_file(tensors, str(path), metadata={"format": "pt"})
        folders.append(folder)
    return folders


def measure(model_dir: Path, args) -> dict:
    """One model: its float32 golden, and deltaserve's per-position errors in both regimes on both paths."""
    from deltaserve.config import ModelConfig
    from deltaserve.parity.backends import DeltaserveBackend, TransformersBackend
    from deltaserve.parity.capture import capture_prompts
    from deltaserve.parity.golden import Golden
    from deltaserve.parity.prompts import random_prompts

    cfg = ModelConfig.from_file(model_dir)
    prompts = random_prompts(args.num_prompts, args.prompt_len, cfg.vocab_size, args.seed)
    reference = TransformersBackend(str(model_dir), "float32", args.device)
    golden = Golden(str(model_dir), "transformers", "float32", vocab_size=cfg.vocab_size,
                    prompts=capture_prompts(reference, prompts, args.max_tokens, topk=cfg.vocab_size))
    refs = [reference.teacher_forced(p.prompt_token_ids, p.output_token_ids).cpu() for p in golden.prompts]
    run = {"model": model_dir.name, "golden": golden}
    for regime in REGIMES:
        run[regime] = DeltaserveBackend(str(model_dir), regime, args.device, args.prompt_len + args.max_tokens,
                                        args.num_prompts)
        run |= {(regime, path): errs for path, errs in _errors(run[regime], golden, refs).items()}
    reference_bf16 = TransformersBackend(str(model_dir), "bfloat16", args.device)  # the reference's own rounding
    run[(REFERENCE_BF16, "prefill")] = torch.cat([
        (reference_bf16.teacher_forced(p.prompt_token_ids, p.output_token_ids).cpu() - ref).abs().amax(-1)
        for p, ref in zip(golden.prompts, refs)]).double()
    return run


def _errors(ours, golden, refs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per generated position: max |logit error| on the prefill and the decode path, and the decode path's error
    of the golden's top-2 margin."""
    from deltaserve.parity.sequence import decode_logits

    errors = {"prefill": [], "decode": [], "margin": []}
    for gp, ref in zip(golden.prompts, refs):
        prefill = ours.teacher_forced(gp.prompt_token_ids, gp.output_token_ids).cpu()  # [M, V]
        decode = decode_logits(ours.model, gp.prompt_token_ids, gp.output_token_ids).cpu()
        errors["prefill"].append((prefill - ref).abs().amax(-1))
        errors["decode"].append((decode - ref).abs().amax(-1))
        top = torch.tensor([[a, b] for a, b, _ in gp.top2])
        gap = lambda logits: logits.gather(1, top[:, :1]) - logits.gather(1, top[:, 1:])  # noqa: E731
        errors["margin"].append((gap(decode) - gap(ref)).abs()[:, 0])
    return {k: torch.cat(v).double() for k, v in errors.items()}


def quantiles(x: torch.Tensor) -> dict[str, float]:
    q = torch.tensor([0.5, 0.9, 0.99], dtype=x.dtype)
    return dict(zip(("p50", "p90", "p99"), x.quantile(q).tolist())) | {"max": x.max().item(), "n": x.numel()}


def check_at(run: dict, regime: str, tie_margin: float) -> dict:
    from deltaserve.parity.check import check

    result = check(run["golden"], run[regime], tie_margin)
    total = run["golden"].num_tokens
    kls = [k for p in result.prompts for k in p.kl]
    return {"model": run["model"], "regime": regime, "tf_top1": sum(p.tf_agree for p in result.prompts) / total,
            "kl_mean": sum(kls) / len(kls), "kl_max": max(kls),
            "match": f"{sum(p.match for p in result.prompts)}/{total}",
            "divergences": len(result.divergences), "real": result.num_real}


def error_rows(runs: list[dict]) -> list[dict]:
    rows = []
    for regime, paths in [(r, ("prefill", "decode", "margin")) for r in REGIMES] + [(REFERENCE_BF16, ("prefill",))]:
        for name, pick in [(r["model"], [r]) for r in runs] + [("all", runs)]:
            for path in paths:
                rows.append({"regime": regime, "model": name, "error": path,
                             **quantiles(torch.cat([r[(regime, path)] for r in pick]))})
    return rows


def print_tables(rows: list[dict], margins: dict[str, float], checks: list[dict]) -> None:
    print("| regime | model | error | positions | p50 | p90 | p99 | max |\n|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['regime']} | {r['model']} | {r['error']} | {r['n']} | {r['p50']:.3g} | {r['p90']:.3g} | "
              f"{r['p99']:.3g} | {r['max']:.3g} |")
    print("\n| regime | tie margin (3 x pooled p99, prefill + decode) |\n|---|---:|")
    for regime, margin in margins.items():
        print(f"| {regime} | {margin:g} |")
    print("\n| regime | model | teacher-forced top-1 | KL mean | KL max | match | divergences | real |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for c in checks:
        print(f"| {c['regime']} | {c['model']} | {100 * c['tf_top1']:.1f}% | {c['kl_mean']:.2e} | {c['kl_max']:.2e} "
              f"| {c['match']} | {c['divergences']} | {c['real']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=[], help="a model folder (repeatable)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folders = [Path(m) for m in args.model] or random_models(Path(tmp))
        report([measure(folder, args) for folder in folders], args)


def report(runs: list[dict], args) -> None:
    rows = error_rows(runs)
    margins = {}
    for regime in REGIMES:
        pooled = torch.cat([r[(regime, path)] for r in runs for path in ("prefill", "decode")])
        margins[regime] = float(f"{MARGIN_FACTOR * quantiles(pooled)['p99']:.2g}")
    checks = [check_at(r, regime, margins[regime]) for regime in REGIMES for r in runs]
    print_tables(rows, margins, checks)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"benchmark": "parity_tie_margin", "cpu": platform.processor() or platform.machine(),
                      "cores": os.cpu_count(), "torch": torch.__version__, "device": args.device,
                      "date": datetime.date.today().isoformat(), "commit": commit, "tie_margins": margins,
                      "rows": rows, "checks": checks}))


if __name__ == "__main__":
    main()
