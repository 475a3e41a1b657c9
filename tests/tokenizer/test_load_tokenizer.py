import pytest

from deltaserve.tokenizer import Tokenizer, TokenizerError, load_tokenizer


def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def test_loads_tokenizer_json(trained):
    assert isinstance(load_tokenizer(str(trained[0])), Tokenizer)


def test_missing_folder(tmp_path):
    with pytest.raises(TokenizerError, match=r"model folder .*nowhere does not exist or is not a folder; check --mo"):
        load_tokenizer(tmp_path / "nowhere")


def test_tiktoken_only(tmp_path):
    (tmp_path / "tiktoken.model").write_text("")
    with pytest.raises(TokenizerError, match=r"tiktoken.model: tiktoken tokenizers are not supported .* add a tokeni"):
        load_tokenizer(tmp_path)


def test_config_without_vocabulary(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json has no vocabulary beside it \(expected tokenizer"):
        load_tokenizer(tmp_path)
