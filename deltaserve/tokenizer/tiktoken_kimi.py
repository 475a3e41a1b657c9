"""The Kimi tokenizer: tiktoken.model byte-pair ranks, Moonshot's split pattern, 256 special ids on top.

It reproduces Moonshot's published tokenization_kimi.py (which needs trust_remote_code) from the files alone:
the n ranks of tiktoken.model are the ids 0..n-1, and the ids n..n+255 are special tokens, named by
tokenizer_config.json's added_tokens_decoder or `<|reserved_token_ID|>` when it names none. For the published
files n = 163584, so [BOS] = 163584, [EOS] = 163585, <|im_end|> = 163586 and the vocabulary holds 163840 ids."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import tiktoken

from deltaserve.tokenizer.base import ChatText, Tokenizer
from deltaserve.tokenizer.errors import TokenizerError
from deltaserve.tokenizer.tiktoken_file import TIKTOKEN_FILE, read_mergeable_ranks
from deltaserve.tokenizer.tokenizer_config import CONFIG_FILE, TokenizerConfig, load_tokenizer_config

# tokenization_kimi.py's pat_str: Han runs alone, cased words with English contractions, numbers in threes.
# `[A&&[^B]]` is class intersection, which tiktoken's regex engine supports.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_RESERVED_SPECIAL_TOKENS = 256
# tokenization_kimi.py encodes text in slices of at most this many characters, and cuts runs of whitespace or
# of non-whitespace longer than _MAX_RUN_CHARS (tiktoken fails or crawls beyond); cutting at the same places
# keeps the ids identical
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(rf"\s{{{_MAX_RUN_CHARS + 1},}}|\S{{{_MAX_RUN_CHARS + 1},}}")


class KimiTokenizer(Tokenizer):
    """tiktoken.model + tokenizer_config.json, as Moonshot publishes them for Kimi-K2 and Kimi-Linear.

    encode() turns special-token strings into their ids only when asked (add_special_tokens=True, which the
    engine passes for prompts, so rendered chats get their role tokens); otherwise they are plain text. No BOS
    is ever added: the Kimi tokenizer adds none. Special ids the config marks `"special": false` (the
    tool-call markers in the published file) stay in decoded text even with skip_special_tokens."""

    def __init__(self, model_dir: Path):
        config = load_tokenizer_config(model_dir)
        config_path = model_dir / CONFIG_FILE
        self._ranks = read_mergeable_ranks(model_dir / TIKTOKEN_FILE)
        self._special = _special_tokens(config, len(self._ranks), config_path)
        self._encoding = tiktoken.Encoding(
            name=TIKTOKEN_FILE, pat_str=KIMI_PATTERN, mergeable_ranks=self._ranks, special_tokens=self._special
        )
        self._token_bytes = _token_bytes_table(self._ranks, self._special)
        kept_in_text = {i for i, token in config.added_tokens.items() if not token.special}
        self._special_ids = frozenset(self._special.values()) - kept_in_text
        super().__init__(config, str(config_path))

    def encode_prompt(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        # here the flag only lets special strings become their ids, which every prompt gets: there is no BOS to add
        return self.encode(text, add_special_tokens=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        allowed = "all" if add_special_tokens else set()
        return [
            token_id
            for piece in _pieces(text)
            for token_id in self._encoding.encode(piece, allowed_special=allowed, disallowed_special=())
        ]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        skip = self.all_special_ids if skip_special_tokens else frozenset()
        return b"".join(self.id_to_bytes(i) for i in token_ids if i not in skip).decode("utf-8", errors="replace")

    def id_to_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""

    def token_to_id(self, token: str) -> int | None:
        """A special token's id, or the rank of the vocabulary token whose bytes are token's UTF-8."""
        found = self._special.get(token)
        return found if found is not None else self._ranks.get(token.encode("utf-8", errors="surrogatepass"))

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    @property
    def backend_special_ids(self) -> frozenset[int]:
        return self._special_ids

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None) -> ChatText:
        # tokenization_kimi.py sorts every dict in tools by key before rendering: the model saw tools that way
        return super().apply_chat_template(messages, add_generation_prompt, _sorted_keys(tools))


def _special_tokens(config: TokenizerConfig, num_base_tokens: int, config_path: Path) -> dict[str, int]:
    """name -> id for the reserved ids num_base_tokens .. num_base_tokens + 255."""
    reserved = range(num_base_tokens, num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS)
    outside = sorted(set(config.added_tokens) - set(reserved))
    if outside:
        raise TokenizerError(
            f"{config_path}: added_tokens_decoder has id {outside[0]}, outside the special ids "
            f"{reserved.start}..{reserved.stop - 1} that follow the {num_base_tokens} tokens of {TIKTOKEN_FILE}; "
            f"the two files do not belong together: re-download both from the same model"
        )
    special: dict[str, int] = {}
    for token_id in reserved:
        added = config.added_tokens.get(token_id)
        name = added.content if added is not None else f"<|reserved_token_{token_id}|>"
        if name in special:
            raise TokenizerError(
                f"{config_path}: special token {name!r} has two ids, {special[name]} and {token_id}; "
                f"give each id its own token in added_tokens_decoder"
            )
        special[name] = token_id
    return special


def _token_bytes_table(ranks: dict[bytes, int], special: dict[str, int]) -> list[bytes]:
    table = [b""] * (len(ranks) + len(special))
    for token, rank in ranks.items():
        table[rank] = token
    for name, token_id in special.items():
        table[token_id] = name.encode("utf-8")
    return table


def _pieces(text: str) -> Iterator[str]:
    """text cut where tokenization_kimi.py cuts it: in slices, then inside overlong runs of one kind."""
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        piece = text[start:start + _MAX_ENCODE_CHARS]
        cuts = [cut for run in _LONG_RUN.finditer(piece)
                for cut in range(run.start() + _MAX_RUN_CHARS, run.end(), _MAX_RUN_CHARS)]
        for begin, end in zip([0, *cuts], [*cuts, len(piece)]):
            yield piece[begin:end]


def _sorted_keys(value):
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value, key=str)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value
