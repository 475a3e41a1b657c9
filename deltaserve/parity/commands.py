"""`deltaserve parity capture` and `deltaserve parity check` (DESIGN.md section 5).

Errors are ValueErrors, printed by the CLI as one line with exit code 2; `check` returns 1 when it finds a
divergence that fails the run (any with --strict, else any real one) and prints `match X/Y` last."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deltaserve.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS
from deltaserve.parity.defaults import DEFAULT_TIE_MARGINS, DEFAULT_TOPK, REFERENCES

REGIMES = ("float32", "bfloat16")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return value


def _model_options(parser: argparse.ArgumentParser, device_default: str) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the bundled demo model)")
    parser.add_argument("--dtype", choices=REGIMES, default="float32", help="numeric regime (default: float32)")
    parser.add_argument("--device", default=None, help=f"cpu or cuda (default: {device_default})")


def add_parity_parser(sub) -> None:
    parity = sub.add_parser("parity", help="token parity against a golden reference")
    commands = parity.add_subparsers(dest="parity_command", required=True)
    cap = commands.add_parser("capture", help="run a reference greedily and write a golden JSON")
    _model_options(cap, "cpu for --reference transformers; for deltaserve, cuda when present, else cpu")
    cap.add_argument("--out", required=True, help="the golden JSON to write")
    source = cap.add_mutually_exclusive_group()
    source.add_argument("--prompts", help="file: one prompt a line, text or a JSON list of token ids")
    source.add_argument("--num-prompts", type=_positive_int, help="seeded random prompts (default 8; used "
                                                                  "when the model has no tokenizer)")
    cap.add_argument("--prompt-len", type=_positive_int, default=32, help="tokens per random prompt")
    cap.add_argument("--max-tokens", type=_positive_int, default=32, help="greedy tokens per prompt")
    cap.add_argument("--reference", choices=REFERENCES, default="transformers")
    cap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    cap.add_argument("--topk", type=_positive_int, default=DEFAULT_TOPK,
                     help=f"reference log-probabilities stored per token for the KL (default {DEFAULT_TOPK})")
    chk = commands.add_parser("check", help="compare deltaserve with a golden JSON")
    _model_options(chk, "cuda when present, else cpu")
    chk.add_argument("--golden", required=True, help="a golden JSON written by `parity capture`")
    chk.add_argument("--strict", action="store_true", help="fail on any divergence, near-ties included")
    defaults = ", ".join(f"{k} {v:g}" for k, v in DEFAULT_TIE_MARGINS.items())
    chk.add_argument("--tie-margin", type=float, default=None,
                     help=f"golden logit gaps under this are near-ties (default per --dtype: {defaults}; measured, "
                          "see BENCHMARKS.md)")
    chk.add_argument("--plot", help="write a PNG of the golden's margins with the divergences marked")
    chk.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                     help="check deltaserve with FP8 weights (quantized at load) against the golden")
    chk.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                     help="check deltaserve with this MLA latent cache (fp8: float8_e4m3fn) against the golden")


def cmd_parity(args) -> int:
    return {"capture": cmd_capture, "check": cmd_check}[args.parity_command](args)


def cmd_capture(args) -> int:
    from deltaserve.parity.capture import capture
    from deltaserve.parity.golden import save_golden

    out_dir = Path(args.out).resolve().parent
    if not out_dir.is_dir():  # before the capture, which may take minutes
        raise ValueError(f"--out {args.out}: the folder {out_dir} does not exist; create it, or write elsewhere")
    model_dir, cfg = _model(args.model)
    prompts = _prompts(args, model_dir, cfg.vocab_size)
    golden = capture(model_dir, prompts, args.max_tokens, args.reference, args.dtype, args.device, cfg.vocab_size,
                     args.topk, args.seed)
    save_golden(golden, args.out)
    print(f"wrote {args.out}: {args.reference} {args.dtype} greedy, {len(prompts)} prompts x {args.max_tokens} "
          "tokens", file=sys.stderr)
    return 0


def cmd_check(args) -> int:
    from deltaserve.parity.backends import DeltaserveBackend
    from deltaserve.parity.check import check
    from deltaserve.parity.golden import check_vocab, load_golden
    from deltaserve.parity.report import report_lines

    tie_margin = DEFAULT_TIE_MARGINS[args.dtype] if args.tie_margin is None else args.tie_margin
    if not tie_margin >= 0:
        raise ValueError(f"--tie-margin {args.tie_margin}: must be a number >= 0")
    if args.plot:
        from deltaserve.parity.plot import require_matplotlib

        require_matplotlib()
    golden = load_golden(args.golden)
    model_dir, cfg = _model(args.model)
    check_vocab(golden, cfg.vocab_size, args.golden, model_dir)
    max_model_len = max(len(p.prompt_token_ids) + len(p.output_token_ids) for p in golden.prompts)
    backend = DeltaserveBackend(model_dir, args.dtype, args.device, max_model_len, len(golden.prompts),
                                args.quantization, args.kv_cache_dtype)
    result = check(golden, backend, tie_margin)
    device = next(backend.model.parameters()).device
    extras = [name for name, on in (("fp8 weights", backend.llm.engine.model_config.quantization),
                                    ("a float8 latent cache", args.kv_cache_dtype == "fp8")) if on]
    weights = f" with {' and '.join(extras)}" if extras else ""
    for line in report_lines(golden, result, f"deltaserve {args.dtype}{weights} on {device}"):
        print(line, flush=True)
    if args.plot:
        from deltaserve.parity.plot import plot_margins

        plot_margins(golden, result, args.plot)
    return result.exit_status(args.strict)


def _model(model: str | None):
    from deltaserve.config import ModelConfig
    from deltaserve.entrypoints.llm import BUNDLED_MODEL

    model_dir = str(model or BUNDLED_MODEL)
    return model_dir, ModelConfig.from_file(model_dir)


def _prompts(args, model_dir: str, vocab_size: int) -> list[list[int]]:
    from deltaserve.parity.prompts import random_prompts, read_prompts_file, text_prompts
    from deltaserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if args.prompts:
        return read_prompts_file(args.prompts, tokenizer, vocab_size)
    if args.num_prompts or tokenizer is None:
        return random_prompts(args.num_prompts or 8, args.prompt_len, vocab_size, args.seed)
    return text_prompts(tokenizer)
