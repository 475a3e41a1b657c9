import base64

import pytest

from deltaserve.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from deltaserve.tokenizer.tiktoken_kimi import KimiTokenizer


def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def test_loads_tokenizer_json(trained):
    assert isinstance(load_tokenizer(str(trained[0])), Tokenizer)


def test_missing_folder(tmp_path):
    with pytest.raises(TokenizerError, match=r"model folder .*nowhere does not exist or is not a folder; check --mo"):
        load_tokenizer(tmp_path / "nowhere")


def test_tiktoken_only(tmp_path):
    lines = (f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    (tmp_path / "tiktoken.model").write_text("".join(lines))
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, KimiTokenizer) and tokenizer.vocab_size == 512


def test_config_without_vocabulary(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json has no vocabulary beside it \(expected tokenizer"):
        load_tokenizer(tmp_path)


def test_model_vocabulary_may_be_larger_than_the_tokenizer(tokenizer):
    tokenizer.check_model_vocab(tokenizer.vocab_size, "m")  # every id a row of the embedding
    tokenizer.check_model_vocab(tokenizer.vocab_size + 64, "m")  # Kimi pads its embedding


def test_tokenizer_with_ids_beyond_the_model_vocabulary_is_refused(tokenizer):
    with pytest.raises(TokenizerError, match=rf"the tokenizer files in m do not belong to this model \(ids up to "
                                             rf"{tokenizer.vocab_size - 1}, model vocabulary 512"):
        tokenizer.check_model_vocab(512, "m")


def test_kimi_tokenizer_special_ids_count(tmp_path):
    """The 256 reserved special ids follow the ranks: a 256-rank tokenizer needs a model vocabulary of 512."""
    lines = (f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    (tmp_path / "tiktoken.model").write_text("".join(lines))
    tokenizer = load_tokenizer(tmp_path)
    tokenizer.check_model_vocab(512, "m")
    with pytest.raises(TokenizerError, match=r"ids up to 511, model vocabulary 511"):
        tokenizer.check_model_vocab(511, "m")
