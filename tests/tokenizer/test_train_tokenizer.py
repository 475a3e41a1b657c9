import json

import pytest

from deltaserve.tokenizer import TokenizerError, load_tokenizer
from deltaserve.tokenizer.train import SPECIAL_TOKENS, train_tiny_tokenizer


def test_deterministic(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    assert train_tiny_tokenizer(first, 700) == train_tiny_tokenizer(second, 700)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()


@pytest.mark.parametrize("vocab_size", [261, 300, 100_000])
def test_ids_fit_the_vocab(tmp_path, vocab_size):
    ids = train_tiny_tokenizer(tmp_path, vocab_size)
    tokenizer = load_tokenizer(tmp_path)
    special = (ids.bos_token_id, ids.eos_token_id, ids.pad_token_id, ids.im_start_id, ids.im_end_id)
    assert tokenizer.vocab_size == ids.vocab_size <= vocab_size
    assert sorted(special) == list(range(ids.vocab_size - len(SPECIAL_TOKENS), ids.vocab_size))
    assert [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS] == [
        ids.bos_token_id, ids.eos_token_id, ids.im_start_id, ids.im_end_id, ids.pad_token_id
    ]


def test_small_vocab_is_filled(tmp_path):
    assert train_tiny_tokenizer(tmp_path, 300).vocab_size == 300


def test_config_written(trained):
    folder, ids = trained
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert config["model_max_length"] == 4096 and "<|im_start|>" in config["chat_template"]
    assert config["added_tokens_decoder"][str(ids.im_end_id)]["content"] == "<|im_end|>"


def test_own_texts(tmp_path):
    ids = train_tiny_tokenizer(tmp_path, 1000, texts=["aaaa bbbb aaaa"])
    tokenizer = load_tokenizer(tmp_path)
    assert ids.vocab_size < 300 and tokenizer.encode("aaaa") == [tokenizer.token_to_id("aaaa")]


@pytest.mark.parametrize(
    "vocab_size, texts, message",
    [
        (260, None, r"vocab_size = 260, expected an integer >= 261 \(256 bytes \+ 5 special tokens\); raise it"),
        ("512", None, r"vocab_size = '512', expected an integer"),
        (512, "one text", r"texts = 'one text', expected a non-empty list of strings"),
        (512, [], r"texts = \[\], expected a non-empty list of strings"),
        (512, ["ok", None], r"texts = \['ok', None\], expected"),
    ],
)
def test_bad_arguments(tmp_path, vocab_size, texts, message):
    with pytest.raises(TokenizerError, match=message):
        train_tiny_tokenizer(tmp_path, vocab_size, texts)
