"""Our own check of a JSON schema before xgrammar sees it: xgrammar 0.2.8 silently ignores keywords it does not
implement (uniqueItems, not, if/then/else, allOf, contains, dependent*, unknown ones), so a schema using them would
be "honoured" by output that breaks it. Every keyword is on an allow-list or the schema is refused, naming the
keyword and where it is (a JSON pointer). Likewise what it loosens with only a warning: a oneOf without a
discriminator (enforced as anyOf), a required name that properties lacks, and a pattern's (or a regex
constraint's) lookahead or inner anchors."""

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
    """spec, after the checks that need no xgrammar (a JSON schema's keywords, a regex's ignored parts);
    GrammarError names the problem."""
    if spec.json is not None:
        parse_schema(spec.json, "json")
    if spec.regex is not None:
        _check_regex(spec.regex, "regex", "regex")
    return spec


def _check_regex(pattern: str, param: str, where: str) -> None:
    """Refuse what xgrammar 0.2.8 ignores in a regex with only a warning, so that its output could break the
    pattern: lookahead ((?=, (?!) and an anchor (^, $) inside the pattern rather than at an end of it or of one of
    its alternatives. (What it cannot parse, lookbehind and backreferences among it, it refuses itself.)"""
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        if char == "\\":  # an escaped character, whatever it is
            i += 2
            continue
        if char == "[":  # a class: skipped whole (its ^ negates, its $ is a character)
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"  # a leading ] is a character
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            continue
        if pattern.startswith(("(?=", "(?!"), i):
            raise GrammarError(f"{param}: the lookahead at character {i} of '{where}' is not supported by "
                               "constrained decoding (it would be ignored, not enforced); rewrite it without one",
                               param)
        at_start = i == 0 or pattern[i - 1] in "(|" or pattern.endswith("(?:", 0, i)
        if (char == "^" and not at_start) or (char == "$" and i < n - 1 and pattern[i + 1] not in ")|"):
            raise GrammarError(f"{param}: the anchor '{char}' at character {i} of '{where}' is inside the pattern, "
                               "where constrained decoding ignores it (it would allow what the pattern forbids); "
                               "keep anchors at its ends", param)
        i += 1


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
        if keyword == "pattern" and isinstance(value, str):
            _check_regex(value, param, where)
        if keyword == "oneOf" and "discriminator" not in schema:
            raise GrammarError(f"{param}: 'oneOf' at '{where}' is enforced as anyOf (an output matching two of its "
                               "branches would pass); use anyOf if that is meant, or tell the branches apart with "
                               "a discriminator (a property of a different const in each)", param)
        if keyword == "required" and isinstance(value, list):
            _check_required(value, schema, param, where)
        _check_children(keyword, value, param, where)


def _check_required(names: list, schema: dict, param: str, where: str) -> None:
    """A required name must be one of properties': constrained decoding writes only those (a name it lacks would be
    ignored, and the output would break the schema)."""
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    missing = [name for name in names if name not in properties]
    if missing:
        raise GrammarError(f"{param}: '{where}' names {', '.join(map(repr, missing[:5]))}, not among the object's "
                           "properties: constrained decoding writes only listed properties; add "
                           f"{'it' if len(missing) == 1 else 'them'} to properties", param)


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
