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
import importlib.util
import json
import logging
import os
import re
import weakref

import torch

from deltaserve.sampling_params import StructuredOutputsParams
from deltaserve.structured import compile_worker, errors
from deltaserve.structured.compile_worker import WorkerDied, first_mask
from deltaserve.structured.errors import GrammarError, StructuredOutputsUnavailable
from deltaserve.structured.schema_check import parse_schema

log = logging.getLogger("deltaserve")
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
    """xgrammar's compiler for one model: its vocabulary size, tokenizer and stop ids. Compiles run in worker
    processes that are killed past timeout_s or memory_bytes (compile_worker), unless isolated is False."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], max_threads: int = 1,
                 isolated: bool = True, timeout_s: float | None = None, memory_bytes: int | None = None):
        # compiles in worker processes, bounded (compile_worker); None: in this process, unbounded. The process's
        # first worker is started before xgrammar is imported here, so that the two imports overlap
        isolated = isolated and importlib.util.find_spec("xgrammar") is not None and _prestarted()
        xgr = import_xgrammar()
        special = tokenizer.all_special_ids
        vocab = [b"" if i in special else tokenizer.id_to_bytes(i) for i in range(vocab_size)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self.xgr = xgr
        self._info = info
        self._workers, self._release = None, None
        if isolated:
            timeout_s = errors.COMPILE_TIMEOUT_S if timeout_s is None else timeout_s
            memory_bytes = errors.COMPILE_MEMORY_BYTES if memory_bytes is None else memory_bytes
            self._workers = compile_worker.acquire(info.serialize_json(), memory_bytes, timeout_s)
            self._release = weakref.finalize(self, compile_worker.release, self._workers)  # once: close or collected
        self.vocab_size = vocab_size
        self.text_safe_bitmask = pack_bitmask([utf8_possible(token) for token in vocab])  # every constraint's
        self.json_safe_bitmask = pack_bitmask([not any(b < 0x20 for b in token) for token in vocab])  # JSON's too
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        # a step's bitmasks filled by C++ threads (one row a matcher); half the cores: the host has other work
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
        self.fill_threads = max(1, min(8, cores // 2))  # of the cores this process may use (Linux), else all
        self._batch = xgr.BatchGrammarMatcher(self.fill_threads)

    def compile(self, spec: StructuredOutputsParams):
        """spec's CompiledGrammar; GrammarError (naming the field) when xgrammar refuses it, when its compile needs
        more than memory_bytes, or when no token can begin an output it admits (e.g. a schema that is only a $ref to
        itself): such a request could only sample from a row of -inf logits. CompileTimeout past timeout_s."""
        kind = param_name(spec)
        method, args, kwargs = self._call(spec, kind)
        workers = self._workers
        isolated = workers is not None and self._compile_isolated(workers, kind, method, args, kwargs)
        compiled, first_mask_s, admits = isolated or (None, None, None)
        if compiled is None:
            try:
                compiled = getattr(self._compiler, method)(*args, **kwargs)
            except RuntimeError as e:  # xgrammar's C++ errors, with a timestamp and a source path
                raise GrammarError(f"{kind}: {one_line(e)}", kind) from None
        if first_mask_s is None:
            first_mask_s, admits = first_mask(self.xgr, compiled)
        if not admits:
            raise GrammarError(f"{kind}: the constraint admits no output (no token can begin one)", kind)
        if first_mask_s > errors.MAX_FIRST_MASK_S:
            raise GrammarError(f"{kind}: the constraint's first token mask took {first_mask_s:.2f} s to compute (the "
                               f"most is {errors.MAX_FIRST_MASK_S:g} s: the requests beside it would wait that long "
                               "at each token); simplify it (fewer nested or ambiguous repetitions)", kind)
        return compiled

    @staticmethod
    def _call(spec: StructuredOutputsParams, kind: str) -> tuple[str, tuple, dict]:
        """The GrammarCompiler method that compiles spec, and its arguments."""
        if kind in ("json", "json_object"):
            schema = json.dumps(parse_schema(spec.json, "json")) if kind == "json" else _JSON_OBJECT
            return "compile_json_schema", (schema,), {"any_whitespace": False, "strict_mode": True}
        if kind == "regex":
            return "compile_regex", (spec.regex,), {}
        if kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return "compile_grammar", (f"root ::= {alternatives}",), {}
        return "compile_grammar", (spec.grammar,), {}

    def _compile_isolated(self, workers, kind: str, method: str, args: tuple, kwargs: dict) -> tuple | None:
        """The compile run in a worker (compile_worker): its CompiledGrammar (None when it fits the bounds and is
        cheaper to compile again here than to pass over), first_mask's seconds, and whether that mask allows a
        token; None when no worker could start (logged; compiled here from now on, unbounded). CompileTimeout past
        the time limit; GrammarError when it failed, ran out of its memory or crashed the worker."""
        try:
            answer, value, *mask = workers.compile(method, args, kwargs)
        except WorkerDied as e:
            if e.timed_out:
                raise errors.CompileTimeout(workers.timeout_s) from None
            raise GrammarError(f"{kind}: the grammar compiler crashed on this constraint; simplify it", kind) from None
        except OSError as e:
            log.warning("grammar compiles run in this process from now on, without bounds of time or memory: %s", e)
            self.close()
            return None
        if answer == "memory":
            raise GrammarError(f"{kind}: compiling the constraint needs more than "
                               f"{workers.memory_bytes / 2**30:g} GiB of memory; simplify it", kind)
        if answer == "error":
            raise GrammarError(f"{kind}: {one_line(value)}", kind)
        return None if value is None else self.xgr.CompiledGrammar.deserialize_json(value, self._info), *mask

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def allocate_bitmask(self, num_rows: int):
        """[num_rows, ceil(vocab_size / 32)] int32 on the CPU."""
        return self.xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        """Row i of bitmask [len(matchers), W] int32 (CPU) := the tokens matchers[i] allows next."""
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def close(self) -> None:
        """Let go of the compile workers: the last backend over this vocabulary and bounds stops them (a compile
        running now is killed when it answers). Compiles after it run in this process."""
        if self._release is not None:
            self._release()
        self._workers = None


def _prestarted() -> bool:
    """compile_worker.prestart; False (logged) when no worker process can be started."""
    try:
        compile_worker.prestart()
    except OSError as e:
        log.warning("grammar compiles run in this process, without bounds of time or memory: %s", e)
        return False
    return True


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
