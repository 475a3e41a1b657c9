"""`deltaserve parity capture` and `deltaserve parity check` (DESIGN.md section 5).

Errors are ValueErrors, printed by the CLI as one line with exit code 2, raised before any model runs (paths and
lengths are checked up front); `check` returns 1 when the run fails (a real divergence, any with --strict, or
teacher-forced agreement under its floor or KL over its ceiling), says why, and prints `match X/Y` last."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from deltaserve.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS
from deltaserve.parity.defaults import DEFAULT_MAX_KL, DEFAULT_MIN_TOP1, DEFAULT_TIE_MARGINS, DEFAULT_TOPK, REFERENCES

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
                     help=f"golden logit gaps under this are near-ties (default: the coarser of the golden's and this "
                          f"run's regime, fp8 with --quantization or --kv-cache-dtype fp8: {defaults}; measured, "
                          "see BENCHMARKS.md)")
    chk.add_argument("--min-top1", type=float, default=DEFAULT_MIN_TOP1,
                     help=f"fail under this teacher-forced top-1 agreement, a fraction (default {DEFAULT_MIN_TOP1})")
    chk.add_argument("--max-kl", type=float, default=DEFAULT_MAX_KL,
                     help=f"fail over this mean KL(golden || ours) (default {DEFAULT_MAX_KL})")
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

    output_file("--out", args.out)  # before the capture, which may take minutes
    if args.prompts:
        _input_file("--prompts", args.prompts, "a file with one prompt per line")
    model_dir, cfg = _model(args.model)
    prompts, source = _prompts(args, model_dir, cfg.vocab_size)
    _check_length(max(len(p) for p in prompts), source, args.max_tokens, cfg.max_position_embeddings, model_dir)
    golden = capture(model_dir, prompts, args.max_tokens, args.reference, args.dtype, args.device, cfg.vocab_size,
                     args.topk, args.seed)
    save_golden(golden, args.out)
    print(f"wrote {args.out}: {args.reference} {args.dtype} greedy, {len(prompts)} prompts x {args.max_tokens} "
          "tokens", file=sys.stderr)
    return 0


def cmd_check(args) -> int:
    from deltaserve.parity.backends import DeltaserveBackend
    from deltaserve.parity.check import check
    from deltaserve.parity.report import report_lines

    _check_thresholds(args)
    if args.plot:
        from deltaserve.parity.plot import require_matplotlib

        require_matplotlib()
        output_file("--plot", args.plot)
    golden, model_dir, max_model_len = _golden_for(args)
    tie_margin, margin_from = _tie_margin(args, golden)
    backend = DeltaserveBackend(model_dir, args.dtype, args.device, max_model_len, len(golden.prompts),
                                args.quantization, args.kv_cache_dtype)
    result = check(golden, backend, tie_margin, args.min_top1, args.max_kl, margin_from)
    device = next(backend.model.parameters()).device
    extras = [name for name, on in (("fp8 weights", backend.llm.engine.model_config.quantization),
                                    ("a float8 latent cache", args.kv_cache_dtype == "fp8")) if on]
    weights = f" with {' and '.join(extras)}" if extras else ""
    for line in report_lines(golden, result, f"deltaserve {args.dtype}{weights} on {device}", args.strict):
        print(line, flush=True)
    if args.plot:
        from deltaserve.parity.plot import plot_margins

        plot_margins(golden, result, args.plot)
    return result.exit_status(args.strict)


def _check_thresholds(args) -> None:
    if args.tie_margin is not None and not args.tie_margin >= 0:
        raise ValueError(f"--tie-margin {args.tie_margin}: must be a number >= 0")
    if not 0 <= args.min_top1 <= 1:
        raise ValueError(f"--min-top1 {args.min_top1}: must be a fraction in [0, 1]")
    if not args.max_kl >= 0:
        raise ValueError(f"--max-kl {args.max_kl}: must be a number >= 0")


def _golden_for(args):
    """(golden, model folder, the golden's longest sequence), the golden checked against the model: vocabulary and
    length are errors, another model folder a warning."""
    from deltaserve.parity.golden import GoldenError, check_vocab, load_golden

    _input_file("--golden", args.golden, "the golden JSON that `parity capture --out` wrote")
    golden = load_golden(args.golden)
    model_dir, cfg = _model(args.model)
    check_vocab(golden, cfg.vocab_size, args.golden, model_dir)
    longest = max(len(p.prompt_token_ids) + len(p.output_token_ids) for p in golden.prompts)
    if longest > cfg.max_position_embeddings:
        raise GoldenError(f"golden file {args.golden} holds a sequence of {longest} tokens, over the max length "
                          f"{cfg.max_position_embeddings} of model {model_dir}: capture with shorter prompts or "
                          "--max-tokens")
    if Path(golden.model).resolve() != Path(model_dir).resolve():
        print(f"warning: golden file {args.golden} was captured from model {golden.model}; checking model "
              f"{model_dir}", file=sys.stderr)
    return golden, model_dir, longest


def _tie_margin(args, golden) -> tuple[float, str]:
    """--tie-margin, else the default of the coarser of the golden's regime and this run's -> (margin, its source)."""
    if args.tie_margin is not None:
        return args.tie_margin, "--tie-margin"
    regimes = list(DEFAULT_TIE_MARGINS)
    if golden.dtype not in regimes:
        raise ValueError(f"golden file {args.golden}: dtype {golden.dtype!r} has no default tie margin (known: "
                         f"{', '.join(regimes)}); pass --tie-margin")
    run = "fp8" if "fp8" in (args.quantization, args.kv_cache_dtype) else args.dtype
    regime = max(golden.dtype, run, key=regimes.index)
    if golden.dtype == run:
        return DEFAULT_TIE_MARGINS[regime], f"the {regime} default: the golden's and this run's regime"
    return DEFAULT_TIE_MARGINS[regime], (f"the {regime} default: the coarser of the golden's {golden.dtype} and "
                                         f"this run's {run}")


def output_file(flag: str, path: str) -> None:
    """A file the command will write: not a folder, in a folder that exists and is writable."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path}: a folder; name a file in it to write")
    folder = target.resolve().parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist; create it, or write elsewhere")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable; write elsewhere")


def _input_file(flag: str, path: str, what: str) -> None:
    """A file the command reads: a folder is named as such (the readers say when it does not exist)."""
    if Path(path).is_dir():
        raise ValueError(f"{flag} {path}: a folder; pass {what}")


def _check_length(longest: int, source: str, max_tokens: int, max_len: int, model_dir: str) -> None:
    if longest + max_tokens > max_len:
        raise ValueError(f"{source} ({longest} tokens) + --max-tokens {max_tokens} = {longest + max_tokens} tokens, "
                         f"over the max length {max_len} of model {model_dir} (config.json): shorten the prompts "
                         "or lower --max-tokens")


def _model(model: str | None):
    from deltaserve.config import ModelConfig
    from deltaserve.entrypoints.llm import BUNDLED_MODEL

    model_dir = str(model or BUNDLED_MODEL)
    return model_dir, ModelConfig.from_file(model_dir)


def _prompts(args, model_dir: str, vocab_size: int) -> tuple[list[list[int]], str]:
    """-> the prompts and where they came from, for messages."""
    from deltaserve.parity.prompts import random_prompts, read_prompts_file, text_prompts
    from deltaserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if args.prompts:
        return read_prompts_file(args.prompts, tokenizer, vocab_size), "the longest prompt in --prompts"
    if args.num_prompts or tokenizer is None:
        return random_prompts(args.num_prompts or 8, args.prompt_len, vocab_size, args.seed), "--prompt-len"
    return text_prompts(tokenizer), "the longest built-in prompt"
