import json

import pytest

from deltaserve.tokenizer import TokenizerError
from deltaserve.tokenizer.tokenizer_config import AddedToken, TokenizerConfig, load_tokenizer_config


def _write(tmp_path, config) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))


def test_absent_files_give_empty_config(tmp_path):
    expected = TokenizerConfig(chat_template_origin=str(tmp_path / "tokenizer_config.json"))
    assert load_tokenizer_config(tmp_path) == expected


def test_fields_in_both_forms(tmp_path):
    _write(tmp_path, {
        "bos_token": "[BOS]",
        "eos_token": {"content": "[EOS]", "__type": "AddedToken"},
        "model_max_length": 1048576,
        "added_tokens_decoder": {"7": {"content": "[BOS]", "special": True}, "8": {"content": "x y"}},
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    })
    config = load_tokenizer_config(tmp_path)
    assert (config.bos_token, config.eos_token, config.pad_token) == ("[BOS]", "[EOS]", None)
    assert config.model_max_length == 1048576 and config.chat_template == "D"
    assert config.added_tokens == {7: AddedToken("[BOS]", True), 8: AddedToken("x y", False)}
    assert config.special_token_strings() == {"bos_token": "[BOS]", "eos_token": "[EOS]"}


@pytest.mark.parametrize("value, expected", [(int(1e30), None), (1e30, None), (4096.0, 4096), (None, None)])
def test_model_max_length(tmp_path, value, expected):
    _write(tmp_path, {"model_max_length": value})
    assert load_tokenizer_config(tmp_path).model_max_length == expected


def test_chat_template_file_wins(tmp_path):
    _write(tmp_path, {"chat_template": "from config"})
    (tmp_path / "chat_template.jinja").write_text("from file")
    config = load_tokenizer_config(tmp_path)
    assert config.chat_template == "from file"
    assert config.chat_template_origin == str(tmp_path / "chat_template.jinja")


@pytest.mark.parametrize("content", ["", " \n"])
def test_empty_chat_template_file_is_named(tmp_path, content):
    """chat_template.jinja wins over the config's template: an empty one would silently leave the model none."""
    _write(tmp_path, {"chat_template": "from config"})
    (tmp_path / "chat_template.jinja").write_text(content)
    with pytest.raises(TokenizerError, match=r"chat_template.jinja is empty; write the chat template into it, or "
                                             r"delete it to use tokenizer_config.json's chat_template"):
        load_tokenizer_config(tmp_path)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"bos_token": 5}, r"bos_token = 5, expected a string or \{\"content\": string\}"),
        ({"eos_token": {"content": None}}, r"eos_token = \{'content': None\}, expected a string"),
        ({"model_max_length": -1}, r"model_max_length = -1, expected a positive integer"),
        ({"model_max_length": 1}, r"model_max_length = 1, expected a positive integer \(>= 2"),
        ({"model_max_length": 1.5}, r"model_max_length = 1.5, expected a positive integer"),
        ({"model_max_length": "4096"}, r"model_max_length = '4096', expected a positive integer"),
        ({"model_max_length": True}, r"model_max_length = True, expected a positive integer"),
        ({"chat_template": 5}, r"chat_template = 5, expected a string or a list with a \{\"name\": \"default\""),
        ({"chat_template": [{"name": "rag", "template": "R"}]}, r"chat_template = \[\{'name': 'rag'"),
        ({"added_tokens_decoder": []}, r"added_tokens_decoder is a list, expected an object"),
        ({"added_tokens_decoder": {"x": {"content": "a"}}}, r"added_tokens_decoder key 'x' is not a token id"),
        ({"added_tokens_decoder": {"1": {"content": ""}}}, r"added_tokens_decoder\['1'\] = \{'content': ''\}, exp"),
        ({"added_tokens_decoder": {"1": {"content": "a", "special": "yes"}}}, r"added_tokens_decoder\['1'\]"),
        ({"added_tokens_decoder": {"1": "a"}}, r"added_tokens_decoder\['1'\] = 'a', expected"),
    ],
)
def test_bad_entries(tmp_path, config, message):
    _write(tmp_path, config)
    with pytest.raises(TokenizerError, match=message) as info:
        load_tokenizer_config(tmp_path)
    assert str(info.value).startswith(str(tmp_path / "tokenizer_config.json"))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"bos_token": "<s>",}', r"is not valid JSON \(Expecting property name enclosed in double quotes at line 1"),
        ('"just a string"', r"holds a JSON str, expected an object"),
    ],
)
def test_corrupt_config(tmp_path, content, message):
    (tmp_path / "tokenizer_config.json").write_text(content)
    with pytest.raises(TokenizerError, match=message) as info:
        load_tokenizer_config(tmp_path)
    assert str(tmp_path / "tokenizer_config.json") in str(info.value) and "re-download" in str(info.value)
