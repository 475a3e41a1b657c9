"""Grammar compiles in worker processes: a compile past its memory budget or its time limit is refused and stopped,
the worker is replaced, and what a worker compiles masks exactly as a compile in this process does."""

import gc
import logging
import signal
import sys
import time

import pytest

from deltaserve.entrypoints.llm import BUNDLED_MODEL
from deltaserve.sampling_params import StructuredOutputsParams
from deltaserve.structured import CompileTimeout, GrammarError
from deltaserve.structured.backend import GrammarBackend
from deltaserve.structured.compile_worker import CompileWorker, WorkerDied
from deltaserve.tokenizer import load_tokenizer

pytest.importorskip("xgrammar", reason="the structured extra is part of the test extra")

NESTED_STARS = StructuredOutputsParams(regex="(a*)*" * 100_000)  # grew a process to 24 GB (BENCHMARKS.md)
SLOW = StructuredOutputsParams(regex="a*" * 3_000)  # over a minute to compile
SPECS = [
    StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string", "maxLength": 300},
                                                                   "n": {"type": "integer"}}, "required": ["name"]}),
    StructuredOutputsParams(regex="[a-z]{2,200}@[a-z]+\\.(com|org)"),
    StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("," [0-9]+)* ")"'),
]
PREFIXES = ['{"name": "ab', "abc", "ma", "(12,"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUNDLED_MODEL)


@pytest.fixture(scope="module")
def bounded(tokenizer):
    """A backend with small bounds: 512 MiB of memory, 3 s."""
    backend = GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, timeout_s=3.0,
                             memory_bytes=512 << 20)
    yield backend
    backend.close()


def masks(backend: GrammarBackend, spec: StructuredOutputsParams, text: str):
    matcher = backend.matcher(backend.compile(spec))
    assert matcher.accept_string(text)
    bitmask = backend.allocate_bitmask(1)
    backend.fill([matcher], bitmask)
    return bitmask


def test_a_compile_past_its_memory_is_refused_and_the_next_compiles(tokenizer):
    backend = GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, memory_bytes=512 << 20)
    try:
        with pytest.raises(GrammarError, match=r"^regex: compiling the constraint needs more than 0.5 GiB of memory"):
            backend.compile(NESTED_STARS)
        assert masks(backend, SPECS[2], "").any()  # on a new worker
    finally:
        backend.close()


def test_a_compile_past_its_time_is_killed_and_the_next_compiles(bounded):
    bounded.compile(SPECS[2])  # a worker is up, so the time below is the compile's
    start = time.monotonic()
    with pytest.raises(CompileTimeout, match="within 3 s"):
        bounded.compile(SLOW)
    assert time.monotonic() - start < 10
    assert masks(bounded, SPECS[3], "(1").any()


def test_a_worker_ends_a_compile_past_twice_its_time_limit_in_cpu_by_itself(tokenizer):
    """Should the parent be gone (nobody to kill it at the time limit), a worker stops at twice that in CPU time."""
    here = GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, isolated=False)
    worker = CompileWorker()
    worker.start(here._info.serialize_json(), 512 << 20, timeout_s=1.0, serialize_s_per_byte=0.0)
    start = time.monotonic()
    with pytest.raises(WorkerDied) as died:
        worker.compile("compile_regex", (SLOW.regex,), {}, timeout_s=60.0)  # no kill from here
    assert not died.value.timed_out and worker._proc.returncode == -signal.SIGXCPU
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("isolated", [True, False], ids=["worker", "here"])
def test_a_constraint_whose_first_mask_is_slow_is_refused(tokenizer, isolated):
    """(a*)* 500 times compiles in milliseconds, but its first token mask takes over a second (every step of the
    batch would wait for its masks)."""
    backend = GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, isolated=isolated)
    try:
        with pytest.raises(GrammarError, match=r"^regex: the constraint's first token mask took \d+\.\d\d s to "
                                               r"compute \(the most is 0.5 s"):
            backend.compile(StructuredOutputsParams(regex="(a*)*" * 500))
    finally:
        backend.close()


@pytest.mark.parametrize("serialize_s_per_byte", [0.0, float("inf")], ids=["passed-back", "compiled-again"])
def test_a_workers_grammar_masks_as_one_compiled_here(tokenizer, serialize_s_per_byte):
    """Both ways a compile comes back (the worker's grammar serialized, or 'it fits' and compiled again here) mask
    every spec exactly as a compile in this process, after a prefix of its output."""
    here = GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, isolated=False)
    there = GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, timeout_s=59.0)  # its own pool
    there._workers.serialize_s_per_byte = serialize_s_per_byte
    try:
        for spec, prefix in zip(SPECS, PREFIXES):
            assert (masks(here, spec, prefix) == masks(there, spec, prefix)).all(), spec
        with pytest.raises(GrammarError, match=r"^regex: Regex parsing error at position 4"):  # xgrammar's own error
            there.compile(StructuredOutputsParams(regex="a(b"))
    finally:
        there.close()


@pytest.mark.parametrize("command", [["/nonexistent/python"], [sys.executable, "-c", "pass"]],
                         ids=["cannot-exec", "exits-at-once"])
def test_without_a_worker_compiles_run_here_and_say_so(monkeypatch, tokenizer, caplog, command):
    monkeypatch.setattr(CompileWorker, "command", command)
    with caplog.at_level(logging.WARNING, logger="deltaserve"):  # bounds of its own: a pool with no worker yet
        backend = GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, timeout_s=57.0)
        assert masks(backend, SPECS[2], "m").any()
        assert masks(backend, SPECS[1], "ab").any()
    assert backend._workers is None
    assert sum("without bounds of time or memory" in r.message for r in caplog.records) == 1


def test_backends_of_one_vocabulary_share_workers_and_the_last_closes_them(tokenizer):
    make = lambda: GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, timeout_s=58.0)  # noqa: E731
    first, second = make(), make()
    assert first._workers is second._workers
    first.compile(SPECS[2])
    second.compile(SPECS[3])  # on the worker the first left idle
    [worker] = first._workers._idle
    first.close()
    assert worker.alive() and second.compile(SPECS[0])
    del second
    gc.collect()  # a backend collected lets go as close does
    assert not worker.alive()
