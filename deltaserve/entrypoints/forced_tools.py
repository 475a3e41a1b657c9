"""Forced tool calls: tool_choice "required" or a named function, as vLLM serves them.

The output is constrained (structured outputs) to JSON instead of the model's own tool-call markers, so it always
parses: for a named function, the output is the call's arguments, matching the tool's parameter schema; for
"required", a non-empty JSON array of {"name": ..., "parameters": {...}}, each item matching one tool's schema
(one item only with parallel_tool_calls false).
ForcedToolCallParser turns that output into OpenAI tool_calls (whole at the end, also when streamed)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from deltaserve.tokenizer.tool_calls import ParsedOutput, ToolCall

_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ForcedTools:
    """What the output must be: the arguments of `name`'s call, or (name None: "required") a list of calls."""

    schema: dict  # the JSON schema the output is constrained to
    name: str | None = None
    first_index: int = 0  # the id index of the first call: the calls before it in the chat (Kimi counts them all)


def forced_tools(tool_choice, tools: list[dict], parallel_tool_calls: bool = True,
                 first_index: int = 0) -> ForcedTools | None:
    """The constraint for tool_choice "required" or {"type": "function", "function": {"name": ...}}; None for
    the other choices. A named function must be among tools (ValueError names it otherwise). first_index: the tool
    calls earlier in the chat, so the calls' ids (functions.NAME:INDEX) go on from theirs, as Kimi numbers them."""
    by_name = {tool["function"]["name"]: tool["function"].get("parameters") or _ANY_OBJECT for tool in tools}
    if tool_choice == "required":
        calls, defs = [], {}
        for i, (name, params) in enumerate(by_name.items()):
            params = _relocated(params, i, defs)
            calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                          "required": ["name", "parameters"]})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({"$defs": defs} if defs else {})}
        return ForcedTools(schema if parallel_tool_calls else {**schema, "maxItems": 1}, None, first_index)
    if not isinstance(tool_choice, Mapping):
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ValueError(f"tool_choice = {tool_choice!r:.80}, expected {{\"type\": \"function\", \"function\": "
                         f"{{\"name\": ...}}}}")
    if name not in by_name:
        raise ValueError(f"tool_choice names function {name!r}, which is not among tools ({', '.join(by_name)})")
    return ForcedTools(by_name[name], name, first_index)


def _relocated(params, i: int, defs: dict):
    """Tool i's parameter schema as it must read inside the "required" array: its $defs/definitions lifted into
    the root's $defs under "tool{i}.NAME" (added to defs), and every local $ref rewritten to where its target now
    is (a pydantic model's nested types are $refs to "#/$defs/...", which would otherwise point at the new root)."""
    if not isinstance(params, Mapping):
        return params
    home = f"#/items/anyOf/{i}/properties/parameters"

    def ref(target: str) -> str:
        for section in ("/$defs/", "/definitions/"):
            if target.startswith("#" + section):
                return f"#/$defs/tool{i}." + target[len(section) + 1:]
        return home + target[1:] if target.startswith("#") else target

    def walk(node):
        if isinstance(node, Mapping):
            return {k: (ref(v) if k == "$ref" and isinstance(v, str) else walk(v)) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node

    params = walk(params)
    for section in ("$defs", "definitions"):
        if isinstance(params.get(section), Mapping):
            defs.update({f"tool{i}.{name}": sub for name, sub in params.pop(section).items()})
    return params


class ForcedToolCallParser:
    """Reads a forced output: nothing until it finishes, then its tool calls as one stream delta, or (cut off by
    max_tokens before its JSON was complete) its text as content, as the whole response's message has it."""

    def __init__(self, forced: ForcedTools):
        self.forced = forced
        self._text: list[str] = []
        self._calls: list[ToolCall] | None = None

    def push(self, text: str) -> list[dict]:
        self._text.append(text)
        return []

    def finish(self) -> list[dict]:
        text = "".join(self._text)
        self._calls = self._read(text)
        if not self._calls:
            return [{"content": text}] if text else []
        return [{"tool_calls": [{"index": i, **call.to_openai()} for i, call in enumerate(self._calls)]}]

    def result(self) -> ParsedOutput:
        if self._calls is None:
            raise RuntimeError("result() before finish(); call finish() once the output is complete")
        return ParsedOutput(None if self._calls else "".join(self._text), self._calls)

    def _read(self, text: str) -> list[ToolCall]:
        """The calls of the output; none when it was cut off (max_tokens) before its JSON was complete."""
        first = self.forced.first_index
        if self.forced.name is not None:
            return [ToolCall(f"functions.{self.forced.name}:{first}", self.forced.name, text)] if _parses(text) else []
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return []
        return [ToolCall(f"functions.{item['name']}:{first + i}", item["name"], json.dumps(item["parameters"]))
                for i, item in enumerate(items)]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
