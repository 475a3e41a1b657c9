"""What a constraint costs the host at each step: xgrammar's bitmask fill for one request, per grammar, on the
published vocabulary's size (the synthetic Kimi tokenizer of tests/helpers/kimi_tokenizer.py), walking each grammar
with random allowed tokens. A batch's sampling waits for its constrained rows' fill, so a grammar whose fill takes
milliseconds a step slows every request beside it.

    python benchmarks/grammar_step_cost.py [--steps 128] [--seed 0]
    python benchmarks/grammar_step_cost.py --check-masks

Prints one row per grammar: compile time, and the fill's median and maximum over the walk. --check-masks instead
tries every token the backend's mask allows (xgrammar's, then the UTF-8 filter) on the matcher, per constraint of
MASK_CHECKS, and counts those it refuses (xgrammar's inconsistency in bounded repetitions past 128).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from deltaserve.sampling_params import StructuredOutputsParams
from deltaserve.structured.backend import GrammarBackend
from deltaserve.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
ITEMS = {"type": "array", "items": {"type": "string"}, "minItems": 200}
MASK_CHECKS = [  # (constraint, output so far)
    (dict(json={"type": "object", "properties": {"a": {"type": "string", "maxLength": 400}}}), '{"a": "'),
    (dict(regex="[a-z ]{1,400}"), "ab"), (dict(regex="\\w{1,400}"), ""), (dict(regex="[a-z]{1,300}"), ""),
    (dict(regex="[ -~]{1,300}"), ""), (dict(regex="[a-z\u0800-\u0fff]{1,300}"), "a"),
    (dict(regex="[a-z\u0800-\u0fff]{1,100}"), "a"), (dict(regex="[^a]{1,300}"), ""),
    (dict(regex="[\u4e00-\u9fff]{1,300}"), ""),
]
GRAMMARS = {
    "JSON schema, unbounded strings": dict(json={"type": "object", "properties": {"items": ITEMS}}),
    "JSON schema, maxLength 16": dict(json={"type": "object", "properties": {
        "items": {**ITEMS, "items": {"type": "string", "maxLength": 16}}}}),
    "regex [a-z ]{1,400}": dict(regex="[a-z ]{1,400}"),
    'EBNF, ambiguous sums (e ::= e "+" e, ...)':
        dict(grammar='root ::= e\ne ::= e "+" e | e "*" e | "(" e ")" | [0-9]+'),
    'EBNF, ambiguous words (s ::= w, w w or w w w)':
        dict(grammar='root ::= s+\ns ::= w | w w | w w w\nw ::= [a-z]+ " "?'),
}


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    bits = (bitmask.to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def walk(backend: GrammarBackend, compiled, steps: int, rng: random.Random, stop_id: int) -> list[float]:
    """Seconds of each step's fill along one random path through the grammar (ending it only where nothing but the
    stop token is allowed)."""
    matcher, bitmask, times = backend.matcher(compiled), backend.allocate_bitmask(1), []
    for _ in range(steps):
        start = time.perf_counter()
        backend.fill([matcher], bitmask)
        times.append(time.perf_counter() - start)
        allowed = [t for t in allowed_tokens(bitmask[0], backend.vocab_size) if t != stop_id] or [stop_id]
        rng.shuffle(allowed)
        # xgrammar 0.2.8's mask can allow a token its matcher then refuses (in a long bounded repetition, a token
        # ending in the lead byte of a multi-byte character): take the next one
        if not any(matcher.accept_token(t) for t in allowed[:64]) or matcher.is_terminated():
            break
    return times


def check_masks(backend: GrammarBackend, tokenizer) -> None:
    print("| constraint | after | allowed | refused by the matcher | their last bytes |\n|---|---|---:|---:|---|")
    for spec, text in MASK_CHECKS:
        matcher = backend.matcher(backend.compile(StructuredOutputsParams(**spec)))
        assert matcher.accept_string(text)
        bitmask = backend.allocate_bitmask(1)
        backend.fill([matcher], bitmask)
        bitmask &= backend.text_safe_bitmask  # as StructuredOutputManager applies it
        allowed, refused = allowed_tokens(bitmask[0], backend.vocab_size), collections.Counter()
        for token in allowed:
            if matcher.accept_token(token):
                matcher.rollback(1)
            else:
                refused[tokenizer.id_to_bytes(token)[-1:].hex()] += 1
        print(f"| {json.dumps(spec)} | {text!r} | {len(allowed)} | {sum(refused.values())} | "
              f"{dict(refused.most_common(3))} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-masks", action="store_true", help="count allowed tokens the matcher refuses")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.kimi_tokenizer import PUBLISHED_NUM_RANKS, synthetic_ranks, write_kimi_files

    folder = Path(tempfile.mkdtemp())
    write_kimi_files(folder, synthetic_ranks(PUBLISHED_NUM_RANKS))
    tokenizer = load_tokenizer(folder)
    vocab_size = json.loads((ROOT / "benchmarks/configs/kimi-linear-48b-a3b.json").read_text())["vocab_size"]
    stop_id = min(tokenizer.all_special_ids)
    backend = GrammarBackend(tokenizer, vocab_size, (stop_id,))
    if args.check_masks:
        return check_masks(backend, tokenizer)
    print(f"vocabulary {vocab_size}\n| grammar | compile ms | fill median ms | fill max ms | steps |")
    print("|---|---:|---:|---:|---:|")
    for name, spec in GRAMMARS.items():
        start = time.perf_counter()
        compiled = backend.compile(StructuredOutputsParams(**spec))
        compile_ms = (time.perf_counter() - start) * 1e3
        times = walk(backend, compiled, args.steps, random.Random(args.seed), stop_id)
        print(f"| {name} | {compile_ms:.1f} | {statistics.median(times) * 1e3:.3f} | {max(times) * 1e3:.3f} | "
              f"{len(times)} |")


if __name__ == "__main__":
    main()
