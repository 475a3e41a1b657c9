"""GrammarBackend on the demo model's tokenizer: the traps of xgrammar 0.2.8 that it must avoid."""

import sys

import pytest

from deltaserve.entrypoints.llm import BUNDLED_MODEL
from deltaserve.kernels.token_bitmask import unpack_bitmask
from deltaserve.sampling_params import StructuredOutputsParams
from deltaserve.structured import GrammarError, StructuredOutputsUnavailable
from deltaserve.structured.backend import GrammarBackend
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
