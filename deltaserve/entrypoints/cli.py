"""The `deltaserve` command (DESIGN.md section 5). Errors: one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from deltaserve.sampling_params import SamplingParams


def _engine_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="model folder (default: the bundled demo model)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present, else cpu)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    g.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (per request)")


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,2,3") from None
    if not ids:
        raise argparse.ArgumentTypeError("empty token id list; expected e.g. 1,2,3")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltaserve", description="Kimi-Linear inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts")
    _engine_options(gen)
    gen.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    gen.add_argument("--prompt-token-ids", action="append", type=_token_ids, default=[],
                     help="a prompt as comma-separated token ids (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    tiny = sub.add_parser("make-tiny", help="write a small random Kimi-Linear checkpoint")
    tiny.add_argument("out")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layout", choices=["moonshot", "saved", "transformers"], default="moonshot")
    return parser


def _make_llm(args):
    from deltaserve.entrypoints.llm import LLM

    return LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               block_size=args.block_size, threads=args.threads, load_format=args.load_format)


def cmd_generate(args) -> None:
    prompts = list(args.prompt) + [{"prompt_token_ids": ids} for ids in args.prompt_token_ids]
    if not prompts:
        prompts = ["Once upon a time"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    llm = _make_llm(args)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for out in outputs:
        completion = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "output_token_ids": completion.token_ids,
                              "text": completion.text, "finish_reason": completion.finish_reason},
                             ensure_ascii=False), flush=True)
        else:
            print(completion.text, flush=True)
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{len(outputs)} prompt(s), {num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tok/s)",
          file=sys.stderr)


def cmd_make_tiny(args) -> None:
    from deltaserve.entrypoints.make_tiny import make_tiny

    print(f"wrote {make_tiny(args.out, args.seed, args.layout)}", file=sys.stderr)


COMMANDS = {"generate": cmd_generate, "make-tiny": cmd_make_tiny}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        COMMANDS[args.command](args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
