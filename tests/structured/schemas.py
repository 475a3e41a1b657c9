"""Random JSON schemas with bounded output: nested objects, arrays, enums, bounded numbers, required and optional
fields; every string and array has a maximum length, so an output always fits a small max_tokens."""

from __future__ import annotations

import random

WORDS = ["red", "green", "blue", "cat", "dog", "x", "y z"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema whose root is an object."""
    return _object(rng, depth)


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "null_or_int"]
    if depth < 2:
        kinds += ["array", "object"]
    return globals()[f"_{rng.choice(kinds)}"](rng, depth)


def _object(rng, depth):
    names = rng.sample(["id", "name", "size", "tags", "meta", "ok", "score", "kind"], rng.randint(1, 3))
    properties = {name: _value(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.6]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _array(rng, depth):
    items = _value(rng, depth + 1) if depth < 1 else _scalar(rng, depth)
    low = rng.randint(0, 1)
    return {"type": "array", "items": items, "minItems": low, "maxItems": rng.randint(max(low, 1), 3)}


def _scalar(rng, depth):
    return globals()[f"_{rng.choice(['string', 'integer', 'boolean', 'enum'])}"](rng, depth)


def _string(rng, depth):
    low = rng.randint(0, 2)
    return {"type": "string", "minLength": low, "maxLength": rng.randint(max(low, 1), 6)}


def _integer(rng, depth):
    low = rng.randint(-50, 50)
    return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}


def _number(rng, depth):
    low = rng.randint(-10, 10)
    return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100)}


def _boolean(rng, depth):
    return {"type": "boolean"}


def _enum(rng, depth):
    return {"enum": rng.sample(WORDS, rng.randint(1, 4))}


def _null_or_int(rng, depth):
    return {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 9}]}
