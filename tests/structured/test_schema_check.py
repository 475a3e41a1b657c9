"""Our check of JSON schemas: what xgrammar would ignore is refused, naming the keyword and where it is."""

import json

import pytest

from deltaserve.sampling_params import StructuredOutputsParams
from deltaserve.structured import GrammarError
from deltaserve.structured.schema_check import checked, parse_schema


@pytest.mark.parametrize("schema, message", [
    ({"type": "array", "uniqueItems": True}, r"keyword 'uniqueItems' at '/uniqueItems' is not supported"),
    ({"not": {"type": "integer"}}, r"keyword 'not' at '/not'"),
    ({"if": {"type": "integer"}, "then": {"minimum": 1}}, r"keyword 'if' at '/if'"),
    ({"allOf": [{"type": "integer"}]}, r"keyword 'allOf'"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"contains": {}}}}},
     r"keyword 'contains' at '/properties/a/items/contains'"),
    ({"anyOf": [{"type": "string", "foo": 1}]}, r"keyword 'foo' at '/anyOf/0/foo'"),
    ({"type": "string", "format": "ipv5"}, r"format 'ipv5' at '/format' is not supported"),
    ({"type": "string", "format": ["date"]}, r"format \['date'\] at '/format' is not supported"),
    ({"type": "string", "format": {"a": 1}}, r"format \{'a': 1\} at '/format' is not supported"),
    ({"properties": []}, r"'/properties' must be an object of name -> schema"),
    ({"anyOf": []}, r"'/anyOf' must be a non-empty list of schemas"),
    ("[1, 2]", r"must be a JSON object \(a JSON schema\), got list"),
    ("{not json", r"json is not valid JSON"),
    ("[" * 100000, r"json nests deeper than JSON text can be read"),  # json.loads: a RecursionError, not a 500
    # what xgrammar would ignore with a warning only, so that output could break the schema
    ({"type": "string", "pattern": "^(?!a)[ab]{3}$"}, r"the lookahead at character 1 of '/pattern'"),
    ({"type": "string", "pattern": "a^b"}, r"the anchor '\^' at character 1 of '/pattern' is inside the pattern"),
    ({"oneOf": [{"type": "integer", "maximum": 9}, {"type": "integer", "minimum": 5}]}, r"'oneOf' at '/oneOf' is "
     "enforced as anyOf"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, r"'/required' names 'b', not among"),
    ({"type": "object", "required": ["b"]}, r"'/required' names 'b'"),
])
def test_refused(schema, message):
    with pytest.raises(GrammarError, match=message) as err:
        parse_schema(schema, "json")
    assert err.value.param == "json"


@pytest.mark.parametrize("pattern", ["^ab$", "(^a|^b)", "(?:^a|b$)", "[$^]x", "[]^]", r"a\^b", r"\$x", "ab$",
                                     "^(a|b)$"])
def test_anchors_at_an_end_and_escaped_or_in_a_class_pass(pattern):
    parse_schema({"type": "string", "pattern": pattern}, "json")
    checked(StructuredOutputsParams(regex=pattern))


def test_a_regex_constraint_is_checked_as_a_pattern_is():
    with pytest.raises(GrammarError, match="the anchor '\\$' at character 1 of 'regex'") as err:
        checked(StructuredOutputsParams(regex="a$b"))
    assert err.value.param == "regex"


def test_nesting_is_bounded_where_it_enters():
    """A schema nested far past MAX_DEPTH (a few KB of request body) is one clear error, not a RecursionError
    (a 500) or a compile that holds the grammar pool for seconds; MAX_DEPTH levels pass."""
    from deltaserve.structured.schema_check import MAX_DEPTH

    def nested(levels, kind):
        schema = {"type": "integer"}
        for _ in range(levels):
            schema = {"type": "array", "items": schema} if kind == "items" else {
                "type": "object", "properties": {"a": schema}}
        return schema

    for kind in ("items", "properties"):
        parse_schema(nested(MAX_DEPTH, kind), "json")
        with pytest.raises(GrammarError, match=f"nests deeper than {MAX_DEPTH} levels"):
            parse_schema(nested(5000, kind), "json")


def test_schemas_differing_in_property_order_are_different_constraints():
    """xgrammar writes properties in the schema's order, so two orders must not share one compiled grammar."""
    from deltaserve.sampling_params import StructuredOutputsParams

    a = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    b = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert StructuredOutputsParams(json=a).key != StructuredOutputsParams(json=b).key
    assert StructuredOutputsParams(json=a).key == StructuredOutputsParams(json=dict(a)).key


def test_a_pydantic_schema_passes():
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8, description="what it is")
        tags: list[str] = pydantic.Field(max_length=3)
        price: float | None = None

    class Order(pydantic.BaseModel):
        items: list[Item]
        kind: str = pydantic.Field(json_schema_extra={"enum": ["a", "b"]})

    schema = Order.model_json_schema()
    assert parse_schema(schema, "json") is schema


def test_a_pydantic_discriminated_union_passes():
    """pydantic writes a discriminated union as oneOf with a discriminator: its branches cannot overlap."""
    from typing import Literal

    pydantic = pytest.importorskip("pydantic")

    class Cat(pydantic.BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(pydantic.BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pet(pydantic.BaseModel):
        pet: Cat | Dog = pydantic.Field(discriminator="kind")

    schema = Pet.model_json_schema()
    assert "oneOf" in json.dumps(schema) and parse_schema(schema, "json") is schema


@pytest.mark.parametrize("schema, words", [({"enum": {1, 2}}, "Object of type set is not JSON serializable"),
                                           ({"const": float("nan")}, None)])
def test_a_schema_that_is_not_json_is_a_param_error(schema, words):
    """A dict holding what JSON cannot hold is refused where it enters, naming the field (was a TypeError from the
    cache key). NaN is JSON to Python's json, so it passes here (the compiler judges it)."""
    from deltaserve.sampling_params import ParamError

    if words is None:
        StructuredOutputsParams(json=schema)
        return
    with pytest.raises(ParamError, match=words) as err:
        StructuredOutputsParams(json=schema)
    assert err.value.field == "json"
