"""Reading the tokenizer files of a model folder, with errors that name the file and the fix."""

from __future__ import annotations

import json
from pathlib import Path

from deltaserve.tokenizer.errors import TokenizerError

_FIX = "re-download the model's tokenizer files or re-save them with transformers"


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TokenizerError(f"{path} does not exist; {_FIX}") from None
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path} is not UTF-8 text (byte {e.start}); {_FIX}") from None
    except OSError as e:
        raise TokenizerError(f"cannot read {path}: {e.strerror}; check the file's permissions") from None


def parse_json_object(text: str, path: Path) -> dict:
    """text (the contents of path) parsed as one JSON object."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); {_FIX}"
        ) from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} holds a JSON {type(data).__name__}, expected an object; {_FIX}")
    return data


def read_json_object(path: Path) -> dict:
    return parse_json_object(read_text(path), path)
