"""GrammarBackend on the demo model's tokenizer: the traps of xgrammar 0.2.8 that it must avoid."""

import sys
from pathlib import Path

import pytest

from deltaserve.entrypoints.llm import BUNDLED_MODEL
from deltaserve.kernels.token_bitmask import unpack_bitmask
from deltaserve.sampling_params import StructuredOutputsParams
from deltaserve.structured import GrammarError, StructuredOutputsUnavailable
from deltaserve.structured.backend import GrammarBackend, utf8_possible
from deltaserve.tokenizer import load_tokenizer

pytest.importorskip("xgrammar", reason="the structured extra is part of the test extra")
EXTRA_IDS = 64  # the model's vocabulary past the tokenizer's, as padded embeddings have


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUNDLED_MODEL)


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, tokenizer.vocab_size + EXTRA_IDS, tokenizer.eos_token_ids)


def allowed_after(backend, spec: StructuredOutputsParams, text: str) -> list[int]:
    """The token ids the grammar allows after the output `text`."""
    matcher = backend.matcher(backend.compile(spec))
    assert matcher.accept_string(text)
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, backend.vocab_size)[0].nonzero().flatten().tolist()


def test_special_tokens_and_ids_past_the_tokenizer_are_never_allowed_inside_a_string(backend, tokenizer):
    allowed = allowed_after(backend, StructuredOutputsParams(json={"type": "string"}), '"abc')
    assert len(allowed) > 1000  # most text tokens may continue a string
    assert not set(allowed) & set(tokenizer.all_special_ids)
    assert max(allowed) < tokenizer.vocab_size


def test_the_stop_token_ends_a_complete_output_and_only_then(backend, tokenizer):
    spec = StructuredOutputsParams(choice=["yes", "no"])
    assert set(allowed_after(backend, spec, "yes")) == set(tokenizer.eos_token_ids)
    assert not set(allowed_after(backend, spec, "ye")) & set(tokenizer.eos_token_ids)


def test_whitespace_is_bounded(backend, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    allowed = allowed_after(backend, StructuredOutputsParams(json=schema), "{")
    assert allowed and all(tokenizer.id_to_bytes(t).startswith(b'"') for t in allowed)
    after_colon = allowed_after(backend, StructuredOutputsParams(json=schema), '{"a": ')
    assert not any(tokenizer.id_to_bytes(t).startswith(b" ") for t in after_colon)


@pytest.mark.parametrize("value", [False, True])
def test_vllms_options_are_taken_and_change_nothing(backend, value):
    """disable_any_whitespace, disable_additional_properties, disable_fallback: what is compiled meets either."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=value, disable_additional_properties=value,
                                   disable_fallback=value)
    assert spec.key == StructuredOutputsParams(json=schema).key
    assert allowed_after(backend, spec, '{"a": 1') == allowed_after(backend, StructuredOutputsParams(json=schema),
                                                                     '{"a": 1')


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputsParams(regex="a(b"), r"^regex: Regex parsing error at position 4: The parenthesis is not closed"),
    (StructuredOutputsParams(grammar="root ::= foo"), r'^grammar: EBNF parser error .*Rule "foo" is not defined'),
    (StructuredOutputsParams(json={"type": 3}), r"^json: Type should be a string"),
    (StructuredOutputsParams(json={"$ref": "#"}), r"^json: the constraint admits no output"),
    (StructuredOutputsParams(grammar="root ::= root"), r"^grammar: the constraint admits no output"),
])
def test_xgrammar_errors_are_one_clear_line(backend, spec, message):
    with pytest.raises(GrammarError, match=message) as err:
        backend.compile(spec)
    text = str(err.value)
    assert "\n" not in text and "/project" not in text and ".cc:" not in text and "Check failed" not in text
    assert err.value.param == spec.key[0]


def test_without_xgrammar_the_error_names_the_extra(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now raises ImportError
    with pytest.raises(StructuredOutputsUnavailable, match=r"pip install 'deltaserve\[structured\]'"):
        GrammarBackend(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def test_the_server_and_the_cli_start_without_importing_xgrammar():
    import subprocess

    code = ("import sys, deltaserve.entrypoints.cli, deltaserve.entrypoints.openai.api_server, deltaserve.core.engine;"
            "assert 'xgrammar' not in sys.modules and 'transformers' not in sys.modules, 'imported at start-up'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("token, possible", [
    (b"abc", True), (b"", True), (b"\xc3\xa9", True), (b"a\xc3", True), (b"a\xe0", True), (b"\xe0\xa0", True),
    (b"\xa9bc", True), (b"\x80\x80\x80a", True),  # the rest of a character an earlier token began
    (b"a\xc0", False), (b"\xc1\xa1", False), (b"a\xe0\x80", False), (b"\xf0\x8f", False),  # overlong
    (b"\xed\xa0", False), (b"\xf4\x90", False), (b"\xf5", False), (b"\x80\x80\x80\x80", False), (b"\xc3a", False),
])
def test_utf8_possible(token, possible):
    assert utf8_possible(token) is possible


@pytest.fixture(scope="module")
def kimi_backend(tmp_path_factory):
    """The backend over a vocabulary of the published Kimi tokenizer's size, whose byte-level merges hold bytes no
    UTF-8 text has (the demo model's tokenizer has none, so it cannot show the trap below)."""
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from helpers.kimi_tokenizer import PUBLISHED_NUM_RANKS, synthetic_ranks, write_kimi_files

    folder = tmp_path_factory.mktemp("kimi")
    write_kimi_files(folder, synthetic_ranks(PUBLISHED_NUM_RANKS))
    kimi = load_tokenizer(folder)
    return GrammarBackend(kimi, kimi.vocab_size, kimi.eos_token_ids), kimi


@pytest.mark.parametrize("spec, text", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string", "maxLength": 400}}}),
     '{"a": "'),
    (StructuredOutputsParams(regex="[a-z ]{1,400}"), "ab"),
    (StructuredOutputsParams(regex="\\w{1,300}"), ""),
])
def test_every_token_the_mask_allows_in_a_long_bounded_repetition_is_accepted(kimi_backend, spec, text):
    """xgrammar 0.2.8's mask in a bounded repetition of more than 128 allows tokens holding bytes no UTF-8 text has
    (an overlong 0xE0 0x80, a 0xC0), which its matcher then refuses; text_safe_bitmask takes them out. Tokens ending
    in a lone 0xE0 or 0xF0 lead byte are the known rest (see the backend's docstring)."""
    backend, kimi = kimi_backend
    matcher = backend.matcher(backend.compile(spec))
    assert matcher.accept_string(text)
    bitmask = backend.allocate_bitmask(1)
    backend.fill([matcher], bitmask)
    unsafe = unpack_bitmask(bitmask & ~backend.text_safe_bitmask, backend.vocab_size)[0].nonzero().flatten().tolist()
    assert unsafe, "xgrammar's mask allows tokens no UTF-8 text has (if not, this xgrammar fixed it)"
    allowed = unpack_bitmask(bitmask & backend.text_safe_bitmask, backend.vocab_size)[0].nonzero().flatten().tolist()
    refused = []
    for token in allowed:
        if matcher.accept_token(token):
            matcher.rollback(1)
        else:
            refused.append(kimi.id_to_bytes(token))
    assert len(allowed) > 1000 and [t for t in refused if t[-1:] not in (b"\xe0", b"\xf0")] == []
