"""Jinja chat templates, rendered in an immutable sandbox with the helpers transformers gives templates."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from deltaserve.tokenizer.errors import ChatTemplateError

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplate:
    """A compiled chat template; origin (the file it came from) is named in every error."""

    def __init__(self, source: str, origin: str):
        self.origin = origin
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"chat template in {origin} does not compile: {e.message} (template line {e.lineno}); "
                f"fix the template, or remove it and send token ids instead of chats"
            ) from None

    def render(self, messages, add_generation_prompt: bool = True, tools=None, **variables) -> str:
        """The prompt text for messages; variables (bos_token, eos_token, ...) are visible to the template."""
        context = dict(
            variables,
            messages=check_messages(messages),
            tools=check_tools(tools),
            add_generation_prompt=bool(add_generation_prompt),
        )
        try:
            return self._template.render(context)
        except _TemplateRaised as e:
            raise ChatTemplateError(
                f"chat template in {self.origin} rejected the chat: {e.message}; change the messages as it asks"
            ) from None
        except SecurityError as e:
            raise ChatTemplateError(
                f"chat template in {self.origin} tried an unsafe operation ({e}); the sandbox forbids it: "
                f"use a template that reads only messages, tools and the special token strings"
            ) from None
        except Exception as e:  # the template is foreign code: any failure is its author's, reported as such
            raise ChatTemplateError(
                f"chat template in {self.origin} failed: {type(e).__name__}: {e}; check that the messages have "
                f"the fields this template reads, or fix the template"
            ) from None


def check_messages(messages) -> list[dict]:
    """A plain copy of messages after checking each is {role, content} with a known role."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError(
            f"messages = {messages!r:.80}, expected a non-empty list of {{\"role\": ..., \"content\": ...}} dicts"
        )
    return [_check_message(i, message) for i, message in enumerate(messages)]


def check_tools(tools) -> list[dict] | None:
    if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, Mapping) for t in tools)):
        raise ChatTemplateError(f"tools = {tools!r:.80}, expected None or a list of JSON-schema dicts")
    return None if tools is None else _plain(tools, "tools")


def _check_message(index: int, message) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"{where} = {message!r:.80}, expected a dict with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise ChatTemplateError(f"{where} has role {role!r}, expected one of {', '.join(ROLES)}")
    content = message.get("content")
    calls_tools = role == "assistant" and bool(message.get("tool_calls"))
    if not isinstance(content, (str, list, tuple)) and not (content is None and calls_tools):
        raise ChatTemplateError(
            f"{where} has content {content!r:.80}, expected a string or a list of parts "
            f"(None only for an assistant message with tool_calls)"
        )
    if isinstance(content, (list, tuple)):
        _check_parts(where, content)
    return _plain(message, where)


def _check_parts(where: str, parts) -> None:
    for i, part in enumerate(parts):
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise ChatTemplateError(
                f"{where}.content[{i}] = {part!r:.80}, expected a dict with a string 'type' "
                f"such as {{\"type\": \"text\", \"text\": \"...\"}}"
            )
        if part["type"] != "text" or not isinstance(part.get("text"), str):  # a template would drop it unsaid
            raise ChatTemplateError(
                f"{where}.content[{i}] is of type {part['type']!r}: Kimi-Linear reads text only; send "
                f"{{\"type\": \"text\", \"text\": \"...\"}} parts"
            )


def _plain(value, where: str):
    """value as plain JSON-like data, so the template sees no caller objects (and no way out through them)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise ChatTemplateError(
        f"{where} is a {type(value).__name__}, expected JSON-like data (str, number, bool, None, list, dict)"
    )


class _TemplateRaised(jinja2.TemplateError):
    """Raised by the template itself through raise_exception()."""


class _Undefined(jinja2.Undefined):
    """Lenient like transformers' (a missing key is empty and false) but an unsafe attribute fails at once.

    The sandbox answers `''.__class__` with an undefined value that fails only when used; failing at once
    turns a probe that prints nothing into an error the user sees."""

    def __init__(self, hint=None, obj=jinja2.utils.missing, name=None, exc=jinja2.UndefinedError):
        super().__init__(hint, obj, name, exc)
        if exc is SecurityError:
            self._fail_with_undefined_error()


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, which could shadow its internals."""

    def __init__(*args, **kwargs):  # Jinja's own signature trick, so that namespace(self=...) still works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"namespace attribute {name!r} starts with '_'; rename it")


def _raise_exception(message) -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters and takes no separators; templates expect json.dumps
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _make_dict(*args, **kwargs) -> dict:
    return dict(*args, **kwargs)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], undefined=_Undefined
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace, dict=_make_dict
    )
    return env
