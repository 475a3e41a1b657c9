import random

import pytest

from deltaserve.tokenizer import IncrementalDetokenizer, TokenizerError

MULTI_BYTE_TEXT = "naïve café 日本語のテキスト 你好，世界！ 🙂🚀 👨‍👩‍👧 👍🏽 € ✓"


def _stream(tokenizer, ids, prompt=(), chunk_sizes=None, **kwargs):
    """(deltas, detokenizer) after pushing ids in chunks (one id each by default) and finishing."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), **kwargs)
    sizes = iter(chunk_sizes or [])
    deltas, i = [], 0
    while i < len(ids):
        size = next(sizes, 1)
        deltas.append(detok.push(ids[i : i + size]))
        i += size
    deltas.append(detok.finish())
    return deltas, detok


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_equal_full_decode(tokenizer, skip_special_tokens):
    rng = random.Random(1)
    for _ in range(200):
        # ids past the tokenizer's vocabulary (the model's may be larger) decode to nothing
        ids = [rng.randrange(tokenizer.vocab_size + 8) for _ in range(rng.randint(0, 30))]
        chunks = [rng.randint(1, 4) for _ in ids]
        deltas, detok = _stream(tokenizer, ids, chunk_sizes=chunks, skip_special_tokens=skip_special_tokens)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == detok.output_text == expected


def test_split_characters_never_emit_replacement(tokenizer):
    ids = tokenizer.encode(MULTI_BYTE_TEXT)
    split = [i for i in ids if _is_partial_utf8(tokenizer.id_to_bytes(i))]
    assert split, "the test needs tokens that end inside a character"
    deltas, detok = _stream(tokenizer, ids, prompt=tokenizer.encode("Say it: "))
    assert "".join(deltas) == detok.output_text == MULTI_BYTE_TEXT
    assert not any("\ufffd" in delta for delta in deltas)


def test_character_split_into_single_bytes(tokenizer, byte_ids):
    ids = [byte_ids[b] for b in "🙂".encode()]
    deltas, _ = _stream(tokenizer, ids)
    assert deltas == ["", "", "", "🙂", ""]


def test_character_begun_by_the_prompt(tokenizer, byte_ids):
    emoji = [byte_ids[b] for b in "x🙂".encode()]
    deltas, detok = _stream(tokenizer, emoji[3:], prompt=emoji[:3])
    assert deltas == ["", "🙂", ""] and detok.output_text == "🙂"


def test_unfinished_character_at_finish_is_replaced(tokenizer, byte_ids):
    ids = [byte_ids[ord("a")], *(byte_ids[b] for b in "日".encode()[:2])]
    deltas, _ = _stream(tokenizer, ids)
    assert deltas == ["a", "", "", "\ufffd"] and "".join(deltas) == tokenizer.decode(ids)


def test_stop_string_held_back_and_cut(tokenizer, byte_ids):
    ids = [byte_ids[ord(c)] for c in "zzabcz"]
    deltas, detok = _stream(tokenizer, ids, stop=["abc"])
    assert deltas == ["", "", "z", "z", "", "", ""]
    assert detok.stopped == "abc" and detok.output_text == "zz"


def test_stop_string_kept_when_asked(tokenizer, byte_ids):
    ids = [byte_ids[ord(c)] for c in "zzabcz"]
    deltas, detok = _stream(tokenizer, ids, stop=["abc"], include_stop_str_in_output=True)
    assert deltas == ["", "", "z", "z", "abc", "", ""] and detok.output_text == "zzabc"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tokenizer, include):
    text = "The river ran slowly past the old mill, and then 日本語 came"
    ids = tokenizer.encode(text)
    for stop in ("slowly past", "mill, and", "日本", "語 c"):
        deltas, detok = _stream(tokenizer, ids, stop=[stop, "never there"], include_stop_str_in_output=include)
        end = text.index(stop) + (len(stop) if include else 0)
        assert detok.stopped == stop and "".join(deltas) == detok.output_text == text[:end]


def test_stop_found_at_the_same_place_however_chunked(tokenizer, byte_ids):
    ids = [byte_ids[ord(c)] for c in "xabcd"]
    for chunks in ([1] * 5, [5], [2, 3]):
        _, detok = _stream(tokenizer, ids, chunk_sizes=chunks, stop=["abcd", "bc"])
        assert (detok.stopped, detok.output_text) == ("bc", "xa")


def test_stop_on_special_token_text(tokenizer):
    ids = tokenizer.encode("done<|im_end|>more")
    _, detok = _stream(tokenizer, ids, skip_special_tokens=False, stop=["<|im_end|>"])
    assert detok.output_text == "done"
    _, detok = _stream(tokenizer, ids, skip_special_tokens=True, stop=["<|im_end|>"])
    assert detok.stopped is None and detok.output_text == "donemore"


def test_push_after_stop_gives_nothing(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["b"])
    assert detok.push(tokenizer.encode("abc")) == "a"
    assert detok.push(tokenizer.encode("def")) == "" and detok.finish() == "" and detok.output_text == "a"


def test_finish_flushes_held_back_text(tokenizer):
    deltas, detok = _stream(tokenizer, tokenizer.encode("ends with xy"), stop=["xyz"])
    assert detok.stopped is None and "".join(deltas) == "ends with xy" and deltas[-1] == "xy"


def _stop_read_char_by_char(text: str, stop: list[str], end_after: int) -> tuple[int, str] | None:
    """The slow twin of the stop search: (start, stop string) of the first one a reader of text, one character at a
    time, sees end past text[:end_after] (the longest of those ending there)."""
    for end in range(end_after + 1, len(text) + 1):
        for s in sorted(stop, key=len, reverse=True):
            if text[:end].endswith(s):
                return end - len(s), s
    return None


def test_min_tokens_stop_strings_end_after_the_first_tokens_text_as_a_char_by_char_twin(tokenizer, byte_ids):
    """vLLM's rule: a stop string counts only where it ends in text after that of the first min_tokens tokens (it
    may begin inside it), wherever the pushes split the tokens."""
    rng = random.Random(3)
    for _ in range(300):
        text = "".join(rng.choice("ab_") for _ in range(rng.randint(0, 14)))
        stop = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        min_tokens, include = rng.randint(0, len(text) + 1), rng.random() < 0.5
        ids = [byte_ids[ord(c)] for c in text]  # one character a token
        chunks = [rng.randint(1, 4) for _ in ids]
        deltas, detok = _stream(tokenizer, ids, chunk_sizes=chunks, stop=stop, include_stop_str_in_output=include,
                                min_tokens=min_tokens)
        found = _stop_read_char_by_char(text, stop, min_tokens)
        end = len(text) if found is None else found[0] + (len(found[1]) if include else 0)
        assert (detok.stopped, "".join(deltas)) == (found and found[1], text[:end]), (text, stop, min_tokens)


def test_min_tokens_counts_a_character_ended_by_the_next_token_as_after(tokenizer, byte_ids):
    """A character whose bytes the min_tokens-th token begins and a later one ends comes out after it (as vLLM's
    incremental decode emits it), so a stop string ending there counts."""
    ids = [byte_ids[b] for b in "日x".encode()]
    for min_tokens, stopped in ((2, "日"), (3, None)):
        _, detok = _stream(tokenizer, ids, stop=["日"], min_tokens=min_tokens)
        assert detok.stopped == stopped


@pytest.mark.parametrize("stop", [[""], "abc", ["ok", 3], 5])
def test_bad_stop(tokenizer, stop):
    with pytest.raises(TokenizerError, match=r"stop = .*, expected a list of non-empty strings"):
        IncrementalDetokenizer(tokenizer, [], stop=stop)


def _is_partial_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return True
    return False
