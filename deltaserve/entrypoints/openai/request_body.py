"""Request bodies read, parsed and validated into the protocol's models, without holding the event loop long.

A body under OFF_LOOP_BYTES is parsed and validated on the loop (well under a millisecond a kilobyte). A larger one
goes to a worker thread, and there its long lists (LONG_LISTS: the prompt, the messages and their content parts, the
tools) are validated in pieces of PIECE items, counting the items of the items' own lists: pydantic holds the GIL
for the whole of one call, and between pieces the loop gets it back. The JSON text of such a body is decoded by
json's C scanner in one call, or by its Python one when it holds many lists and objects (_loads).

The result equals the model's own validation of the whole body, and so do the errors of a body with one bad item;
of a body with several, the one reported may differ (a long list is checked before the other fields)."""

from __future__ import annotations

import asyncio
import json
from email.message import Message
from functools import cache
from json.scanner import py_make_scanner
from typing import Annotated

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from deltaserve.entrypoints.openai.errors import bad_request
from deltaserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

OFF_LOOP_BYTES = 1 << 20
MANY_CONTAINERS = 1 << 16  # a body text with this many lists and objects is decoded in Python (_loads)
PIECE = 4096  # the weight (items, and the items of their lists) validated in one call
# the fields of each model that may hold long lists, and the model of their items (whose own lists may be long)
LONG_LISTS: dict[type[BaseModel], dict[str, type[BaseModel] | None]] = {
    CompletionRequest: {"prompt": None},
    ChatCompletionRequest: {"messages": ChatMessage, "tools": None},
    ChatMessage: {"content": None},
}


async def read_body(request: Request, model: type[BaseModel], pool) -> BaseModel:
    """The request's JSON body as a model; a large body is parsed in pool's threads. A body that is not one raises
    RequestValidationError, as FastAPI's body parameter did, or OpenAIError (both 400s in OpenAI's shape)."""
    content_type = request.headers.get("content-type")
    if not _is_json(content_type):
        raise bad_request(f"request body must be JSON sent with the header 'Content-Type: application/json' (got "
                          f"{'none' if content_type is None else repr(content_type[:80])})")
    raw = await request.body()
    if len(raw) < OFF_LOOP_BYTES:
        return parse_body(raw, model)
    return await asyncio.get_running_loop().run_in_executor(pool, parse_body, raw, model, True)


def parse_body(raw: bytes, model: type[BaseModel], in_pieces: bool = False) -> BaseModel:
    """raw parsed as JSON and validated as model; in_pieces validates long lists a piece at a time."""
    if not raw:
        raise bad_request("request body is empty; send the request's fields as a JSON object")
    try:
        data = _loads(raw.decode("utf-8-sig"), in_pieces)  # UTF-8, as the guard checked (bytes let json guess UTF-16)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise bad_request(f"request body is not valid JSON: {e}") from None
    return _validate(model, data, ()) if in_pieces else _validate_whole(model, data, ())


def _loads(text: str, in_pieces: bool):
    """json.loads(text); in pieces, a text of MANY_CONTAINERS lists and objects or more (brackets in strings counted
    too) is decoded by json's own Python scanner instead of its C one: the same values and errors, but Python code
    runs between values, where the event loop can take the GIL (the C scanner holds it for the whole text: seconds
    for millions of tiny lists)."""
    if not in_pieces or text.count("[") + text.count("{") < MANY_CONTAINERS:
        return json.loads(text)
    decoder = json.JSONDecoder()
    decoder.scan_once = py_make_scanner(decoder)
    return decoder.decode(text)


def _validate_whole(model: type[BaseModel], data, where: tuple) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(_located(e.errors(), where)) from None


def _validate(model: type[BaseModel], data, where: tuple) -> BaseModel:
    """model.model_validate(data), with the lists of LONG_LISTS[model] validated in pieces when they weigh more than
    PIECE; where locates data in the body, for errors."""
    if not isinstance(data, dict):
        return _validate_whole(model, data, where)
    done = {}
    for name, item_model in LONG_LISTS.get(model, {}).items():
        value = data.get(name)
        if not isinstance(value, list):
            continue
        weights = _weights(item_model, value)
        if (len(value) if weights is None else sum(weights)) > PIECE:
            done[name] = _validate_list(_field_adapter(model, name), value, weights, (*where, name), item_model)
    # the other fields, with each long list stood for by its first (validated) item; then the lists put in
    out = _validate_whole(model, {**data, **{name: items[:1] for name, items in done.items()}}, where)
    for name, items in done.items():
        setattr(out, name, items)
    return out


def _weights(item_model: type[BaseModel] | None, items: list) -> list[int] | None:
    """What validating each item costs, in items: one, plus the items of its own lists (a message's content parts, a
    prompt's token ids in a list of them); None when every item is one."""
    if item_model is not None:
        names = LONG_LISTS[item_model]
        return [1 + sum(len(v) for name in names if isinstance(v := item.get(name), list)) if isinstance(item, dict)
                else 1 for item in items]
    if items and isinstance(items[0], list):
        return [1 + len(item) if isinstance(item, list) else 1 for item in items]
    return None


def _validate_list(adapter: TypeAdapter, items: list, weights: list[int] | None, where: tuple,
                   item_model: type[BaseModel] | None) -> list:
    """items validated by adapter (a list type, or a union of them) in pieces of at most PIECE weight, in order. An
    item heavier than that is validated alone: a message as item_model (its own lists in pieces), a list of token ids
    a piece of it at a time (each as a one-item list, so that the union takes the member the whole would). A union
    must take the same member for every piece (a prompt of token ids throughout, not ids then strings): where one
    does not, the list's first item and the piece's are validated together, for the error the whole list gets."""
    out = []
    for start, end, alone in _spans(len(items), weights):
        try:
            if not alone:
                valid = adapter.validate_python(items[start:end])
            elif item_model is not None:
                valid = adapter.validate_python([_validate(item_model, items[start], (*where, start))])
            else:
                item = items[start]
                valid = [[x for i in range(0, len(item), PIECE)
                          for x in adapter.validate_python([item[i:i + PIECE]])[0]]]
        except ValidationError as e:
            raise RequestValidationError(_located(e.errors(), where, start)) from None
        if out and type(valid[0]) is not type(out[0]):
            try:
                adapter.validate_python([items[0], items[start]])
            except ValidationError as e:
                raise RequestValidationError(_located(e.errors(), where, start - 1)) from None
        out.extend(valid)
    return out


def _spans(length: int, weights: list[int] | None):
    """(start, end, alone) of the pieces of a list: items of at most PIECE weight together, an item heavier alone."""
    if weights is None:
        for start in range(0, length, PIECE):
            yield start, min(start + PIECE, length), False
        return
    start = total = 0
    for i, weight in enumerate(weights):
        if total + weight > PIECE and start < i:
            yield start, i, False
            start, total = i, 0
        if weight > PIECE:
            yield i, i + 1, True
            start = i + 1
        else:
            total += weight
    if start < length:
        yield start, length, False


@cache
def _field_adapter(model: type[BaseModel], name: str) -> TypeAdapter:
    """A validator of one field's value alone, with the field's constraints and the models' strictness."""
    field = model.model_fields[name]
    annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    return TypeAdapter(annotation, config=ConfigDict(strict=model.model_config.get("strict", False)))


def _located(errors: list[dict], where: tuple, offset: int = 0) -> list[dict]:
    """errors located in the body (where: the path to what was validated) with offset added to the first index in
    each (a piece's start)."""
    out = []
    for error in errors:
        loc = list(error["loc"])
        if offset:
            first = next((i for i, part in enumerate(loc) if isinstance(part, int)), None)
            if first is not None:
                loc[first] += offset
        out.append({**error, "loc": ("body", *where, *loc)})
    return out


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule for a JSON body: application/json or application/*+json."""
    if not content_type:
        return False
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))
