"""The `deltaserve` command (DESIGN.md section 5). Errors: one line on stderr, exit code 2 for a bad input (a
ValueError or OSError), 1 for anything else (a tensor-parallel rank's death among them), 130 for Ctrl-C;
DELTASERVE_DEBUG=1 prints the traceback instead.

Arguments are parsed before torch or the engine is imported, so --help and a mistyped option answer at once."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from deltaserve.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS, EngineConfig, ModelConfig
from deltaserve.entrypoints.chat import add_chat_options, cmd_chat
from deltaserve.entrypoints.openai.command import add_serve_options, cmd_serve
from deltaserve.entrypoints.sampling_options import add_sampling_options, sampling_defaults
from deltaserve.parity.commands import add_parity_parser, cmd_parity, output_file
from deltaserve.sampling_params import SamplingParams

DEFAULT_PROMPT = "Once upon a time"
GENERATE_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}  # greedy, where the model folder sets nothing


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
    g.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization,
                   help="fraction of the GPU's memory for weights + cache (the cache takes what the weights leave)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.enable_prefix_caching,
                   help="reuse cached prefixes (MLA pages and exact KDA state snapshots) across requests")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="processes (one GPU each) to split the model over; gloo on the CPU, NCCL on GPUs")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size > 1: split the routed experts whole across the ranks")
    g.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    g.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                   help="fp8: linear layers and experts quantized at load to float8_e4m3fn with 128x128 block "
                        "scales (an FP8 checkpoint runs in FP8 without it)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=EngineConfig.kv_cache_dtype,
                   help="the MLA latent cache: auto (the run dtype) or fp8 (float8_e4m3fn: half of bf16's bytes, "
                        "twice the tokens in the same memory)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (per request)")
    g.add_argument("--num-decode-steps", type=int, default=EngineConfig.num_decode_steps,
                   help="decode steps run back to back, one sync a burst, while no request asks for penalties, "
                        "logprobs, stop strings or a grammar (1: one step at a time; streams then get one token a "
                        "step)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="keep one step in flight: queue the next step before reading this step's tokens, so the "
                        "host's work between steps overlaps the device's (default: on for a GPU, off on the CPU)")
    g.add_argument("--compile-decode", action="store_true",
                   help="CPU: run decode steps of up to 4 requests through torch.compile (seconds to compile per "
                        "batch size; ~1.4x faster a token on small models; not bit-exact: logits within ~1e-5)")
    g.add_argument("--cpu-gemv", action=argparse.BooleanOptionalAction, default=_env_switch("DELTASERVE_CPU_GEMV"),
                   help="CPU, float32: decode products through our AVX kernel where it builds (default: on, or "
                        "DELTASERVE_CPU_GEMV=0 off); off: PyTorch's products")
    g.add_argument("--norm-gemv", action=argparse.BooleanOptionalAction, default=_env_switch("DELTASERVE_NORM_GEMV"),
                   help="GPU, half precision: norms inside the GEMVs that read them (default: on, or "
                        "DELTASERVE_NORM_GEMV=0 off); off: apart, for an A/B")
    g.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=_env_switch("DELTASERVE_PDL"),
                   help="GPU, Hopper: programmatic dependent launch of the decode kernels (default: on, or "
                        "DELTASERVE_PDL=0 off); off: plain launches, e.g. to profile each kernel's own time")


def _env_switch(name: str) -> bool:
    """A kernel switch's default: on unless the environment sets it to 0 (read here only, never below the CLI)."""
    return os.environ.get(name, "1") != "0"


# the engine options that pass to EngineConfig as they are (dtype and device have defaults that depend on the machine)
_ENGINE_FIELDS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "gpu_memory_utilization",
                  "threads", "load_format", "enable_prefix_caching", "tensor_parallel_size", "enable_expert_parallel",
                  "quantization", "kv_cache_dtype", "num_decode_steps", "async_scheduling", "compile_decode",
                  "cpu_gemv", "norm_gemv", "pdl")


def _engine_fields(args, **overrides) -> dict:
    """EngineConfig's keywords from the engine options, with overrides over them. A server warms its prefill
    kernels up before it takes requests (EngineConfig.warmup_prefill)."""
    serving = {"warmup_prefill": True} if getattr(args, "command", None) == "serve" else {}
    return {**{name: getattr(args, name) for name in _ENGINE_FIELDS}, **serving, **overrides}


def _int_list(what: str, example: str):
    """An argparse type: comma-separated integers; its errors name `what` and show `example`."""
    def parse(text: str) -> list[int]:
        try:
            ids = [int(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. {example}") from None
        if not ids:
            raise argparse.ArgumentTypeError(f"empty {what}; expected e.g. {example}")
        return ids

    return parse


_token_ids = _int_list("token id list", "1,2,3")


def _version() -> str:
    """The installed package's version (deltaserve/__init__.py's __version__ is above the CLI in the import order)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deltaserve")
    except PackageNotFoundError:
        return "(not installed: pip install -e . in the source tree)"


class _VersionAction(argparse.Action):
    """--version: the package's metadata read only when asked (~30 ms: every command would pay it otherwise)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print deltaserve's version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"deltaserve {_version()}")
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (DESIGN.md section 5): the error and where the usage is, not the usage block
    (23 lines for generate) above it. Subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="deltaserve", description="Kimi-Linear inference engine")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts")
    _engine_options(gen)
    gen.add_argument("--prompt", action="append", default=[],
                     help=f"a text prompt (repeatable; with no prompt at all: {DEFAULT_PROMPT!r}, said on stderr)")
    gen.add_argument("--prompt-token-ids", action="append", type=_token_ids, default=[],
                     help="a prompt as comma-separated token ids (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64, help="the most tokens to generate per prompt (default 64)")
    add_sampling_options(gen, GENERATE_SAMPLING)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    bench = sub.add_parser("bench", help="measure TTFT, TPOT, throughput and the bandwidth floor")
    _engine_options(bench)
    bench.add_argument("--config", default=None, help="a config.json (with --load-format dummy) instead of --model")
    bench.set_defaults(max_num_seqs=None)  # each row runs its batch at once: max(--batch-sizes) unless given
    bench.add_argument("--batch-sizes", type=_int_list("list of batch sizes", "1,16,64"), default=[1, 16, 64],
                       help="e.g. 1,16,64")
    bench.add_argument("--prompt-len", type=int, default=512)
    bench.add_argument("--output-len", type=int, default=64)
    bench.add_argument("--long-prompt-len", type=_int_list("list of lengths", "8192,262144"), default=[],
                       help="also time one prompt of each of these lengths alone (its prefill, then decode at that "
                            "context, 64 tokens), e.g. 8192 or 8192,262144")
    bench.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _engine_options(serve)
    add_serve_options(serve)
    chat = sub.add_parser("chat", help="an interactive chat, streamed token by token (/reset, /exit)")
    _engine_options(chat)
    add_chat_options(chat)
    tiny = sub.add_parser("make-tiny", help="write a small random Kimi-Linear checkpoint")
    tiny.add_argument("out", help="the folder to write (new, or empty)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    tiny.add_argument("--layout", choices=["moonshot", "saved", "transformers"], default="moonshot",
                      help="tensor names and config.json spelling: Moonshot's published checkpoint (default), "
                           "what transformers' save_pretrained writes (saved), or transformers' in-memory names "
                           "(transformers)")
    add_parity_parser(sub)
    return parser


def _make_llm(args):
    from deltaserve.entrypoints.llm import LLM

    return LLM(args.model, dtype=args.dtype, device=args.device, **_engine_fields(args))


def _engine_arguments(args):
    """The model folder and EngineConfig that _make_llm(args) would run."""
    from deltaserve.entrypoints.llm import engine_arguments

    return engine_arguments(args.model, dtype=args.dtype, device=args.device, **_engine_fields(args))


def cmd_generate(args) -> None:
    prompts = list(args.prompt) + [{"prompt_token_ids": ids} for ids in args.prompt_token_ids]
    default_prompt = not prompts
    prompts = prompts or [DEFAULT_PROMPT]
    params = SamplingParams(max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
                            **sampling_defaults(args, GENERATE_SAMPLING))
    # the prompts are all there is to run: no more KDA slots to allocate, nor CUDA graphs to capture, than them
    args.max_num_seqs = min(args.max_num_seqs, len(prompts))
    llm = _make_llm(args)
    try:
        if llm.tokenizer is None and any(isinstance(p, str) for p in prompts):  # --prompt, or the default one
            raise ValueError(f"{args.model} has no tokenizer, so a text prompt cannot be encoded; pass the prompt as "
                             "token ids instead: --prompt-token-ids 1,2,3")
        if default_prompt:  # said once the model loaded: an error (a bad --model) is then stderr's only line
            print(f"no --prompt given: generating from {DEFAULT_PROMPT!r}", file=sys.stderr)
        if args.max_tokens >= llm.engine.max_model_len:  # the engine stops a request there (finish_reason "length")
            print(f"note: --max-tokens {args.max_tokens} is past the model's length, {llm.engine.max_model_len} tokens "
                  f"with the prompt's: each output ends there at the latest", file=sys.stderr)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
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


def cmd_bench(args) -> None:
    from deltaserve.entrypoints.bench import LONG_OUTPUT_LEN, bench, print_report
    from deltaserve.entrypoints.llm import BUNDLED_MODEL, default_device

    if args.config and args.model:
        raise ValueError("--config and --model both name the model; pass one (--config with --load-format dummy)")
    if args.config and args.load_format != "dummy":
        raise ValueError("--config FILE has no weights: add --load-format dummy (or pass --model DIR)")
    if args.json_out:
        output_file("--json-out", args.json_out)
    model = args.config or args.model or str(BUNDLED_MODEL)
    longest = _bench_longest(args, model, LONG_OUTPUT_LEN)
    if args.max_num_seqs is not None and args.max_num_seqs < max(args.batch_sizes):
        raise ValueError(f"--max-num-seqs {args.max_num_seqs} is below --batch-sizes' largest "
                         f"({max(args.batch_sizes)}), which each row runs at once; raise it or leave it out")
    device = args.device or default_device()
    engine = EngineConfig(dtype=args.dtype or ("float32" if device == "cpu" else "bfloat16"), device=device,
                          **_engine_fields(args, max_model_len=args.max_model_len or longest,
                                           max_num_seqs=args.max_num_seqs or max(args.batch_sizes)))
    result = bench(model, engine, args.batch_sizes, args.prompt_len, args.output_len, args.long_prompt_len)
    print_report(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


def _bench_longest(args, model: str, long_output: int) -> int:
    """The most tokens one of bench's requests holds (a prompt and its output; a long prompt's output is long_output
    tokens), after checking bench's flags and that it fits --max-model-len, or else the model's limit (bench sets
    max_model_len to it): each error names the flags to change."""
    def positive(flag: str, values: list[int], what: str) -> None:
        if any(n < 1 for n in values):
            each = "each must be" if len(values) > 1 else "must be"
            raise ValueError(f"{flag} {','.join(map(str, values))}: {each} a positive number of {what}")

    positive("--batch-sizes", args.batch_sizes, "concurrent requests, e.g. 1,16,64")
    positive("--prompt-len", [args.prompt_len], "tokens")
    positive("--long-prompt-len", args.long_prompt_len, "tokens, e.g. 8192,262144")
    if args.output_len < 2:
        raise ValueError(f"--output-len {args.output_len}: must be at least 2 (TPOT is the time between output tokens)")
    needs = {f"--prompt-len {args.prompt_len} + --output-len {args.output_len}": args.prompt_len + args.output_len}
    needs.update({f"--long-prompt-len {n} + {long_output} output tokens": n + long_output
                  for n in args.long_prompt_len})
    what, longest = max(needs.items(), key=lambda item: item[1])
    limit = args.max_model_len or ModelConfig.from_file(model).max_position_embeddings
    if longest > limit:
        where = f"--max-model-len {limit}" if args.max_model_len else f"the model's limit ({limit} in its config.json)"
        fix = "raise --max-model-len" if args.max_model_len else "pass a model with a longer context"
        raise ValueError(f"{what} = {longest} tokens exceeds {where}; shorten the prompt or {fix}")
    return longest


def cmd_make_tiny(args) -> None:
    from deltaserve.entrypoints.make_tiny import make_tiny

    print(f"wrote {make_tiny(args.out, args.seed, args.layout)}", file=sys.stderr)


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "make-tiny": cmd_make_tiny, "parity": cmd_parity,
            "serve": lambda args: cmd_serve(args, _make_llm, _engine_arguments),
            "chat": lambda args: cmd_chat(args, _make_llm)}


DEBUG_ENV = "DELTASERVE_DEBUG"


def _rank_error(e: Exception) -> bool:
    """e is core/tensor_parallel.py's RankError; looked up among the loaded modules (only a run that started ranks
    has it), so that an error's report never imports torch."""
    module = sys.modules.get("deltaserve.core.tensor_parallel")
    return module is not None and isinstance(e, module.RankError)


def _check_launcher(args) -> None:
    """A launcher (torchrun) that started several processes of a command without tensor parallel: each would run the
    whole job and print its output. (The Python API leaves WORLD_SIZE alone: data-parallel jobs build one LLM a
    rank.)"""
    world = os.environ.get("WORLD_SIZE", "1")
    if getattr(args, "tensor_parallel_size", None) == 1 and world.isdigit() and int(world) > 1:
        raise ValueError(f"WORLD_SIZE = {world} (torchrun started {world} processes) but --tensor-parallel-size is "
                         f"1, so each would run the whole job; pass --tensor-parallel-size {world}, or run without "
                         "torchrun")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    debug = os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    try:
        _check_launcher(args)
        status = COMMANDS[args.command](args)  # a command returns None (success) or its exit code
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if debug:
            raise
        if isinstance(e, (ValueError, OSError)):  # a bad input: the message says what to do
            print(f"error: {e}", file=sys.stderr)
            return 2
        if _rank_error(e):  # a tensor-parallel rank died: which one, and how, is all there is to say
            print(f"error: {e}", file=sys.stderr)
            return 1
        message = " ".join(str(e).split()) or "(no message)"
        print(f"error: {type(e).__name__}: {message} (an internal error; {DEBUG_ENV}=1 shows the traceback)",
              file=sys.stderr)
        return 1
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
