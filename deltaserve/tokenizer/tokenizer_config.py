"""tokenizer_config.json (and chat_template.jinja): what every back end shares beyond its vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from deltaserve.tokenizer.errors import TokenizerError
from deltaserve.tokenizer.files import read_json_object, read_text

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.43 saves the template; it wins over the config's
SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token")
# transformers writes int(1e30) when the model declares no limit
_NO_LIMIT = 10**18


@dataclass(frozen=True)
class AddedToken:
    content: str
    special: bool


@dataclass(frozen=True)
class TokenizerConfig:
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    chat_template: str | None = None
    chat_template_origin: str = ""  # the file the template came from, for error messages
    model_max_length: int | None = None
    added_tokens: dict[int, AddedToken] = field(default_factory=dict)  # token id -> token

    def special_token_strings(self) -> dict[str, str]:
        """{'bos_token': '<s>', ...} for the tokens that are set; the chat template sees these."""
        return {name: getattr(self, name) for name in SPECIAL_TOKEN_FIELDS if getattr(self, name) is not None}


def load_tokenizer_config(model_dir: Path) -> TokenizerConfig:
    """The folder's tokenizer_config.json and chat_template.jinja; both optional."""
    path = model_dir / CONFIG_FILE
    raw = read_json_object(path) if path.is_file() else {}
    template, origin = _chat_template(raw, path, model_dir / TEMPLATE_FILE)
    return TokenizerConfig(
        **{name: _token_string(raw, name, path) for name in SPECIAL_TOKEN_FIELDS},
        chat_template=template,
        chat_template_origin=origin,
        model_max_length=_model_max_length(raw.get("model_max_length"), path),
        added_tokens=_added_tokens(raw.get("added_tokens_decoder", {}), path),
    )


def _token_string(raw: dict, name: str, path: Path) -> str | None:
    """A special token given as "<s>" or as {"content": "<s>", ...} (transformers' AddedToken form)."""
    value = raw.get(name)
    content = value.get("content") if isinstance(value, dict) else value
    if value is not None and not isinstance(content, str):
        raise TokenizerError(
            f"{path}: {name} = {value!r}, expected a string or {{\"content\": string}}; fix or remove the entry"
        )
    return content


def _chat_template(raw: dict, config_path: Path, template_path: Path) -> tuple[str | None, str]:
    if template_path.is_file():
        template = read_text(template_path)
        if not template.strip():  # it wins over the config's template: an empty one would leave the model none
            raise TokenizerError(f"{template_path} is empty; write the chat template into it, or delete it to use "
                                 f"{config_path.name}'s chat_template")
        return template, str(template_path)
    value = raw.get("chat_template")
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]: the "default" one; the list (an error) if none
        value = next((e.get("template") for e in value if isinstance(e, dict) and e.get("name") == "default"), value)
    if value is not None and not isinstance(value, str):
        raise TokenizerError(
            f"{config_path}: chat_template = {raw['chat_template']!r:.80}, expected a string or a list with a "
            f"{{\"name\": \"default\", \"template\": string}} entry; fix the entry or remove it"
        )
    return value, str(config_path)


def _model_max_length(value, path: Path) -> int | None:
    if value is None:
        return None
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if is_number and value >= _NO_LIMIT:
        return None
    if not is_number or value < 2 or not float(value).is_integer():
        raise TokenizerError(
            f"{path}: model_max_length = {value!r}, expected a positive integer (>= 2: a prompt token and a "
            f"generated one); fix the entry or remove it"
        )
    return int(value)


def _added_tokens(value, path: Path) -> dict[int, AddedToken]:
    if not isinstance(value, dict):
        raise TokenizerError(
            f"{path}: added_tokens_decoder is a {type(value).__name__}, expected an object "
            f"{{\"id\": {{\"content\": string, \"special\": bool}}}}; fix the entry or remove it"
        )
    return {_token_id(key, path): _added_token(key, entry, path) for key, entry in value.items()}


def _token_id(key: str, path: Path) -> int:
    if not key.isdigit():
        raise TokenizerError(
            f"{path}: added_tokens_decoder key {key!r} is not a token id, expected a non-negative integer; "
            f"fix the entry"
        )
    return int(key)


def _added_token(key: str, entry, path: Path) -> AddedToken:
    content = entry.get("content") if isinstance(entry, dict) else None
    special = entry.get("special", False) if isinstance(entry, dict) else None
    if not isinstance(content, str) or not content or not isinstance(special, bool):
        raise TokenizerError(
            f"{path}: added_tokens_decoder[{key!r}] = {entry!r}, expected "
            f"{{\"content\": non-empty string, \"special\": bool}}; fix the entry"
        )
    return AddedToken(content, special)
