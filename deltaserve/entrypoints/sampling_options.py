"""The sampling options of `generate` and `chat` (--temperature, --top-p, --top-k) and how their defaults resolve:
a flag given on the command line, else the model folder's generation_config.json (as vLLM reads it), else the
command's own fallback."""

from __future__ import annotations

import argparse

_NAMES = ("temperature", "top_p", "top_k")


def add_sampling_options(parser: argparse.ArgumentParser, fallback: dict) -> None:
    """fallback: the command's temperature, top_p and top_k where the model folder's generation_config.json has
    none (shown in --help)."""
    g = parser.add_argument_group("sampling")
    where = "default: the model folder's generation_config.json, else"
    g.add_argument("--temperature", type=float, default=None, help=f"0 = greedy ({where} {fallback['temperature']:g})")
    g.add_argument("--top-p", type=float, default=None,
                   help=f"sample from the likeliest tokens that together reach this probability; 1 = off "
                        f"({where} {fallback['top_p']:g})")
    g.add_argument("--top-k", type=int, default=None,
                   help=f"sample from the k likeliest tokens; 0 = off ({where} {fallback['top_k']})")

def sampling_defaults(args: argparse.Namespace, fallback: dict) -> dict:
    """SamplingParams keywords: the flags given, over the model folder's generation_config.json, over fallback."""
    from deltaserve.entrypoints.llm import BUNDLED_MODEL
    from deltaserve.sampling_params import generation_defaults

    given = {name: getattr(args, name) for name in _NAMES if getattr(args, name) is not None}
    return {**fallback, **generation_defaults(args.model or BUNDLED_MODEL), **given}
