"""One small random reference model and its float32 golden (captured once per session, through the CLI)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 8, 12, 16


@dataclass
class Captured:
    model: Path
    golden: Path
    num_prompts: int = NUM_PROMPTS
    prompt_len: int = PROMPT_LEN
    max_tokens: int = MAX_TOKENS

    def load(self) -> dict:
        return json.loads(self.golden.read_text())


@pytest.fixture(scope="session")
def captured(tmp_path_factory) -> Captured:
    from helpers.reference import SPECS, build_reference

    from deltaserve.entrypoints.cli import main

    root = tmp_path_factory.mktemp("parity")
    build_reference(SPECS["hybrid"], seed=3).save_pretrained(root / "model")
    golden = root / "golden.json"
    assert main(["parity", "capture", "--model", str(root / "model"), "--out", str(golden), "--reference",
                 "transformers", "--num-prompts", str(NUM_PROMPTS), "--prompt-len", str(PROMPT_LEN),
                 "--max-tokens", str(MAX_TOKENS)]) == 0
    return Captured(root / "model", golden)
