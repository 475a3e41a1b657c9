"""The golden file of `deltaserve parity`: what a reference generated greedily, and how sure it was.

JSON, the minimum every golden holds:
    {"model": str, "reference": str, "dtype": str,
     "prompts": [{"prompt_token_ids": [...], "output_token_ids": [...], "top2": [[id1, id2, margin], ...]}]}
with one top2 entry per output token: the reference's best token, its runner-up and their logit gap.
`capture` adds "vocab_size", "device", "seed", "topk" and, per prompt, "ref_topk_ids" / "ref_topk_logprobs":
per output token the reference's top-k teacher-forced log-probabilities, from which `check` computes the KL."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class GoldenError(ValueError):
    """A golden file that cannot be read or does not fit the model; the message says which and what to do."""


@dataclass
class GoldenPrompt:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    top2: list[tuple[int, int, float]]  # per output token: best id, runner-up id, logit(best) - logit(runner-up)
    ref_topk_ids: list[list[int]] | None = None  # per output token: the reference's top-k ids...
    ref_topk_logprobs: list[list[float]] | None = None  # ...and their log-probabilities, same order


@dataclass
class Golden:
    model: str
    reference: str  # "transformers" | "deltaserve"
    dtype: str
    prompts: list[GoldenPrompt]
    vocab_size: int | None = None
    device: str | None = None
    seed: int | None = None
    topk: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(p.output_token_ids) for p in self.prompts)


def save_golden(golden: Golden, path: str | Path) -> None:
    """Header fields first, then one prompt per line (readable diffs, no million-line files)."""
    header = {k: v for k, v in vars(golden).items() if k != "prompts" and v is not None}
    prompts = [{k: v for k, v in vars(p).items() if v is not None} for p in golden.prompts]
    body = ",\n".join(json.dumps(p, separators=(",", ":")) for p in prompts)
    head = json.dumps(header)[:-1]
    Path(path).write_text(f'{head}, "prompts": [\n{body}\n]}}\n', encoding="utf-8")


def load_golden(path: str | Path) -> Golden:
    path = Path(path)
    if not path.is_file():
        raise GoldenError(f"golden file {path} does not exist: write one with "
                          f"`deltaserve parity capture --model DIR --out {path}`")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GoldenError(f"golden file {path} is not valid JSON ({e}); capture it again") from None
    _need(isinstance(raw, dict), path, "the file", "must hold a JSON object")
    for key in ("model", "reference", "dtype"):
        _need(isinstance(raw.get(key), str), path, key, "must be a string")
    _need(isinstance(raw.get("prompts"), list) and raw["prompts"], path, "prompts", "must be a non-empty list")
    extras = {k: raw.get(k) for k in ("vocab_size", "seed", "topk")}
    for key, value in extras.items():
        _need(value is None or _is_int(value), path, key, "must be an integer")
    prompts = [_parse_prompt(p, path, f"prompts[{i}]") for i, p in enumerate(raw["prompts"])]
    return Golden(raw["model"], raw["reference"], raw["dtype"], prompts, device=raw.get("device"), **extras)


def check_vocab(golden: Golden, vocab_size: int, golden_path: str | Path, model: str | Path) -> None:
    """Raise unless every id in the golden is a token of a model with vocab_size tokens."""
    if golden.vocab_size is not None and golden.vocab_size != vocab_size:
        raise GoldenError(f"golden file {golden_path} was captured for vocab_size {golden.vocab_size}, but model "
                          f"{model} has vocab_size {vocab_size}: check against the model the golden was captured from")
    for i, p in enumerate(golden.prompts):
        ids = p.prompt_token_ids + p.output_token_ids + [t for entry in p.top2 for t in entry[:2]]
        if max(ids) >= vocab_size:
            raise GoldenError(f"golden file {golden_path}: prompts[{i}] holds token id {max(ids)}, but model {model} "
                              f"has vocab_size {vocab_size}: check against the model the golden was captured from")


def _parse_prompt(raw, path: Path, where: str) -> GoldenPrompt:
    _need(isinstance(raw, dict), path, where, "must be an object")
    prompt, output, top2 = (raw.get(k) for k in ("prompt_token_ids", "output_token_ids", "top2"))
    _need(_is_ids(prompt) and prompt, path, f"{where}.prompt_token_ids", "must be a non-empty list of token ids")
    _need(_is_ids(output) and output, path, f"{where}.output_token_ids", "must be a non-empty list of token ids")
    _need(isinstance(top2, list) and len(top2) == len(output), path, f"{where}.top2",
          f"must hold one [id1, id2, margin] per output token ({len(output)})")
    for j, entry in enumerate(top2):
        ok = isinstance(entry, list) and len(entry) == 3 and _is_ids(entry[:2]) and _is_num(entry[2]) and entry[2] >= 0
        _need(ok, path, f"{where}.top2[{j}]", "must be [id1, id2, margin] with margin >= 0")
    ids, logprobs = raw.get("ref_topk_ids"), raw.get("ref_topk_logprobs")
    if ids is not None or logprobs is not None:
        ok = (isinstance(ids, list) and isinstance(logprobs, list) and len(ids) == len(logprobs) == len(output)
              and all(_is_ids(a) and a and isinstance(b, list) and len(a) == len(b) and all(map(_is_num, b))
                      for a, b in zip(ids, logprobs)))
        _need(ok, path, f"{where}.ref_topk_ids/ref_topk_logprobs",
              "must be parallel lists, one non-empty list of ids and of log-probabilities per output token")
    return GoldenPrompt(prompt, output, [tuple(e) for e in top2], ids, logprobs)


def _need(cond, path: Path, field: str, expectation: str) -> None:
    if not cond:
        raise GoldenError(f"golden file {path}: {field} {expectation}; "
                          "capture it again with `deltaserve parity capture`")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _is_ids(v) -> bool:
    return isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v)
