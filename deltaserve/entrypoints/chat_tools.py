"""Chats with tools, as LLM.chat and the OpenAI server both serve them.

    prompt = render_chat_prompt(tokenizer, messages, tools, tool_choice)     # checks tools and tool_choice
    token_ids = tokenizer.encode_prompt(prompt.text)                          # a ChatText: no BOS added
    parser = ChatOutputParser(prompt.parse_tool_calls)                       # one per choice
    ... for each new piece of output text:  deltas = parser.push(piece)      # OpenAI `delta` dicts
    ... when the request finishes:          deltas = parser.finish()
    parser.message(), parser.finish_reason(engine_finish_reason)
    (a whole output at once: parser = parse_chat_output(text, prompt.parse_tool_calls))

tool_choice "auto" (the default when tools are given) parses the model's tool calls out of its output;
"none" leaves the output as content; "required" and a named function force a call: the output is constrained to
JSON (prompt.forced.schema, through structured outputs) and read by forced_tools.ForcedToolCallParser. The tools
are declared in the prompt either way, as vLLM does."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from deltaserve.core.outputs import CompletionOutput
from deltaserve.entrypoints.forced_tools import ForcedToolCallParser, ForcedTools, forced_tools
from deltaserve.tokenizer.base import ChatText, Tokenizer
from deltaserve.tokenizer.errors import ChatTemplateError
from deltaserve.tokenizer.tool_calls import MARKERS, ParsedOutput, ToolCall, ToolCallStreamParser

TOOL_CHOICES = ("auto", "none", "required")


class ToolRequestError(ChatTemplateError):
    """Bad tools or tool_choice; param names the request field to fix (the server reports it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatPrompt:
    text: ChatText  # the rendered chat; tokenizer.encode_prompt encodes it (no BOS added: the template wrote it)
    parse_tool_calls: bool  # tool_choice "auto": read tool calls out of the output
    forced: ForcedTools | None = None  # tool_choice "required" or a named function: the output's constraint


@dataclass
class ChatCompletionOutput(CompletionOutput):
    """A CompletionOutput (text is the raw output) plus the assistant message read from it."""

    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def render_chat_prompt(tokenizer: Tokenizer, messages, tools=None, tool_choice=None,
                       add_generation_prompt: bool = True, parallel_tool_calls: bool = True) -> ChatPrompt:
    """The prompt for a chat request; ValueError (a ChatTemplateError) names what is wrong with it."""
    tools = _check_tools(tools)
    parse = _check_tool_choice(tool_choice, tools)
    if parse:
        _check_markers_survive_detokenization(tokenizer)
    try:
        forced = forced_tools(tool_choice, tools, parallel_tool_calls, _calls_before(messages))
    except ValueError as e:
        raise ToolRequestError(str(e), "tool_choice") from e
    text = tokenizer.apply_chat_template(messages, add_generation_prompt, tools)
    return ChatPrompt(text, parse, forced)


def _calls_before(messages) -> int:
    """How many tool calls the chat's assistant turns made: a forced call's id index goes on from there."""
    return sum(len(m.get("tool_calls") or ()) for m in messages
               if isinstance(m, Mapping) and isinstance(m.get("tool_calls"), list))


class ChatOutputParser:
    """One choice's output text, whole or in pieces, as an OpenAI assistant message and stream deltas."""

    def __init__(self, parse_tool_calls: bool, forced: ForcedTools | None = None):
        self._tool_parser = ForcedToolCallParser(forced) if forced is not None else (
            ToolCallStreamParser() if parse_tool_calls else None)
        self._text: list[str] = []
        self._finished = False

    def push(self, text: str) -> list[dict]:
        """The `choices[].delta` dicts that text adds ({"content": ...} or {"tool_calls": [...]})."""
        if self._tool_parser is not None:
            return self._tool_parser.push(text)
        self._text.append(text)
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        self._finished = True
        return self._tool_parser.finish() if self._tool_parser is not None else []

    def result(self) -> ParsedOutput:
        if self._tool_parser is not None:
            return self._tool_parser.result()
        if not self._finished:
            raise RuntimeError("result() before finish(); call finish() once the output is complete")
        return ParsedOutput("".join(self._text))

    def message(self) -> dict:
        """{"role": "assistant", "content": ..., "tool_calls": [...]} (tool_calls only when there are some)."""
        return self.result().to_openai()

    def finish_reason(self, engine_finish_reason: str | None) -> str | None:
        """"tool_calls" when the model stopped after calling tools, as OpenAI reports it; else the engine's."""
        called = bool(self.result().tool_calls)
        return "tool_calls" if called and engine_finish_reason == "stop" else engine_finish_reason


def parse_chat_output(text: str, parse_tool_calls: bool, forced: ForcedTools | None = None) -> ChatOutputParser:
    """A finished parser of a whole output text: ask it for message(), result() or finish_reason()."""
    parser = ChatOutputParser(parse_tool_calls, forced)
    parser.push(text)
    parser.finish()
    return parser


def chat_completion_output(output: CompletionOutput, parse_tool_calls: bool,
                           forced: ForcedTools | None = None) -> ChatCompletionOutput:
    """output with its text read as an assistant message (finish_reason "tool_calls" after tool calls)."""
    parser = parse_chat_output(output.text, parse_tool_calls, forced)
    parsed = parser.result()
    fields = {**vars(output), "finish_reason": parser.finish_reason(output.finish_reason)}
    return ChatCompletionOutput(**fields, content=parsed.content, tool_calls=parsed.tool_calls)


def _check_tools(tools) -> list[dict]:
    """tools as OpenAI sends them: [{"type": "function", "function": {"name": ..., ...}}, ...]."""
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise ToolRequestError(f"tools = {tools!r:.80}, expected None or a list of "
                               f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}} dicts", "tools")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ToolRequestError(f"tools[{i}] = {tool!r:.80}, expected a dict with \"type\": \"function\"",
                                   f"tools[{i}]")
        function = tool.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ToolRequestError(f"tools[{i}].function = {function!r:.80}, expected a dict with a non-empty "
                                   f"\"name\" (and \"description\", \"parameters\")", f"tools[{i}].function")
    return list(tools)


def _check_tool_choice(tool_choice, tools: list[dict]) -> bool:
    """Whether to parse tool calls out of the output."""
    if tool_choice is None:
        return bool(tools)
    if tool_choice not in TOOL_CHOICES and not isinstance(tool_choice, Mapping):
        raise ToolRequestError(f"tool_choice = {tool_choice!r:.80} is not supported; use \"auto\" (the model "
                               f"decides), \"none\" (no tool calls), \"required\" (at least one call) or "
                               f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tool_choice")
    if not tools:
        raise ToolRequestError(f"tool_choice = {tool_choice!r} needs tools; send tools, or leave tool_choice out",
                               "tool_choice")
    return tool_choice == "auto"


def _check_markers_survive_detokenization(tokenizer: Tokenizer) -> None:
    """The engine's text skips special tokens; a tool-call marker among them would vanish before parsing."""
    for marker in MARKERS:
        token_id = tokenizer.token_to_id(marker)
        if token_id is not None and token_id in tokenizer.all_special_ids:
            raise ToolRequestError(
                f"{marker} (id {token_id}) is marked \"special\": true in the model's tokenizer_config.json, so it "
                f"is cut from the output text and tool calls could not be read; set \"special\": false for it "
                f"in added_tokens_decoder, as Moonshot's published file does", "tools"
            )
