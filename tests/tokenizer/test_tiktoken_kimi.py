import json
import random
import shutil

import pytest
from helpers.kimi_tokenizer import (
    NAMED_SPECIAL_OFFSETS,
    PUBLISHED_NUM_RANKS,
    synthetic_ranks,
    write_kimi_files,
    write_kimi_tokenizer,
)

from deltaserve.tokenizer import ChatTemplateError, IncrementalDetokenizer, TokenizerError, load_tokenizer
from deltaserve.tokenizer.tiktoken_kimi import _MAX_ENCODE_CHARS, _MAX_RUN_CHARS, KimiTokenizer, _pieces

ROUND_TRIP_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "日本語のテキスト、中文分词，한국어 텍스트 and HELLOworld don't I'LL",
    "emoji 🙂🚀 family 👨‍👩‍👧 skin 👍🏽 flag 🇯🇵",
    "   leading, inner     runs\n\n\n\t\ttabs  and trailing   ",
    "\x00\x01 control bytes \x7f and é ü ß, numbers 1234567 3.14159",
    "",
]
# tokenization_kimi.py's pat_str, restated here as the oracle the encoder is checked against
PUBLISHED_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
WEATHER_TOOL = {"function": {"description": "Weather now.", "name": "get_weather",
                             "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"}},
                "type": "function"}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18°C, sunny"},
]


@pytest.fixture(scope="module")
def kimi_files(tmp_path_factory):
    """(folder, first special id) of synthetic Kimi files with ranks trained on sample text."""
    folder = tmp_path_factory.mktemp("kimi_tokenizer")
    return folder, write_kimi_tokenizer(folder)


@pytest.fixture(scope="module")
def kimi(kimi_files):
    return load_tokenizer(kimi_files[0])


@pytest.fixture
def kimi_dir(kimi_files, tmp_path):
    """A fresh copy of the files that a test may break."""
    shutil.copytree(kimi_files[0], tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_loads_and_sizes(kimi, kimi_files):
    first = kimi_files[1]
    assert isinstance(kimi, KimiTokenizer) and first == 3000
    assert kimi.vocab_size == first + 256
    assert kimi.model_max_length == 1048576


def test_special_token_ids(kimi, kimi_files):
    first = kimi_files[1]
    for offset, (token, _) in NAMED_SPECIAL_OFFSETS.items():
        assert kimi.token_to_id(token) == first + offset, token
    assert kimi.token_to_id(f"<|reserved_token_{first + 5}|>") == first + 5
    assert kimi.token_to_id(f"<|reserved_token_{first + 253}|>") == first + 253
    assert kimi.bos_token_id == first
    assert kimi.eos_token_ids == (first + 1, first + 2)  # [EOS] and <|im_end|>, which ends each chat turn


def test_skipped_ids_follow_the_config(kimi, kimi_files):
    first = kimi_files[1]
    tool_markers = set(range(first + 11, first + 16))  # "special": false in the published file
    assert kimi.all_special_ids == set(range(first, first + 256)) - tool_markers


def test_published_size_numbering(tmp_path):
    write_kimi_files(tmp_path, synthetic_ranks(PUBLISHED_NUM_RANKS))
    kimi = load_tokenizer(tmp_path)
    assert kimi.vocab_size == 163840
    expected = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
                "<|im_assistant|>": 163588, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
                "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
                "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599, "<|im_middle|>": 163601,
                "<|reserved_token_163600|>": 163600, "[UNK]": 163838, "[PAD]": 163839}
    assert {token: kimi.token_to_id(token) for token in expected} == expected
    assert kimi.eos_token_ids == (163585, 163586)


def test_special_ids_match_transformers(kimi, kimi_files):
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(kimi_files[0])
    first = kimi_files[1]
    names = [kimi.decode([i]) for i in range(first, first + 256)]
    assert reference.convert_tokens_to_ids(names) == list(range(first, first + 256))


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(kimi, text):
    ids = kimi.encode(text)
    assert kimi.decode(ids) == text
    assert b"".join(map(kimi.id_to_bytes, ids)) == text.encode()


def test_encodes_like_a_slow_byte_pair_twin(kimi, kimi_files):
    """The published pattern split with the `regex` module, then merged by lowest rank, pair by pair."""
    regex = pytest.importorskip("regex")
    split = regex.compile(PUBLISHED_PATTERN, flags=regex.V1)
    ranks = {kimi.id_to_bytes(i): i for i in range(kimi_files[1])}
    texts = [*ROUND_TRIP_TEXTS, " ".join(ROUND_TRIP_TEXTS) * 3, "CamelCaseWords ALLCAPS they're 中文English",
             "we've 12345678 don't 2024-05-06 IT'S you'll\n\n  x"]
    for text in texts:
        expected = [i for piece in split.findall(text) for i in _merge_by_rank(piece.encode(), ranks)]
        assert kimi.encode(text) == expected, text


def _merge_by_rank(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    if piece in ranks:
        return [ranks[piece]]  # tiktoken takes a piece that is one token whole, before merging
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        pair_ranks = [ranks.get(a + b, len(ranks)) for a, b in zip(parts, parts[1:])]
        best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
        if pair_ranks[best] == len(ranks):
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return [ranks[p] for p in parts]


def test_special_tokens_only_when_allowed(kimi, kimi_files):
    first = kimi_files[1]
    text = "<|im_user|>user<|im_middle|>hi 日本<|im_end|>[BOS]<|tool_call_begin|>"
    allowed = kimi.encode(text, add_special_tokens=True)
    assert [i for i in allowed if i >= first] == [first + 3, first + 17, first + 2, first, first + 13]
    assert kimi.decode(allowed) == text
    assert kimi.decode(allowed, skip_special_tokens=True) == "userhi 日本<|tool_call_begin|>"
    plain = kimi.encode(text)
    assert max(plain) < first and kimi.decode(plain) == text


def test_plain_text_never_gives_special_ids(kimi, kimi_files):
    rng = random.Random(0)
    alphabet = "<|>[]_imendBOSEtolcalsbgn \n日🙂"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        assert max(kimi.encode(text), default=0) < kimi_files[1], text


def test_id_to_bytes_outside_the_vocabulary(kimi):
    assert kimi.id_to_bytes(kimi.vocab_size) == b"" and kimi.id_to_bytes(-1) == b""
    assert kimi.decode([kimi.vocab_size, 72]) == "H"


def test_encode_refuses_unpaired_surrogates(kimi):
    # tiktoken had made the surrogate U+FFFD silently, where the tokenizers back end raised
    for add_special_tokens in (False, True):
        with pytest.raises(TokenizerError, match="unpaired UTF-16 surrogate"):
            kimi.encode("a\udfffb", add_special_tokens=add_special_tokens)


def test_token_to_id_of_vocabulary_tokens(kimi):
    token_id = kimi.encode(" the")[0]
    assert kimi.token_to_id(kimi.decode([token_id])) == token_id
    assert kimi.token_to_id("<|not_a_token|>") is None


def test_long_runs_are_cut_where_the_published_tokenizer_cuts(kimi):
    text = "a" * (_MAX_RUN_CHARS * 2 + 7) + " " * (_MAX_RUN_CHARS + 1) + "日本" + "\n" * 3
    assert list(_pieces(text)) == list(_published_pieces(text))
    assert kimi.decode(kimi.encode(text)) == text
    sliced = "x y " * (_MAX_ENCODE_CHARS // 4) + "tail"
    assert list(_pieces(sliced)) == list(_published_pieces(sliced))


def _published_pieces(text):
    """tokenization_kimi.py's cuts, restated character by character: the slow twin of _pieces."""
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        piece = text[start:start + _MAX_ENCODE_CHARS]
        run, is_space, begin = 0, piece[:1].isspace(), 0
        for i, char in enumerate(piece):
            if char.isspace() != is_space:
                run, is_space = 1, char.isspace()
            else:
                run += 1
                if run > _MAX_RUN_CHARS:
                    yield piece[begin:i]
                    begin, run = i, 1
        yield piece[begin:]


def test_incremental_detokenizer_streams_whole_characters(kimi):
    text = "日本語 🙂👨‍👩‍👧 and more 中文"
    prompt = kimi.encode(kimi.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=True)
    detokenizer = IncrementalDetokenizer(kimi, prompt, stop=["more 中"])
    deltas = [detokenizer.push([i]) for i in kimi.encode(text) + [kimi.token_to_id("<|im_end|>")]]
    assert "".join(deltas) == "日本語 🙂👨‍👩‍👧 and " and not any("\ufffd" in d for d in deltas)
    assert detokenizer.stopped == "more 中"


def test_single_turn_chat(kimi):
    expected = f"{SYSTEM}<|im_user|>user<|im_middle|>Hi 日本<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert kimi.apply_chat_template([{"role": "user", "content": "Hi 日本"}]) == expected


def test_multi_turn_chat(kimi):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}], "name": "bob"},
    ]
    assert kimi.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>4<|im_end|><|im_user|>bob<|im_middle|>And 3+3?<|im_end|>"
    )


def test_tool_chat(kimi):
    tools_json = json.dumps([WEATHER_TOOL], separators=(",", ":"))
    assert kimi.apply_chat_template(TOOL_CHAT, tools=[WEATHER_TOOL]) == (
        f"<|im_system|>tool_declare<|im_middle|>{tools_json}<|im_end|>{SYSTEM}"
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Let me look.<|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n18°C, sunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )


def test_tools_are_rendered_with_sorted_keys(kimi):
    unsorted = {"type": "function", "function": {"parameters": {"type": "object", "properties": {}},
                                                 "name": "get_weather", "description": "Weather now."}}
    rendered = kimi.apply_chat_template(TOOL_CHAT[:1], tools=[unsorted])
    assert '[{"function":{"description":"Weather now.","name":"get_weather","parameters":{"properties":{},' in rendered


def test_chats_match_transformers(kimi, kimi_files):
    transformers = pytest.importorskip("transformers")
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(kimi_files[0])
    chats = [([{"role": "user", "content": "Hi 日本"}], None), (TOOL_CHAT, [WEATHER_TOOL]),
             ([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], None)]
    for messages, tools in chats:
        for prompt in (True, False):
            expected = reference.apply_chat_template(messages, tools=tools, tokenize=False,
                                                     add_generation_prompt=prompt)
            assert kimi.apply_chat_template(messages, add_generation_prompt=prompt, tools=tools) == expected


def test_rendered_chat_encodes_to_role_ids(kimi, kimi_files):
    first = kimi_files[1]
    text = kimi.apply_chat_template(TOOL_CHAT, tools=[WEATHER_TOOL])
    ids = kimi.encode(text, add_special_tokens=True)
    assert ids[0] == first + 10 and ids.count(first + 2) == 5 and ids.count(first + 13) == 1
    assert kimi.decode(ids) == text


@pytest.mark.parametrize("source", ["{{ ''.__class__.__mro__ }}", "{{ cycler.__init__.__globals__ }}",
                                    "{{ messages.__class__.__base__.__subclasses__() }}"])
def test_template_cannot_reach_python_internals(kimi_dir, source):
    _edit_config(kimi_dir, chat_template=source)
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json tried an unsafe operation"):
        load_tokenizer(kimi_dir).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_cannot_read_files(kimi_dir):
    _edit_config(kimi_dir, chat_template="{% include '/etc/passwd' %}")
    with pytest.raises(ChatTemplateError, match=r"chat template in .*tokenizer_config.json failed: TypeError"):
        load_tokenizer(kimi_dir).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "line, message",
    [
        ("!!!! 3000", r"tiktoken.model line 3001: '!!!!' is not valid base64"),
        ("YWJj x", r"tiktoken.model line 3001: rank 'x' is not a non-negative integer"),
        ("YWJj -1", r"tiktoken.model line 3001: rank '-1' is not a non-negative integer"),
        ("YWJj", r"tiktoken.model line 3001: 'YWJj' has 1 fields, expected '<base64 token> <rank>'"),
        ("//79/A== 7", r"tiktoken.model line 3001: rank 7 is already on line 8; each rank may appear once"),
        ("//79/A== 3001", r"tiktoken.model: rank 3000 is missing; the 3001 ranks must be 0..3000"),
    ],
)
def test_malformed_tiktoken_line(kimi_dir, line, message):
    path = kimi_dir / "tiktoken.model"
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(kimi_dir)


def test_duplicate_token(kimi_dir):
    path = kimi_dir / "tiktoken.model"
    path.write_text(path.read_text() + "YQ== 3000\n")
    with pytest.raises(TokenizerError, match=r"tiktoken.model line 3001: token b'a' is already on line 98"):
        load_tokenizer(kimi_dir)


def test_missing_byte(kimi_dir):
    path = kimi_dir / "tiktoken.model"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:65] + [f"{lines[-1].split()[0]} 65"] + lines[66:-1]) + "\n")
    with pytest.raises(TokenizerError, match=r"tiktoken.model has no token for the single byte 0x41 \(1 bytes"):
        load_tokenizer(kimi_dir)


def test_empty_tiktoken_file(tmp_path):
    (tmp_path / "tiktoken.model").write_text("")
    with pytest.raises(TokenizerError, match=r"tiktoken.model holds no tokens"):
        load_tokenizer(tmp_path)


def test_config_id_outside_the_special_range(kimi_dir):
    config = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["3256"] = {"content": "<|extra|>", "special": True}
    (kimi_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: added_tokens_decoder has id 3256, outside the "
                                             r"special ids 3000..3255 that follow the 3000 tokens of tiktoken.model"):
        load_tokenizer(kimi_dir)


def test_config_names_one_token_twice(kimi_dir):
    config = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["3005"] = {"content": "<|im_end|>", "special": True}
    (kimi_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=r"special token '<\|im_end\|>' has two ids, 3002 and 3005"):
        load_tokenizer(kimi_dir)


def test_config_not_json(kimi_dir):
    (kimi_dir / "tokenizer_config.json").write_text('{\n  "bos_token": "[BOS]",\n}')
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json is not valid JSON \(.* at line 3, column 1\)"):
        load_tokenizer(kimi_dir)


def test_config_eos_not_in_vocabulary(kimi_dir):
    _edit_config(kimi_dir, eos_token="<|no_such_eos|>")
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: eos_token = '<\|no_such_eos\|>' is not in the"):
        load_tokenizer(kimi_dir)


def test_without_config_every_special_id_is_reserved(kimi_dir):
    (kimi_dir / "tokenizer_config.json").unlink()
    kimi = load_tokenizer(kimi_dir)
    assert kimi.token_to_id("<|reserved_token_3002|>") == 3002 and kimi.token_to_id("<|im_end|>") is None
    assert kimi.eos_token_ids == () and kimi.chat_template is None


def _edit_config(folder, **fields):
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize("add_special_tokens", [None, True, False])
def test_encode_prompt_parses_the_role_tokens_and_adds_nothing(kimi, add_special_tokens):
    """Kimi's tokenizer adds no BOS: a chat and a plain prompt both get their special strings as ids, whatever the
    request's add_special_tokens."""
    chat = kimi.apply_chat_template([{"role": "user", "content": "hi"}])
    assert kimi.encode_prompt(chat, add_special_tokens) == kimi.encode(chat, add_special_tokens=True)
    assert kimi.encode_prompt(str(chat), add_special_tokens) == kimi.encode(chat, add_special_tokens=True)
    assert set(kimi.encode_prompt(chat, add_special_tokens)) & kimi.all_special_ids
