"""Closing clients' JSON Schemas (``gateway.pipeline.json_schema``): only objects whose properties all come from their
``properties`` are closed, closing only ever removes answers, and the engine's grammar then refuses a key
the schema does not list, in ``response_format`` and in a forced tool call alike. Bounding their numbers
(``gateway.pipeline.json_numbers``): the defaults where the schema gives no bound, only ever removing answers,
and the grammar then ends an integer at 19 digits and a number at 6 decimals."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferflux.backends.engine import GuidedSpec
from inferflux.backends.engine.grammar_compiler import GrammarCompiler
from inferflux.gateway.pipeline.json_numbers import INT_BOUND, NUMBER_BOUND, NUMBER_STEP, bounded_numbers
from inferflux.gateway.pipeline.json_schema import closed_schema
from inferflux.gateway.pipeline.sampling import ResponseFormat
from inferflux.gateway.pipeline.tools import ToolDefinition, call_schema

A = {"type": "object", "properties": {"a": {"type": "integer"}}}
B = {"type": "object", "properties": {"b": {"type": "integer"}}}
CLOSED_A = {**A, "additionalProperties": False}


@pytest.mark.parametrize(
    ("schema", "closed"),
    [
        (A, CLOSED_A),
        ({"type": "array", "items": A}, {"type": "array", "items": CLOSED_A}),
        ({"type": "array", "prefixItems": [A]}, {"type": "array", "prefixItems": [CLOSED_A]}),
        ({"type": "object", "properties": {"in": A}}, {"type": "object", "properties": {"in": CLOSED_A},
                                                      "additionalProperties": False}),
        ({"$defs": {"x": A}, "$ref": "#/$defs/x"}, {"$defs": {"x": CLOSED_A}, "$ref": "#/$defs/x"}),
        ({"anyOf": [A, B]}, {"anyOf": [CLOSED_A, {**B, "additionalProperties": False}]}),
        # What an allOf describes inside is closed, though the branch itself is not (below).
        ({"allOf": [{"type": "object", "properties": {"in": A}}]},
         {"allOf": [{"type": "object", "properties": {"in": CLOSED_A}}]}),
    ],
)  # fmt: skip
def test_what_is_closed(schema: dict[str, Any], closed: dict[str, Any]) -> None:
    assert_rewritten(closed_schema, schema, closed)


def assert_rewritten(rewrite: Any, schema: dict[str, Any], expected: dict[str, Any]) -> None:
    before = json.dumps(schema)
    assert rewrite(schema) == expected
    assert json.dumps(schema) == before  # the client's schema is not changed in place


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},  # lists no properties: any object, as asked
        {**A, "additionalProperties": True},
        {**A, "patternProperties": {"^x": {}}},
        # The same object described twice: closing either would refuse the other's properties.
        {"allOf": [A, B]},
        {**A, "anyOf": [B]},
        {"if": B, "then": A},
        {"dependentSchemas": {"b": A}},
        {"$defs": {"x": A}, "allOf": [{"$ref": "#/$defs/x"}, B]},
        {"$defs": {"a/b": A}, "allOf": [{"$ref": "#/$defs/a~1b"}]},
        # Narrowing under `not` would widen the whole.
        {"not": A},
    ],
)
def test_what_is_left_as_it_is(schema: dict[str, Any]) -> None:
    assert closed_schema(schema) == schema


def test_an_all_of_of_two_objects_still_takes_both_properties() -> None:
    schema = {"allOf": [A, B]}
    jsonschema.validate({"a": 1, "b": 2}, closed_schema(schema))


# Schemas built from the constructs above, and values to try against them.
_leaf = st.sampled_from([{"type": "integer"}, {"type": "string"}, {}, {"type": "object"}])
_names = st.sampled_from(["a", "b", "c"])


def _extend(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    objects = st.fixed_dictionaries(
        {"type": st.just("object"), "properties": st.dictionaries(_names, inner, max_size=2)},
        optional={"required": st.lists(_names, max_size=2, unique=True), "additionalProperties": st.booleans()},
    )
    return st.one_of(
        objects,
        st.builds(lambda a, b: {"allOf": [a, b]}, objects, objects),
        st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner),
        st.builds(lambda o, a: {**o, "anyOf": [a]}, objects, inner),
        st.builds(lambda o: {"not": o}, objects),
        st.builds(lambda a: {"type": "array", "items": a}, inner),
    )


_schemas = st.recursive(_leaf, _extend, max_leaves=6)
_values = st.recursive(
    st.one_of(st.integers(-2, 2), st.sampled_from(["", "x"])),
    lambda inner: st.one_of(st.lists(inner, max_size=2), st.dictionaries(_names, inner, max_size=3)),
    max_leaves=6,
)


@settings(max_examples=400, deadline=None)
@given(_schemas, _values)
def test_closing_only_removes_answers(schema: dict[str, Any], value: Any) -> None:
    if jsonschema.Draft202012Validator(closed_schema(schema)).is_valid(value):
        assert jsonschema.Draft202012Validator(schema).is_valid(value), (schema, value)


# The engine's grammar, as the served model's tokenizer drives it.


@cache
def _compiler() -> tuple[GrammarCompiler, Any]:
    from inferflux.backends.models import default_model_path, open_model

    tokenizer = open_model(default_model_path()).tokenizer()
    return GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id]), tokenizer


def _accepts(spec: GuidedSpec, text: str) -> bool:
    compiler, tokenizer = _compiler()
    guide = compiler.compile(spec).guide()
    return all(guide.consume(t) for t in tokenizer.encode(text, add_special_tokens=False)) and guide.is_accepting


def test_a_response_format_takes_only_the_listed_keys() -> None:
    spec = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "n", "schema": A}}).guided()
    assert spec is not None
    assert _accepts(spec, '{"a":1}') and _accepts(spec, "{}")
    assert not _accepts(spec, '{"a":1,"z":2}')
    # The client's schema as given would have taken it: the closing is what refuses it.
    assert _accepts(GuidedSpec("json_schema", schema=A), '{"a":1,"z":2}')


def test_a_forced_tool_call_takes_only_the_listed_arguments() -> None:
    tool = ToolDefinition.model_validate({"type": "function", "function": {"name": "f", "parameters": A}})
    spec = GuidedSpec("json_schema", schema=call_schema([tool], parallel=False))
    assert _accepts(spec, '{"name":"f","arguments":{"a":1}}')
    assert not _accepts(spec, '{"name":"f","arguments":{"a":1,"z":2}}')


# -- numbers bounded (gateway.pipeline.json_numbers) -------------------------------------------------

LONG = {"type": "integer", "minimum": -INT_BOUND, "maximum": INT_BOUND}
DECIMAL = {"type": "number", "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND, "multipleOf": NUMBER_STEP}


@pytest.mark.parametrize(
    ("schema", "bounded"),
    [
        ({"type": "integer"}, LONG),
        ({"type": "number"}, DECIMAL),
        ({"type": ["integer", "null"]}, {**LONG, "type": ["integer", "null"]}),
        ({"type": "integer", "maximum": 5}, {**LONG, "maximum": 5}),  # the given side is kept
        ({"type": "integer", "exclusiveMinimum": 0}, {"type": "integer", "exclusiveMinimum": 0, "maximum": INT_BOUND}),
        ({"type": "number", "minimum": 1e20}, {"type": "number", "minimum": 1e20, "multipleOf": NUMBER_STEP}),
        ({"type": "number", "multipleOf": 0.5}, {**DECIMAL, "multipleOf": 0.5}),
        ({"type": "object", "properties": {"n": {"type": "integer"}}},
         {"type": "object", "properties": {"n": LONG}}),
        ({"type": "array", "items": {"type": "integer"}}, {"type": "array", "items": LONG}),
        ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, {"anyOf": [LONG, {"type": "string"}]}),
        ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"}, {"$defs": {"n": LONG}, "$ref": "#/$defs/n"}),
    ],
)  # fmt: skip
def test_what_is_bounded(schema: dict[str, Any], bounded: dict[str, Any]) -> None:
    assert_rewritten(bounded_numbers, schema, bounded)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "minimum": 0, "maximum": 9},
        {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "multipleOf": 0.25},
        {"type": "integer", "enum": [1, 2]},
        {"const": 7, "type": "integer"},
        {"type": "string"},
        {"not": {"type": "integer"}},  # narrowing under not would widen the whole
        {"$defs": {"n": {"type": "integer"}}, "if": {"$ref": "#/$defs/n"}, "then": {"type": "string"}},
    ],
)
def test_what_is_left_unbounded(schema: dict[str, Any]) -> None:
    assert bounded_numbers(schema) == schema


_numbers = st.recursive(
    st.one_of(st.integers(-(10**22), 10**22), st.floats(allow_nan=False, allow_infinity=False), st.just("x")),
    lambda inner: st.one_of(st.lists(inner, max_size=2), st.dictionaries(_names, inner, max_size=3)),
    max_leaves=6,
)
_number_leaf = st.sampled_from([{"type": "integer"}, {"type": "number"}, {"type": "integer", "maximum": 3},
                                {"type": ["number", "null"]}, {"type": "string"}])  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.recursive(_number_leaf, _extend, max_leaves=6), _numbers)
def test_bounding_only_removes_answers(schema: dict[str, Any], value: Any) -> None:
    if jsonschema.Draft202012Validator(bounded_numbers(schema)).is_valid(value):
        assert jsonschema.Draft202012Validator(schema).is_valid(value), (schema, value)


def test_the_grammar_ends_an_integer_at_19_digits_and_a_number_at_6_decimals() -> None:
    integer = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}).guided()  # fmt: skip
    assert integer is not None
    assert _accepts(integer, '{"n":1234567890123456789}') and _accepts(integer, '{"n":-1234567890123456789}')
    assert not _accepts(integer, '{"n":12345678901234567890}')  # 20 digits: never, however the model goes on
    assert _accepts(GuidedSpec("json_schema", schema={"type": "integer"}), "12345678901234567890")  # unbounded
    number = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "number"}}}).guided()  # fmt: skip
    assert number is not None
    assert _accepts(number, "3.141592") and _accepts(number, "-999999999999999.5")
    assert not _accepts(number, "3.1415926") and not _accepts(number, "1e5") and not _accepts(number, "1" * 17)
    given = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "maximum": 5}}}).guided()  # fmt: skip
    assert given is not None and _accepts(given, "5") and not _accepts(given, "6")


def test_a_forced_tool_calls_integer_is_bounded() -> None:
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    tool = ToolDefinition.model_validate({"type": "function", "function": {"name": "f", "parameters": parameters}})
    spec = GuidedSpec("json_schema", schema=call_schema([tool], parallel=False))
    assert _accepts(spec, '{"name":"f","arguments":{"n":42}}')
    assert not _accepts(spec, '{"name":"f","arguments":{"n":123456789012345678901}}')
