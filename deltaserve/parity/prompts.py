"""The prompts a golden is captured on: seeded random token ids, a prompts file, or a few built-in texts."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXT_PROMPTS = (
    "The river ran slowly past the old mill, and",
    "A language model reads text as a sequence of",
    "def add(a, b):\n    return",
    "Weather report: on Monday, 18 degrees and",
    "Questions and answers. What is a token?",
    "In the workshop, the clock on the wall said",
    "Small errors grow when you",
    "Once upon a time",
)


def random_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """num_prompts lists of prompt_len ids drawn uniformly from [0, vocab_size), reproducible from seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_prompts, prompt_len), generator=gen).tolist()


def read_prompts_file(path: str | Path, tokenizer, vocab_size: int) -> list[list[int]]:
    """One prompt a line: a JSON list of token ids, or text (encoded with the model's tokenizer); blank lines
    are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file {path} does not exist: pass a file with one prompt per line")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            prompts.append(_parse_line(line, f"{path}:{number}", tokenizer, vocab_size))
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompt: write one prompt per line")
    return prompts


def text_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens=True) for text in TEXT_PROMPTS]


def _parse_line(line: str, where: str, tokenizer, vocab_size: int) -> list[int]:
    if line.lstrip().startswith("["):
        try:
            ids = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not a JSON list of token ids ({e})") from None
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and 0 <= t < vocab_size for t in ids)):
            raise ValueError(f"{where}: expected a non-empty JSON list of token ids in [0, {vocab_size})")
        return ids
    if tokenizer is None:
        raise ValueError(f"{where}: a text prompt, but the model has no tokenizer; write JSON lists of token ids")
    ids = tokenizer.encode(line, add_special_tokens=True)
    if not ids:
        raise ValueError(f"{where}: the prompt encodes to no tokens")
    return ids
