"""tiktoken.model: one `<base64 token bytes> <rank>` line per token, read and checked line by line."""

from __future__ import annotations

import binascii
from base64 import b64decode
from pathlib import Path

from deltaserve.tokenizer.errors import TokenizerError
from deltaserve.tokenizer.files import read_text

TIKTOKEN_FILE = "tiktoken.model"
_FIX = f"re-download the model's {TIKTOKEN_FILE}"


def read_mergeable_ranks(path: Path) -> dict[bytes, int]:
    """token bytes -> rank. Ranks must be 0..n-1 (the special ids start at n), each token and rank once,
    and every single byte a token (else some text could not be encoded at all)."""
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    line_of_token: dict[bytes, int] = {}
    for line_no, line in enumerate(read_text(path).splitlines(), start=1):
        if not line:
            continue  # tiktoken's own loader skips empty lines too
        token, rank = _parse_line(line, path, line_no)
        if token in line_of_token:
            raise TokenizerError(f"{path} line {line_no}: token {token!r} is already on line "
                                 f"{line_of_token[token]}; each token may appear once; {_FIX}")
        if rank in line_of_rank:
            raise TokenizerError(f"{path} line {line_no}: rank {rank} is already on line {line_of_rank[rank]}; "
                                 f"each rank may appear once; {_FIX}")
        ranks[token], line_of_token[token], line_of_rank[rank] = rank, line_no, line_no
    _check_complete(ranks, path)
    return ranks


def _parse_line(line: str, path: Path, line_no: int) -> tuple[bytes, int]:
    fields = line.split()
    if len(fields) != 2:
        raise TokenizerError(f"{path} line {line_no}: {line!r:.80} has {len(fields)} fields, expected "
                             f"'<base64 token> <rank>'; {_FIX}")
    encoded, rank = fields
    try:
        token = b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise TokenizerError(f"{path} line {line_no}: {encoded!r:.60} is not valid base64; {_FIX}") from None
    if not token:
        raise TokenizerError(f"{path} line {line_no}: the token is empty, expected at least one byte; {_FIX}")
    if not (rank.isascii() and rank.isdigit()):
        raise TokenizerError(f"{path} line {line_no}: rank {rank!r:.30} is not a non-negative integer; {_FIX}")
    return token, int(rank)


def _check_complete(ranks: dict[bytes, int], path: Path) -> None:
    if not ranks:
        raise TokenizerError(f"{path} holds no tokens, expected one '<base64 token> <rank>' line per token; {_FIX}")
    if max(ranks.values()) != len(ranks) - 1:
        missing = min(set(range(len(ranks))) - set(ranks.values()))
        raise TokenizerError(f"{path}: rank {missing} is missing; the {len(ranks)} ranks must be 0..{len(ranks) - 1} "
                             f"because the special token ids start right after them; {_FIX}")
    missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
    if missing_bytes:
        raise TokenizerError(f"{path} has no token for the single byte 0x{missing_bytes[0]:02x} "
                             f"({len(missing_bytes)} bytes missing); every byte must be a token or text holding it "
                             f"cannot be encoded; {_FIX}")
