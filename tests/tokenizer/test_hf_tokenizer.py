import json
import random

import pytest

from deltaserve.tokenizer import TokenizerError, load_tokenizer
from deltaserve.tokenizer.hf import BATCH_ENCODE_CHARS, HFTokenizer
from deltaserve.tokenizer.train import BOS, EOS, IM_END, IM_START, PAD

ROUND_TRIP_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキスト、中文分词，한국어 텍스트",
    "emoji 🙂🚀 family 👨‍👩‍👧 skin 👍🏽 flag 🇯🇵",
    "   leading, inner     runs\n\n\n\t\ttabs  and trailing   ",
    "\x00\x01 control bytes \x7f and é ü ß",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_long_text_encodes_the_same_through_the_batch_path(tokenizer, add_special_tokens):
    """From BATCH_ENCODE_CHARS characters the text goes through encode_batch (which gives up the GIL): the same ids
    as encode, on either side of the threshold, specials inside the text included."""
    body = "".join(ROUND_TRIP_TEXTS) + f"{IM_START}user\n{IM_END}"
    for length in (BATCH_ENCODE_CHARS - 1, BATCH_ENCODE_CHARS, 3 * BATCH_ENCODE_CHARS + 7):
        text = (body * (length // len(body) + 1))[:length]
        expected = tokenizer._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


def test_special_tokens_round_trip_and_skip(tokenizer):
    text = f"{IM_START}user\nhi 日本{IM_END}\n{BOS}{EOS}{PAD}"
    ids = tokenizer.encode(text)
    assert [i for i in ids if i in tokenizer.all_special_ids] == [
        tokenizer.token_to_id(t) for t in (IM_START, IM_END, BOS, EOS, PAD)
    ]
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi 日本\n"


def test_plain_text_never_gives_special_ids(tokenizer):
    rng = random.Random(0)
    alphabet = "<|>_imstartendbospad \n日🙂"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        if any(token in text for token in (BOS, EOS, IM_START, IM_END, PAD)):
            continue
        assert not set(tokenizer.encode(text)) & tokenizer.all_special_ids, text
    assert not set(tokenizer.encode("<|im_end| <|im_end >|> <|pad")) & tokenizer.all_special_ids


def test_id_to_bytes_joins_to_decode(tokenizer):
    text = "bytes of 日本 and 🙂 and <|im_end|>"
    ids = tokenizer.encode(text)
    assert b"".join(map(tokenizer.id_to_bytes, ids)).decode() == text
    assert tokenizer.id_to_bytes(tokenizer.vocab_size) == b"" and tokenizer.id_to_bytes(-1) == b""


def test_decode_skips_ids_outside_the_vocabulary(tokenizer):
    # tokenizers skips ids past the vocabulary but raised OverflowError for a negative one or one past 2**32
    h = tokenizer.encode("H")
    for outside in (tokenizer.vocab_size, -1, 2**32, 2**70):
        assert tokenizer.decode([outside, *h]) == "H", outside


def test_encode_refuses_unpaired_surrogates(tokenizer):
    # tokenizers raised TypeError("TextInputSequence must be str"), which named neither the text nor the fix
    with pytest.raises(TokenizerError, match=r"unpaired UTF-16 surrogate \('\\ud800'\) at character 3"):
        tokenizer.encode("ab😀\ud800c", add_special_tokens=True)
    assert tokenizer.decode(tokenizer.encode("ab\U0001f600c")) == "ab😀c"


def test_properties(tokenizer, trained):
    ids = trained[1]
    assert tokenizer.vocab_size == ids.vocab_size
    assert tokenizer.bos_token_id == ids.bos_token_id
    assert tokenizer.eos_token_ids == (ids.eos_token_id, ids.im_end_id)
    assert tokenizer.all_special_ids == {ids.bos_token_id, ids.eos_token_id, ids.pad_token_id, ids.im_start_id,
                                         ids.im_end_id}
    assert tokenizer.model_max_length == 4096


def test_without_config_has_no_specials_named(model_dir):
    (model_dir / "tokenizer_config.json").unlink()
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.bos_token_id is None and tokenizer.eos_token_ids == ()
    assert tokenizer.model_max_length is None and tokenizer.chat_template is None
    assert len(tokenizer.all_special_ids) == 5  # tokenizer.json still marks them special


def test_encode_rejects_non_text(tokenizer):
    with pytest.raises(TokenizerError, match="encode takes a str, got list"):
        tokenizer.encode([1, 2])


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer.json does not exist; re-download"):
        HFTokenizer(tmp_path)


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"version": "1.0", "model": ', r"tokenizer.json is not valid JSON \(Expecting value at line 1"),
        (b"[1, 2]", r"tokenizer.json holds a JSON list, expected an object"),
        (b"\xff\xfe{}", r"tokenizer.json is not UTF-8 text"),
        (b'{"decoder": {"type": "ByteLevel"}}', r"tokenizer.json is not a tokenizer the tokenizers library can load"),
        (b'{"decoder": {"type": "Metaspace"}}', r"decoder type 'Metaspace' is not supported, expected 'ByteLevel'"),
        (b'{"decoder": null}', r"decoder type None is not supported"),
    ],
)
def test_corrupt_tokenizer_json(model_dir, content, message):
    (model_dir / "tokenizer.json").write_bytes(content)
    with pytest.raises(TokenizerError, match=message) as info:
        load_tokenizer(model_dir)
    assert str(model_dir / "tokenizer.json") in str(info.value)


def _edit_config(model_dir, **changes):
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_special_token_missing_from_vocab(model_dir):
    _edit_config(model_dir, eos_token="</s>")
    with pytest.raises(TokenizerError, match=r"eos_token = '</s>' is not in the vocabulary; set it to a token"):
        load_tokenizer(model_dir)


def test_added_token_id_disagrees_with_vocab(model_dir, trained):
    _edit_config(model_dir, added_tokens_decoder={"5": {"content": IM_END, "special": True}})
    with pytest.raises(TokenizerError, match=rf"'<\|im_end\|>' has id 5 there but {trained[1].im_end_id} in the"):
        load_tokenizer(model_dir)


def test_added_tokens_outside_the_byte_alphabet(model_dir):
    import tokenizers

    raw = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    raw.add_tokens(["a b é", "ĀĠ"])  # raw UTF-8 (a space is not in the alphabet), and two byte-level characters
    raw.save(str(model_dir / "tokenizer.json"))
    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.encode("x a b é y ĀĠ")
    assert [tokenizer.id_to_bytes(i) for i in ids[-1:]] == [b"\x00 "]
    assert b"".join(map(tokenizer.id_to_bytes, ids)).decode() == tokenizer.decode(ids) == "x a b é y \x00 "


def test_encode_prompt_adds_the_post_processors_bos_to_text_but_not_to_a_rendered_chat(model_dir, tmp_path_factory):
    from helpers.engine import with_bos

    tokenizer = load_tokenizer(with_bos(model_dir, tmp_path_factory.mktemp("bos") / "tokenizer"))
    bos = tokenizer.bos_token_id
    assert tokenizer.encode_prompt("hi")[0] == bos
    chat = tokenizer.encode_prompt(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert chat[0] == bos and chat.count(bos) == 1
