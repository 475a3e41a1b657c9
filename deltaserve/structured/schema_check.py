"""Our own check of a JSON schema before xgrammar sees it: xgrammar 0.2.8 silently ignores keywords it does not
implement (uniqueItems, not, if/then/else, allOf, contains, dependent*, unknown ones), so a schema using them would
be "honoured" by output that breaks it. Every keyword is on an allow-list or the schema is refused, naming the
keyword and where it is (a JSON pointer)."""

from __future__ import annotations

import json

from deltaserve.sampling_params import StructuredOutputsParams
from deltaserve.structured.errors import GrammarError

# keywords that say nothing about which values are valid
_ANNOTATIONS = {"$schema", "$id", "$comment", "$anchor", "title", "description", "default", "examples",
                "deprecated", "readOnly", "writeOnly", "strict", "discriminator"}
_COMMON = {"type", "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions", "nullable"}
_BY_TYPE = {
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "array": {"items", "prefixItems", "minItems", "maxItems"},
    "object": {"properties", "required", "additionalProperties", "minProperties", "maxProperties"},
}
_ALLOWED = _ANNOTATIONS | _COMMON | set().union(*_BY_TYPE.values())
_FORMATS = {"date", "time", "date-time", "duration", "email", "ipv4", "ipv6", "hostname", "uuid", "uri"}
# keywords whose value is a schema, a list of schemas, or a map of name -> schema
_SUBSCHEMA = {"items", "additionalProperties"}
_SUBSCHEMA_LISTS = {"anyOf", "oneOf", "prefixItems"}
_SUBSCHEMA_MAPS = {"properties", "$defs", "definitions"}
MAX_DEPTH = 32  # schemas nested deeper are refused: compiling cost grows steeply with depth, and recursion is bounded


def checked(spec: StructuredOutputsParams) -> StructuredOutputsParams:
    """spec, after the checks that need no xgrammar (a JSON schema's keywords); GrammarError names the problem."""
    if spec.json is not None:
        parse_schema(spec.json, "json")
    return spec


def parse_schema(schema: dict | str, param: str) -> dict:
    """The schema as a dict (parsed from JSON text when given as text), checked by check_schema."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{param} is not valid JSON: {e}", param) from e
        except RecursionError:
            raise GrammarError(f"{param} nests deeper than JSON text can be read; flatten it", param) from None
    if not isinstance(schema, dict):
        raise GrammarError(f"{param} must be a JSON object (a JSON schema), got {type(schema).__name__}", param)
    check_schema(schema, param)
    return schema


def check_schema(schema, param: str, pointer: str = "") -> None:
    """Refuse keywords the constraint would not enforce, and nesting past MAX_DEPTH; recurse into every subschema."""
    if isinstance(schema, bool):
        return
    if pointer.count("/") > 2 * MAX_DEPTH:  # a level adds at most two segments (keyword, then name or index)
        raise GrammarError(f"{param}: the schema nests deeper than {MAX_DEPTH} levels at '{pointer[:200]}...'; "
                           "flatten it (or use $defs)", param)
    if not isinstance(schema, dict):
        raise GrammarError(f"{param}: the schema at '{pointer or '/'}' must be an object or a boolean, got "
                           f"{json.dumps(schema)[:60]}", param)
    for keyword, value in schema.items():
        where = f"{pointer}/{keyword}"
        if keyword not in _ALLOWED:
            raise GrammarError(f"{param}: keyword '{keyword}' at '{where}' is not supported by constrained decoding "
                               f"(it would be ignored, not enforced); supported: {', '.join(sorted(_ALLOWED))}", param)
        if keyword == "format" and (not isinstance(value, str) or value not in _FORMATS):
            raise GrammarError(f"{param}: format {value!r} at '{where}' is not supported; use one of "
                               f"{', '.join(sorted(_FORMATS))} or a pattern", param)
        _check_children(keyword, value, param, where)


def _check_children(keyword: str, value, param: str, where: str) -> None:
    if keyword in _SUBSCHEMA:
        check_schema(value, param, where)
    elif keyword in _SUBSCHEMA_LISTS:
        if not isinstance(value, list) or not value:
            raise GrammarError(f"{param}: '{where}' must be a non-empty list of schemas", param)
        for i, sub in enumerate(value):
            check_schema(sub, param, f"{where}/{i}")
    elif keyword in _SUBSCHEMA_MAPS:
        if not isinstance(value, dict):
            raise GrammarError(f"{param}: '{where}' must be an object of name -> schema", param)
        for name, sub in value.items():
            check_schema(sub, param, f"{where}/{name}")
