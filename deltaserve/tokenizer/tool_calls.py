"""Kimi tool calls: the model's tool-call section turned into OpenAI tool_calls, whole or as stream deltas.

The model writes, after any plain content:

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
    ...more calls...
    <|tool_calls_section_end|>

The call id (`functions.NAME:INDEX`) is kept as the OpenAI id, NAME is the function name, and the text between
the argument marker and the end marker (whitespace-trimmed) is the arguments string, passed on as the model
wrote it. Text outside the section is content. The markers are special tokens the published tokenizer_config
marks `"special": false`, so they stay in the detokenized text that this parser reads."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
_LONGEST_MARKER = max(map(len, MARKERS))
_MARKER = re.compile("|".join(map(re.escape, MARKERS)))  # no marker begins another: at most one matches at a place
_ID_PREFIX = "functions."

# where the parser is: plain content, between calls, reading a call's id, reading its arguments
_CONTENT, _SECTION, _CALL_ID, _ARGUMENTS = "content", "section", "call_id", "arguments"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text as the model wrote it

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedOutput:
    """An assistant message: content is None when the model wrote only tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_openai(self) -> dict:
        message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message


def function_name(call_id: str) -> str:
    """'functions.get_weather:0' -> 'get_weather'; an id of another shape is returned without those parts."""
    name = call_id.removeprefix(_ID_PREFIX)
    head, colon, index = name.rpartition(":")
    return head if colon and index.isdigit() else name


def parse_tool_calls(text: str) -> ParsedOutput:
    """The content and tool calls of a finished output text."""
    parser = ToolCallStreamParser()
    parser.push(text)
    parser.finish()
    return parser.result()


class ToolCallStreamParser:
    """Reads output text in pieces of any size and returns OpenAI `choices[].delta` dicts as they become known.

    A call's first delta carries index, id, type and name (arguments ""), sent once its id is complete; later
    ones carry argument text: {"tool_calls": [{"index": i, "function": {"arguments": "..."}}]}. Content comes
    as {"content": "..."}. Text that may be the start of a marker is held until the next piece tells. Joining
    the deltas gives exactly result(), whatever the pieces were. An output cut off inside a call (max_tokens)
    keeps the arguments written so far (less a marker's cut-off start); a call cut off before its id ended is
    dropped."""

    def __init__(self):
        self._state = _CONTENT
        self._pending = ""  # text not read yet: it may begin a marker
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._call_id = ""
        self._arguments: list[str] = []
        self._spaces = ""  # whitespace inside arguments, sent only once non-space text follows
        self._deltas: list[dict] = []
        self._finished = False

    def push(self, text: str) -> list[dict]:
        if self._finished:
            raise RuntimeError("push() after finish(); make a new ToolCallStreamParser for each output")
        pending, read = self._pending + text, 0
        for match in _MARKER.finditer(pending):  # one pass: each search from the last marker's end
            self._read_text(pending[read:match.start()])
            self._read_marker(match.group())
            read = match.end()
        rest = pending[read:]
        safe = len(rest) - _marker_prefix_length(rest)
        self._read_text(rest[:safe])
        self._pending = rest[safe:]
        return self._take_deltas()

    def finish(self) -> list[dict]:
        """The deltas of the held-back text; call once, after the last push. Inside the tool-call section that text
        (the start of a marker, all that is held) is a marker cut off by max_tokens, not arguments: dropped."""
        if not self._finished:
            if self._state == _CONTENT:
                self._read_text(self._pending)
            self._pending = ""
            if self._state == _ARGUMENTS:
                self._end_call()
            self._finished = True
        return self._take_deltas()

    def result(self) -> ParsedOutput:
        if not self._finished:
            raise RuntimeError("result() before finish(); call finish() once the output is complete")
        content = "".join(self._content)
        return ParsedOutput(content if content or not self._calls else None, list(self._calls))

    def _read_text(self, text: str) -> None:
        if not text:
            return
        if self._state == _CONTENT:
            self._content.append(text)
            self._emit({"content": text})
        elif self._state == _CALL_ID:
            self._call_id += text
        elif self._state == _ARGUMENTS:
            self._read_arguments(text)
        # text between calls (newlines) is neither content nor a call

    def _read_arguments(self, text: str) -> None:
        """Arguments without leading or trailing whitespace: inner whitespace waits for what follows it."""
        body = self._spaces + text
        stripped = body.rstrip()
        self._spaces = body[len(stripped):]
        if not self._arguments:
            stripped = stripped.lstrip()
        if stripped:
            self._arguments.append(stripped)
            self._emit_arguments(stripped)

    def _read_marker(self, marker: str) -> None:
        if marker == SECTION_BEGIN and self._state == _CONTENT:
            self._state = _SECTION
        elif marker == CALL_BEGIN:
            if self._state in (_CALL_ID, _ARGUMENTS):
                self._end_call()  # the model began a new call without ending this one
            self._state, self._call_id = _CALL_ID, ""
        elif marker == ARGUMENT_BEGIN and self._state == _CALL_ID:
            self._begin_arguments()
        elif marker == CALL_END and self._state in (_CALL_ID, _ARGUMENTS):
            self._end_call()
        elif marker == SECTION_END:
            if self._state in (_CALL_ID, _ARGUMENTS):
                self._end_call()
            self._state = _CONTENT
        # any other marker is out of place and dropped

    def _begin_arguments(self) -> None:
        call_id = self._call_id.strip()
        self._calls.append(ToolCall(call_id, function_name(call_id), ""))
        self._emit({"tool_calls": [{"index": len(self._calls) - 1, **self._calls[-1].to_openai()}]})
        self._state, self._arguments, self._spaces = _ARGUMENTS, [], ""

    def _end_call(self) -> None:
        if self._state == _CALL_ID:
            self._begin_arguments()  # a call with no argument marker: its arguments are empty
        last = self._calls[-1]
        self._calls[-1] = ToolCall(last.id, last.name, "".join(self._arguments))
        self._state = _SECTION

    def _emit_arguments(self, text: str) -> None:
        self._emit({"tool_calls": [{"index": len(self._calls) - 1, "function": {"arguments": text}}]})

    def _emit(self, delta: dict) -> None:
        previous = self._deltas[-1] if self._deltas else None
        if previous is not None and _mergeable(previous, delta):
            _merge(previous, delta)
        else:
            self._deltas.append(delta)

    def _take_deltas(self) -> list[dict]:
        deltas, self._deltas = self._deltas, []
        return deltas


def _marker_prefix_length(text: str) -> int:
    """The length of the longest end of text that begins some marker (and so may finish in the next piece)."""
    start = text.find("<", max(0, len(text) - _LONGEST_MARKER + 1))
    while start >= 0:
        tail = text[start:]
        if any(marker.startswith(tail) for marker in MARKERS):
            return len(tail)
        start = text.find("<", start + 1)
    return 0


def _mergeable(previous: dict, delta: dict) -> bool:
    """Two content deltas, or two argument deltas of the same call, read as one."""
    if "content" in previous and "content" in delta:
        return True
    calls, new = previous.get("tool_calls"), delta.get("tool_calls")
    return bool(calls and new) and calls[-1]["index"] == new[0]["index"] and "id" not in new[0]


def _merge(previous: dict, delta: dict) -> None:
    if "content" in delta:
        previous["content"] += delta["content"]
    else:
        previous["tool_calls"][-1]["function"]["arguments"] += delta["tool_calls"][0]["function"]["arguments"]
