import json
import shutil

import pytest
from helpers.kimi_tokenizer import synthetic_ranks, write_kimi_files, write_kimi_tokenizer

from deltaserve.core.outputs import CompletionOutput, RequestOutput
from deltaserve.entrypoints.chat_tools import (
    ChatCompletionOutput,
    ChatOutputParser,
    ChatPrompt,
    chat_completion_output,
    render_chat_prompt,
)
from deltaserve.entrypoints.llm import BUNDLED_MODEL, LLM
from deltaserve.sampling_params import SamplingParams
from deltaserve.tokenizer import ChatTemplateError, load_tokenizer
from deltaserve.tokenizer.tool_calls import ToolCall

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                           "parameters": {"type": "object", "properties": {}}}}]
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = ("Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
CALL = ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}')


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kimi")
    write_kimi_tokenizer(folder, num_ranks=400)
    return load_tokenizer(folder)


def test_auto_declares_tools_and_parses(kimi):
    prompt = render_chat_prompt(kimi, CHAT, TOOLS)
    assert prompt.parse_tool_calls
    assert prompt.text.startswith('<|im_system|>tool_declare<|im_middle|>[{"function":{"description":"Weather now.",')
    assert render_chat_prompt(kimi, CHAT, TOOLS, "auto") == prompt


def test_none_declares_tools_but_does_not_parse(kimi):
    prompt = render_chat_prompt(kimi, CHAT, TOOLS, "none")
    assert not prompt.parse_tool_calls and prompt.text == kimi.apply_chat_template(CHAT, tools=TOOLS)
    assert render_chat_prompt(kimi, CHAT) == ChatPrompt(kimi.apply_chat_template(CHAT), False)


@pytest.mark.parametrize("tools, tool_choice, message", [
    (TOOLS, "always", r"tool_choice = 'always' is not supported; use \"auto\""),
    (TOOLS, {"type": "function", "function": {"name": "get_time"}}, r"names function 'get_time', which is not among"),
    (TOOLS, {"type": "function"}, r"tool_choice = \{'type': 'function'\}, expected"),
    (None, "auto", r"tool_choice = 'auto' needs tools; send tools, or leave tool_choice out"),
    ({"name": "f"}, None, r"tools = \{'name': 'f'\}, expected None or a list"),
    ([{"name": "f"}], None, r"tools\[0\] = \{'name': 'f'\}, expected a dict with \"type\": \"function\""),
    ([{"type": "function", "function": {"description": "x"}}], None, r"tools\[0\].function = .* non-empty \"name\""),
])
def test_bad_tool_requests(kimi, tools, tool_choice, message):
    with pytest.raises(ChatTemplateError, match=message):
        render_chat_prompt(kimi, CHAT, tools, tool_choice)


def test_markers_cut_from_the_text_are_refused(tmp_path):
    write_kimi_files(tmp_path, synthetic_ranks(256))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["269"]["special"] = True  # <|tool_call_begin|>
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match=r"<\|tool_call_begin\|> \(id 269\) is marked \"special\": true"):
        render_chat_prompt(load_tokenizer(tmp_path), CHAT, TOOLS)


def test_output_parser_with_tools():
    parser = ChatOutputParser(parse_tool_calls=True)
    deltas = parser.push(CALL_TEXT[:30]) + parser.push(CALL_TEXT[30:]) + parser.finish()
    assert deltas[0] == {"content": "Checking."} and deltas[1]["tool_calls"][0]["id"] == CALL.id
    assert parser.message() == {"role": "assistant", "content": "Checking.", "tool_calls": [CALL.to_openai()]}
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"


def test_output_parser_without_tools_passes_text_through():
    parser = ChatOutputParser(parse_tool_calls=False)
    assert parser.push(CALL_TEXT) == [{"content": CALL_TEXT}] and parser.push("") == [] and parser.finish() == []
    assert parser.message() == {"role": "assistant", "content": CALL_TEXT}
    assert parser.finish_reason("stop") == "stop"


def test_chat_completion_output_keeps_the_engine_fields():
    output = CompletionOutput(0, CALL_TEXT, [1, 2], "stop", None, None, None)
    chat = chat_completion_output(output, parse_tool_calls=True)
    assert (chat.text, chat.token_ids, chat.finish_reason) == (CALL_TEXT, [1, 2], "tool_calls")
    assert (chat.content, chat.tool_calls) == ("Checking.", [CALL])


@pytest.fixture(scope="module")
def demo_llm(tmp_path_factory):
    """The bundled demo model (vocab 512) with Kimi tokenizer files: 256 byte ranks + 256 special ids."""
    folder = tmp_path_factory.mktemp("demo_kimi")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(BUNDLED_MODEL / name, folder / name)
    write_kimi_files(folder, synthetic_ranks(256))
    return LLM(folder, device="cpu")


def test_llm_chat_runs_the_model_on_the_rendered_tools(demo_llm):
    out = demo_llm.chat(CHAT, SamplingParams(max_tokens=3, temperature=0), tools=TOOLS)
    im_system, im_assistant, im_middle = 256 + 10, 256 + 4, 256 + 17  # ranks are the 256 single bytes
    assert out.prompt_token_ids[0] == im_system  # the tool_declare turn
    assert out.prompt_token_ids[-11:] == [im_assistant, *b"assistant", im_middle]
    completion = out.outputs[0]
    assert isinstance(completion, ChatCompletionOutput) and len(completion.token_ids) == 3


def test_llm_chat_returns_parsed_tool_calls(demo_llm, monkeypatch):
    prompts = []

    def generate(texts, sampling_params, use_tqdm):
        prompts.extend(texts)
        return [RequestOutput("0", texts[0], [1], [CompletionOutput(0, CALL_TEXT, [5], "stop")], True)]

    monkeypatch.setattr(demo_llm, "generate", generate)
    completion = demo_llm.chat(CHAT, tools=TOOLS).outputs[0]
    assert prompts[0].startswith("<|im_system|>tool_declare<|im_middle|>")
    assert (completion.content, completion.tool_calls, completion.finish_reason) == ("Checking.", [CALL], "tool_calls")
    plain = demo_llm.chat(CHAT, tools=TOOLS, tool_choice="none").outputs[0]
    assert (plain.content, plain.tool_calls, plain.finish_reason) == (CALL_TEXT, [], "stop")
