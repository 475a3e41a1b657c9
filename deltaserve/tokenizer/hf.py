"""The tokenizers-library back end: a byte-level BPE tokenizer.json plus the folder's tokenizer_config.json."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers

from deltaserve.tokenizer.base import Tokenizer
from deltaserve.tokenizer.errors import TokenizerError
from deltaserve.tokenizer.files import parse_json_object, read_text
from deltaserve.tokenizer.tokenizer_config import CONFIG_FILE, load_tokenizer_config

TOKENIZER_FILE = "tokenizer.json"
# a text this long or longer is encoded through encode_batch, which gives up the GIL while it runs (encode keeps it):
# a server tokenizing a long prompt in a worker thread then keeps its event loop serving; the same ids either way
BATCH_ENCODE_CHARS = 1 << 13


class HFTokenizer(Tokenizer):
    """tokenizer.json through the tokenizers library; its decoder must be ByteLevel."""

    def __init__(self, model_dir: Path):
        path = model_dir / TOKENIZER_FILE
        text = read_text(path)
        _check_decoder(parse_json_object(text, path), path)
        self._tokenizer = _build(text, path)
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        self._token_bytes = _token_bytes_table(vocab, self._vocab_size)
        added = self._tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, token in added.items() if token.special)
        super().__init__(load_tokenizer_config(model_dir), str(model_dir / CONFIG_FILE))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) < BATCH_ENCODE_CHARS:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        token_ids = list(token_ids)
        try:
            return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        except OverflowError:  # a negative id or one past 2**32, which tokenizers cannot take: skipped, as it skips
            # the other ids outside the vocabulary (and id_to_bytes gives b"" for all of them)
            inside = [i for i in token_ids if 0 <= i < self._vocab_size]
            return self._tokenizer.decode(inside, skip_special_tokens=skip_special_tokens)

    def id_to_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id] if 0 <= token_id < self._vocab_size else b""

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def backend_special_ids(self) -> frozenset[int]:
        return self._special_ids


def _check_decoder(raw: dict, path: Path) -> None:
    # Incremental decoding works on each token's bytes, which only a byte-level decoder defines exactly
    decoder = raw.get("decoder")
    kind = decoder.get("type") if isinstance(decoder, dict) else decoder
    if kind != "ByteLevel":
        raise TokenizerError(
            f"{path}: decoder type {kind!r} is not supported, expected 'ByteLevel' (byte-level BPE, as in the "
            f"Kimi, GPT-2, Llama 3 and Qwen tokenizers); use a byte-level BPE tokenizer for this model"
        )


def _build(text: str, path: Path) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # the library raises a bare Exception carrying serde's message
        raise TokenizerError(
            f"{path} is not a tokenizer the tokenizers library can load ({e}); "
            f"re-download it or re-save it with tokenizers >= 0.19"
        ) from None


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    unprintable = [b for b in range(256) if b not in printable]
    chars = [*map(chr, printable), *(chr(256 + n) for n in range(len(unprintable)))]
    return dict(zip(chars, [*printable, *unprintable]))


def _token_bytes_table(vocab: dict[str, int], vocab_size: int) -> list[bytes]:
    """Each id's bytes, by the ByteLevel decoder's rule: map every character back to its byte, or, when some
    character is outside the alphabet (an added token such as '<|im_end|> x'), take the UTF-8 of the string."""
    byte_of_char = _byte_of_char()
    table = [b""] * vocab_size
    for token, token_id in vocab.items():
        if all(char in byte_of_char for char in token):
            table[token_id] = bytes(byte_of_char[char] for char in token)
        else:
            table[token_id] = token.encode("utf-8")
    return table
