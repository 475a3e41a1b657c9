"""xgrammar behind one small class: the tokenizer's vocabulary as xgrammar needs it, and a compile for each kind of
constraint, with xgrammar's errors turned into one clear line.

Traps of xgrammar 0.2.8 handled here: deltaserve's tokenizers are not transformers', so TokenizerInfo is built from
the raw bytes of every id (VocabType.RAW) over the model's vocabulary (which may be larger than the tokenizer's: the
extra ids get empty bytes, which xgrammar never allows), with the engine's stop ids; special tokens are passed as
empty bytes (passed as their text, '<|im_end|>' was allowed inside a JSON string); JSON is compiled with
any_whitespace off (by default a model could emit hundreds of spaces after '{'), so separators are exactly ', '
and ': '; xgrammar's JSON strings admit raw control characters (U+0000-U+001F, which JSON forbids: a parser
refuses the output), so JSON constraints also never allow a token holding such a byte (json_safe_bitmask); and in a
bounded repetition of more than 128 (a JSON string's maxLength 400, a regex's {1,400}) xgrammar's mask allows
tokens its own matcher then refuses: those holding bytes no UTF-8 text has (0xC0, an overlong 0xE0 0x80, ...), so
no constraint allows a token that cannot be part of UTF-8 text (text_safe_bitmask). Left: in such repetitions the
mask still allows some tokens its matcher refuses (ending in a lone 0xE0 or 0xF0 lead byte; a character then any
byte): one that is sampled is taken back and its position sampled again without it (Engine._advance_grammar)."""

from __future__ import annotations

import codecs
import json
import os
import re

import torch

from deltaserve.sampling_params import StructuredOutputsParams
from deltaserve.structured.errors import GrammarError, StructuredOutputsUnavailable
from deltaserve.structured.schema_check import parse_schema

_JSON_OBJECT = '{"type": "object"}'
# "[04:38:45] /project/cpp/regex_converter.cc:83: " and "Check failed: (error.empty()) is false: "
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: |Check failed: .*? is false: ")


def import_xgrammar():
    """The xgrammar module; StructuredOutputsUnavailable (a 400 naming the extra) when it cannot be imported."""
    try:
        import xgrammar
    except ImportError as e:
        raise StructuredOutputsUnavailable(str(e)) from e
    return xgrammar


def param_name(spec: StructuredOutputsParams) -> str:
    """The StructuredOutputsParams field a spec sets: what an error about it names."""
    return spec.key[0]


class GrammarBackend:
    """xgrammar's compiler for one model: its vocabulary size, tokenizer and stop ids."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], max_threads: int = 1):
        xgr = import_xgrammar()
        special = tokenizer.all_special_ids
        vocab = [b"" if i in special else tokenizer.id_to_bytes(i) for i in range(vocab_size)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self.xgr = xgr
        self.vocab_size = vocab_size
        self.text_safe_bitmask = pack_bitmask([utf8_possible(token) for token in vocab])  # every constraint's
        self.json_safe_bitmask = pack_bitmask([not any(b < 0x20 for b in token) for token in vocab])  # JSON's too
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        # a step's bitmasks filled by C++ threads (one row a matcher); half the cores: the host has other work
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
        self.fill_threads = max(1, min(8, cores // 2))  # of the cores this process may use (Linux), else all
        self._batch = xgr.BatchGrammarMatcher(self.fill_threads)

    def compile(self, spec: StructuredOutputsParams):
        """spec's CompiledGrammar; GrammarError (naming the field) when xgrammar refuses it, or when no token can
        begin an output it admits (e.g. a schema that is only a $ref to itself): such a request could only sample
        from a row of -inf logits."""
        kind = param_name(spec)
        try:
            compiled = self._compile(spec, kind)
        except RuntimeError as e:  # xgrammar's C++ errors, with a timestamp and a source path
            raise GrammarError(f"{kind}: {one_line(e)}", kind) from None
        bitmask = self.allocate_bitmask(1)
        self.fill([self.matcher(compiled)], bitmask)
        if not bitmask.any():
            raise GrammarError(f"{kind}: the constraint admits no output (no token can begin one)", kind)
        return compiled

    def _compile(self, spec: StructuredOutputsParams, kind: str):
        if kind in ("json", "json_object"):
            schema = json.dumps(parse_schema(spec.json, "json")) if kind == "json" else _JSON_OBJECT
            return self._compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return self._compiler.compile_regex(spec.regex)
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return self._compiler.compile_grammar(f"root ::= {alternatives}")
        return self._compiler.compile_grammar(spec.grammar)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, num_rows: int):
        """[num_rows, ceil(vocab_size / 32)] int32 on the CPU."""
        return self.xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        """Row i of bitmask [len(matchers), W] int32 (CPU) := the tokens matchers[i] allows next."""
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)


_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")  # U+D800-U+DFFF, not UTF-8 (the decoder lets a partial one by)


def utf8_possible(token: bytes) -> bool:
    """Whether token can be a piece of UTF-8 text: valid after up to 3 leading continuation bytes (the rest of a
    character an earlier token began), up to a valid unfinished character at its end."""
    start = 0
    while start < min(3, len(token)) and 0x80 <= token[start] < 0xC0:
        start += 1
    try:
        codecs.getincrementaldecoder("utf-8")().decode(token[start:], final=False)
    except UnicodeDecodeError:
        return False
    return _SURROGATE.search(token) is None


def pack_bitmask(allowed: list[bool]) -> torch.Tensor:
    """[ceil(len / 32)] int32 words, bit j of word w set when allowed[32 * w + j] (xgrammar's layout)."""
    words = -(-len(allowed) // 32)
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[: len(allowed)] = torch.tensor(allowed, dtype=torch.int64)
    packed = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)  # in [0, 2**32)
    return (packed - (packed >= 2**31) * 2**32).to(torch.int32)


def one_line(error: Exception) -> str:
    """xgrammar's message without its C++ prefixes, on one line."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(error).strip().splitlines()]
    return " ".join(line for line in lines if line)[:500]
