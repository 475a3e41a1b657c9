"""An engine pairs the model folder's tokenizer with config.json's vocabulary at load: a tokenizer whose ids run past
the model's embedding is refused there, not blamed on a prompt later."""

from __future__ import annotations

import shutil

import pytest
from helpers.engine import without_tokenizer

from deltaserve.config import EngineConfig
from deltaserve.core.engine import Engine
from deltaserve.entrypoints.llm import BUNDLED_MODEL
from deltaserve.tokenizer import TokenizerError


def test_tokenizer_of_a_larger_vocabulary_is_refused_at_load(tiny_model, tmp_path):
    folder = without_tokenizer(tiny_model, tmp_path / "model")  # vocab 512
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, folder / name)  # the demo model's, ids up to 4095
    with pytest.raises(TokenizerError, match=r"tokenizer files in .* do not belong to this model \(ids up to 4095, "
                                             r"model vocabulary 512"):
        Engine(str(folder), EngineConfig(threads=1))

