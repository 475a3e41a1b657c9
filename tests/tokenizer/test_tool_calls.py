import json
import random

import pytest
from helpers.kimi_tokenizer import write_kimi_tokenizer

from deltaserve.tokenizer import IncrementalDetokenizer, load_tokenizer
from deltaserve.tokenizer.tool_calls import (
    ParsedOutput,
    ToolCall,
    ToolCallStreamParser,
    function_name,
    parse_tool_calls,
)

CALLS = (
    "<|tool_calls_section_begin|>\n"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris 巴黎"}<|tool_call_end|>\n'
    "<|tool_call_begin|> functions.search.web:1 <|tool_call_argument_begin|>\n"
    '  {"q": "a <|b|> c",\n   "n": 3}  \n<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)
OUTPUT = "Let me check 🙂 <| not a marker." + CALLS
EXPECTED = ParsedOutput("Let me check 🙂 <| not a marker.", [
    ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris 巴黎"}'),
    ToolCall("functions.search.web:1", "search.web", '{"q": "a <|b|> c",\n   "n": 3}'),
])


def test_parses_content_and_calls():
    assert parse_tool_calls(OUTPUT) == EXPECTED


def test_openai_message():
    message = EXPECTED.to_openai()
    assert message["role"] == "assistant" and message["content"] == EXPECTED.content
    arguments = EXPECTED.tool_calls[1].arguments
    assert message["tool_calls"][1] == {"id": "functions.search.web:1", "type": "function",
                                        "function": {"name": "search.web", "arguments": arguments}}
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris 巴黎"}
    assert "tool_calls" not in ParsedOutput("hi").to_openai()


def test_only_calls_has_no_content():
    assert parse_tool_calls(CALLS) == ParsedOutput(None, EXPECTED.tool_calls)


def test_without_calls_everything_is_content():
    text = "Plain answer with <|tool_call_end and <|im_end|> lookalikes"
    assert parse_tool_calls(text) == ParsedOutput(text)
    assert parse_tool_calls("") == ParsedOutput("")


def test_text_after_the_section_is_content():
    assert parse_tool_calls("a" + CALLS + " b").content == "a b"


@pytest.mark.parametrize("call_id, name", [
    ("functions.get_weather:0", "get_weather"), ("functions.a.b:12", "a.b"), ("get_weather:3", "get_weather"),
    ("call_abc123", "call_abc123"), ("functions.f:x", "f:x"), ("functions.ratio:2:1", "ratio:2"),
])
def test_function_name(call_id, name):
    assert function_name(call_id) == name


def test_call_without_argument_marker_has_empty_arguments():
    text = "<|tool_calls_section_begin|><|tool_call_begin|>functions.now:0<|tool_call_end|><|tool_calls_section_end|>"
    assert parse_tool_calls(text).tool_calls == [ToolCall("functions.now:0", "now", "")]


def test_cut_off_output_keeps_what_was_written():
    cut_in_arguments = CALLS[:CALLS.index('"a <|b|>')]
    cut_call = ToolCall("functions.search.web:1", "search.web", '{"q":')
    assert parse_tool_calls(cut_in_arguments).tool_calls == [EXPECTED.tool_calls[0], cut_call]
    cut_in_id = CALLS[:CALLS.index("web:1")]
    assert parse_tool_calls(cut_in_id).tool_calls == EXPECTED.tool_calls[:1]


@pytest.mark.parametrize("cut", range(1, len("<|tool_call_end|>")))
def test_a_marker_cut_off_is_not_read_as_arguments(cut):
    """max_tokens can end the output inside a marker (a tokenizer that spells it in pieces): the arguments stop
    before it, streamed or whole; content that ends like a marker's start stays content."""
    text = '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}'
    text += "<|tool_call_end|>"[:cut]
    parser = ToolCallStreamParser()
    deltas = [d for char in text for d in parser.push(char)] + parser.finish()
    assert _joined(deltas) == parse_tool_calls(text) == ParsedOutput(None, [ToolCall("functions.f:0", "f", '{"a": 1}')])
    assert parse_tool_calls("1 <|tool").content == "1 <|tool"


def test_stream_deltas_are_shaped_like_openai():
    parser = ToolCallStreamParser()
    deltas = parser.push(OUTPUT[:OUTPUT.index("Paris")]) + parser.push(OUTPUT[OUTPUT.index("Paris"):])
    deltas += parser.finish()
    assert deltas[0] == {"content": "Let me check 🙂 <| not a marker."}
    assert deltas[1] == {"tool_calls": [{"index": 0, "id": "functions.get_weather:0", "type": "function",
                                         "function": {"name": "get_weather", "arguments": '{"city": "'}}]}
    assert deltas[2] == {"tool_calls": [{"index": 0, "function": {"arguments": 'Paris 巴黎"}'}}]}
    assert deltas[3]["tool_calls"][0]["index"] == 1 and deltas[3]["tool_calls"][0]["id"] == "functions.search.web:1"
    assert len(deltas) == 4


@pytest.mark.parametrize("seed", range(40))
def test_any_chunking_streams_the_same_message(seed):
    rng = random.Random(seed)
    text = rng.choice([OUTPUT, CALLS, OUTPUT + " tail", "no calls <|tool at all <|"])
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(30, len(text) - 1))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    parser = ToolCallStreamParser()
    deltas = [d for piece in pieces for d in parser.push(piece)] + parser.finish()
    assert _joined(deltas) == parser.result() == parse_tool_calls(text)


def test_character_by_character():
    parser = ToolCallStreamParser()
    deltas = [d for char in OUTPUT for d in parser.push(char)] + parser.finish()
    assert _joined(deltas) == EXPECTED
    assert not any(marker in json.dumps(deltas) for marker in ("tool_call_begin", "section_end"))


def test_stream_of_token_ids_through_the_detokenizer(tmp_path):
    """What the engine does: ids -> IncrementalDetokenizer (special tokens skipped) -> the parser."""
    first_special = write_kimi_tokenizer(tmp_path, num_ranks=600)
    kimi = load_tokenizer(tmp_path)
    ids = kimi.encode(OUTPUT, add_special_tokens=True) + [kimi.token_to_id("<|im_end|>")]
    assert ids.count(first_special + 13) == 2  # each marker is one token
    detokenizer = IncrementalDetokenizer(kimi, kimi.encode("prompt"))
    parser = ToolCallStreamParser()
    deltas = [d for i in ids for d in parser.push(detokenizer.push([i]))] + parser.push(detokenizer.finish())
    assert _joined(deltas + parser.finish()) == EXPECTED


def test_push_after_finish_is_an_error():
    parser = ToolCallStreamParser()
    parser.finish()
    with pytest.raises(RuntimeError, match=r"push\(\) after finish\(\); make a new ToolCallStreamParser"):
        parser.push("x")


def _joined(deltas: list[dict]) -> ParsedOutput:
    """The message that a client rebuilds from stream deltas, as the openai library does."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls) and call["type"] == "function"
                calls[call["index"]] = [call["id"], call["function"]["name"], ""]
            calls[call["index"]][2] += call["function"]["arguments"]
    return ParsedOutput(content if content or not calls else None, [ToolCall(*call) for call in calls.values()])
