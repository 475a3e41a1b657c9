"""Tokenizers: load_tokenizer finds the folder's back end; IncrementalDetokenizer streams output text."""

from __future__ import annotations

from pathlib import Path

from deltaserve.tokenizer.base import Tokenizer
from deltaserve.tokenizer.detokenizer import IncrementalDetokenizer
from deltaserve.tokenizer.errors import ChatTemplateError, TokenizerError
from deltaserve.tokenizer.hf import TOKENIZER_FILE, HFTokenizer
from deltaserve.tokenizer.tiktoken_file import TIKTOKEN_FILE
from deltaserve.tokenizer.tiktoken_kimi import KimiTokenizer
from deltaserve.tokenizer.tokenizer_config import CONFIG_FILE

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer", "TokenizerError", "load_tokenizer"]


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer in model_dir; None when it has no tokenizer files (token ids in, token ids out)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TokenizerError(f"model folder {model_dir} does not exist or is not a folder; check --model")
    if (model_dir / TOKENIZER_FILE).is_file():
        return HFTokenizer(model_dir)
    if (model_dir / TIKTOKEN_FILE).is_file():
        return KimiTokenizer(model_dir)
    if (model_dir / CONFIG_FILE).is_file():
        raise TokenizerError(
            f"{model_dir / CONFIG_FILE} has no vocabulary beside it (expected {TOKENIZER_FILE} or {TIKTOKEN_FILE}); "
            f"copy the model's {TOKENIZER_FILE} into {model_dir}, or remove {CONFIG_FILE} to run on token ids only"
        )
    return None
