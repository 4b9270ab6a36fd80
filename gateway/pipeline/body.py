"""An API call's body, the pipeline's first stage (``read_body``): JSON by its media type, within its limits, then
its schemas' size.

## JSON

Python's ``json`` takes more than a gateway should: integers of any length (and
converting one past 4300 digits raises a ``ValueError`` nobody expects), ``NaN``
and ``Infinity``, ``1e400`` (read as infinity), nesting up to the interpreter's
recursion limit, and ``"\\ud800"`` (a lone surrogate: a ``str`` that cannot be
encoded, so it fails later in a tokenizer, a regex engine, a database driver or
a response, as a 500). Every route decodes its body here instead, so each of
those is one 400 with an OpenAI-shaped error whose ``param`` is the JSON path
(``messages[0].content``), before any other layer sees the value.

The limits (``JsonLimits``, from the ``input_limits`` settings) bound the work
a body can cause beyond its size (``max_body_bytes``): depth, digits of an
integer, characters of a string, items of an array, keys of an object.

Numbers are read by hooks that return markers instead of raising, so the walk
that checks the rest can name where the number was.

## Schemas

What a generation request asks to be enforced — ``response_format.json_schema.schema``,
each ``tools[i].function.parameters``, ``guided_regex``, ``guided_choice`` — costs the
gateway before the model runs, in proportion to its size and shape: the input
guardrails scan every string of it (an enum of 5,000 values is 5,000 texts), and the
grammar engine builds each into a grammar, where some shapes cost exponentially (a
string with many ``pattern``s in an ``allOf``). So the body as decoded is checked
against these limits (``SchemaLimits``, ``check_schemas``) as it is read, before the
input guardrails (``RequestPolicy.screen``): over one is a 400 ``schema_too_complex``
whose ``param`` names the field, at the cost of one walk of the schemas. The shape
the limits pass may still be hard to compile: the grammar budget
(``gateway.pipeline.grammars``, ``backends.engine.grammar_sandbox``) bounds that.

The totals count every schema of the request together (the response format's and
each tool's parameters); a body that is not the API's shape is left to the parser.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from inferflux.gateway.errors import InvalidRequest, MalformedJSON, SchemaTooComplex, UnsupportedMediaType
from inferflux.gateway.pipeline.tools import MAX_TOOLS

# (parent path, key): built per container while walking, joined into a string only for an error.
_Path = tuple[Any, ...] | None


@dataclass(frozen=True, slots=True)
class JsonLimits:
    """What one JSON body may hold (the ``input_limits`` settings say the same, with defaults)."""

    max_depth: int = 32
    max_integer_digits: int = 64
    max_string_length: int = 4 * 1024 * 1024
    max_array_length: int = 100_000
    max_object_keys: int = 1_000
    # U+0000 is valid JSON and fine in a prompt, but PostgreSQL's text columns
    # refuse it: bodies whose strings the store keeps (admin) set this False.
    allow_nul: bool = True


DEFAULT_LIMITS = JsonLimits()


class JsonLimitExceeded(InvalidRequest):
    """400: the body is JSON but breaks one of the decoder's rules; ``code`` names the rule."""


@dataclass(frozen=True, slots=True)
class _BadNumber:
    """What the number hooks return in place of a number the rules refuse."""

    code: str
    message: str


def _parse_int(limits: JsonLimits) -> Any:
    def parse(literal: str) -> int | _BadNumber:
        digits = len(literal) - (literal[0] == "-")
        if digits > limits.max_integer_digits:
            return _BadNumber("integer_too_long", f"an integer of {digits} digits exceeds the limit of "
                                                  f"{limits.max_integer_digits}")  # fmt: skip
        return int(literal)

    return parse


def _parse_float(literal: str) -> float | _BadNumber:
    value = float(literal)
    if math.isinf(value):  # 1e400: JSON syntax, but no double holds it
        return _BadNumber("number_out_of_range", f"the number {literal[:32]} is out of range")
    return value


def _parse_constant(literal: str) -> _BadNumber:
    # NaN, Infinity and -Infinity are not JSON at all; Python accepts them by default.
    return _BadNumber("number_out_of_range", f"{literal} is not a JSON number")


def json_path(path: _Path) -> str | None:
    """``(((None, "messages"), 0), "content")`` -> ``"messages[0].content"``; None for the body itself."""
    keys: list[Any] = []
    while path is not None:
        path, key = path
        keys.append(key)
    out = ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or None


def _fail(code: str, message: str, path: _Path) -> JsonLimitExceeded:
    param = json_path(path)
    where = f"{param}: " if param else ""
    return JsonLimitExceeded(f"{where}{message}", param=param, code=code)


def _check_text(value: str, path: _Path, limits: JsonLimits, what: str = "a string") -> None:
    if len(value) > limits.max_string_length:
        raise _fail("string_too_long", f"{what} of {len(value)} characters exceeds the limit of "
                                       f"{limits.max_string_length}", path)  # fmt: skip
    if not limits.allow_nul and "\x00" in value:
        raise _fail("invalid_unicode", f"{what} holds U+0000 (NUL), which is not allowed here", path)
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        # Only a lone surrogate gets here: json pairs \ud83d\ude00 into one character.
        raise _fail("invalid_unicode", f"{what} holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                                       "which is not a character", path) from None  # fmt: skip


def _check_container(node: Any, path: _Path, depth: int, limits: JsonLimits) -> None:
    if depth > limits.max_depth:
        raise _fail("json_too_deep", f"the body is nested deeper than {limits.max_depth} levels", path)
    if isinstance(node, list) and len(node) > limits.max_array_length:
        raise _fail("array_too_long", f"an array of {len(node)} items exceeds the limit of "
                                      f"{limits.max_array_length}", path)  # fmt: skip
    if isinstance(node, dict) and len(node) > limits.max_object_keys:
        raise _fail("too_many_keys", f"an object of {len(node)} keys exceeds the limit of "
                                     f"{limits.max_object_keys}", path)  # fmt: skip


def check_value(value: Any, limits: JsonLimits = DEFAULT_LIMITS) -> None:
    """Raise ``JsonLimitExceeded`` naming the first place where ``value`` (decoded JSON) breaks a rule.

    Iterative, so a deep value cannot exhaust the stack; numbers and the other
    scalars are skipped without building their paths.
    """
    stack: list[tuple[Any, _Path, int]] = [(value, None, 1)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            _check_text(node, path, limits)
            continue
        if isinstance(node, _BadNumber):
            raise _fail(node.code, node.message, path)
        if isinstance(node, dict):
            _check_container(node, path, depth, limits)
            for key, item in node.items():
                _check_text(key, path, limits, "an object key")  # named by its object
                if isinstance(item, str | dict | list | _BadNumber):
                    stack.append((item, (path, key), depth + 1))
        elif isinstance(node, list):
            _check_container(node, path, depth, limits)
            for index, item in enumerate(node):
                if isinstance(item, str | dict | list | _BadNumber):
                    stack.append((item, (path, index), depth + 1))


def decode_json_body(body: bytes, limits: JsonLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """The body as a JSON object, checked against ``limits``; 400 (``MalformedJSON`` or ``JsonLimitExceeded``)."""
    if not body.strip():
        raise MalformedJSON("The request body is empty; expected a JSON object")
    try:
        data = json.loads(
            body, parse_int=_parse_int(limits), parse_float=_parse_float, parse_constant=_parse_constant
        )
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedJSON(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise JsonLimitExceeded(
            f"The request body is nested deeper than {limits.max_depth} levels", code="json_too_deep"
        ) from None
    if not isinstance(data, dict):
        raise MalformedJSON("The request body must be a JSON object")
    check_value(data, limits)
    return data


async def read_body(content_type: str | None, read: Callable[[], Awaitable[bytes]], limits: JsonLimits,
                    schema_limits: SchemaLimits | None) -> dict[str, Any]:  # fmt: skip
    """An API call's body (``read``): JSON by its ``Content-Type`` (415, before the body is read), decoded
    within ``limits`` (400), then the size of its schemas, tools and guided constraints within
    ``schema_limits`` (400 ``schema_too_complex``; None: a vendor's body, whose chat body is checked once
    translated)."""
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise UnsupportedMediaType(f"Content-Type must be application/json, not {media_type or 'empty'!r}")
    body = decode_json_body(await read(), limits)
    if schema_limits is not None:
        check_schemas(body, schema_limits)  # before any guardrail or grammar work
    return body


# -- the schemas' size: before any guardrail or grammar work

# Keywords whose number is a size the answer, or the grammar, must reach.
BOUNDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
          "maxContains")  # fmt: skip


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """The limits (``input_limits.schema_*`` settings; the module docstring says why)."""

    max_bytes: int = 65_536  # each schema, as compact JSON (UTF-8); guided_choice's choices together
    max_total_bytes: int = 524_288  # every schema of the request together
    max_keywords: int = 10_000  # object keys (keywords, property names), every schema together
    max_depth: int = 24  # nesting of arrays and objects inside one schema
    max_enum_values: int = 2_000  # enum entries, every schema together, and guided_choice's choices
    max_patterns: int = 128  # pattern and patternProperties regexes, every schema together
    max_pattern_bytes: int = 4_096  # each of those regexes, and guided_regex (UTF-8)
    max_bound: int = 100_000  # each minLength, maxLength, minItems, maxItems, ... (BOUNDS)


DEFAULT_SCHEMA_LIMITS = SchemaLimits()


@dataclass
class _Totals:
    bytes: int = 0
    keywords: int = 0
    enum_values: int = 0
    patterns: int = 0


def check_schemas(body: Mapping[str, Any], limits: SchemaLimits = DEFAULT_SCHEMA_LIMITS) -> None:
    """Raise ``SchemaTooComplex`` naming the first field over a limit; nothing else is checked here."""
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise SchemaTooComplex(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}", param="tools")
    totals = _Totals()
    for param, schema in _schemas(body):
        _check_schema(param, schema, limits, totals)
    regex = body.get("guided_regex")
    if isinstance(regex, str):
        _check_pattern("guided_regex", regex, limits)
    choices = body.get("guided_choice")
    if isinstance(choices, list):
        size = sum(len(c.encode("utf-8", "surrogatepass")) for c in choices if isinstance(c, str))
        if size > limits.max_bytes:
            _refuse("guided_choice", f"its choices hold {size} bytes together", limits.max_bytes, "schema_max_bytes")
        if len(choices) + totals.enum_values > limits.max_enum_values:
            _refuse("guided_choice", f"{len(choices)} choices beside {totals.enum_values} enum values",
                    limits.max_enum_values, "schema_max_enum_values")  # fmt: skip


def _schemas(body: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(the field, the schema) of each JSON Schema the body asks to be enforced."""
    response_format = body.get("response_format")
    json_schema = response_format.get("json_schema") if isinstance(response_format, Mapping) else None
    if isinstance(json_schema, Mapping) and "schema" in json_schema:
        yield "response_format.json_schema.schema", json_schema["schema"]
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and "parameters" in function:
            yield f"tools[{i}].function.parameters", function["parameters"]


def _check_schema(param: str, schema: Any, limits: SchemaLimits, totals: _Totals) -> None:
    size = len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        _refuse(param, f"the schema is {size} bytes of JSON", limits.max_bytes, "schema_max_bytes")
    totals.bytes += size
    if totals.bytes > limits.max_total_bytes:
        _refuse(param, f"the request's schemas are {totals.bytes} bytes of JSON together", limits.max_total_bytes,
                "schema_max_total_bytes")  # fmt: skip
    stack: list[tuple[Any, int, str]] = [(schema, 1, "#")]
    while stack:
        value, depth, at = stack.pop()
        if not isinstance(value, dict | list):
            continue
        if depth > limits.max_depth:
            _refuse(param, f"the schema nests deeper than that at {at}", limits.max_depth, "schema_max_depth")
        if isinstance(value, list):
            stack.extend((item, depth + 1, f"{at}/{i}") for i, item in enumerate(value))
            continue
        totals.keywords += len(value)
        for key, item in value.items():
            where = f"{at}/{_escaped(key)}"
            if key == "enum" and isinstance(item, list):
                totals.enum_values += len(item)
            elif key == "pattern" and isinstance(item, str):
                _count_pattern(param, where, item, limits, totals)
            elif key == "patternProperties" and isinstance(item, dict):
                for name in item:
                    _count_pattern(param, f"{where}/{_escaped(name)}", name, limits, totals)
            elif key in BOUNDS and isinstance(item, int | float) and not isinstance(item, bool) and item > limits.max_bound:
                _refuse(param, f"{key} is {item:g} at {where}", limits.max_bound, "schema_max_bound")
            stack.append((item, depth + 1, where))
        if totals.keywords > limits.max_keywords:
            _refuse(param, f"the request's schemas hold {totals.keywords} keys together", limits.max_keywords,
                    "schema_max_keywords")  # fmt: skip
        if totals.enum_values > limits.max_enum_values:
            _refuse(param, f"the request's schemas hold {totals.enum_values} enum values together",
                    limits.max_enum_values, "schema_max_enum_values")  # fmt: skip


def _count_pattern(param: str, where: str, pattern: str, limits: SchemaLimits, totals: _Totals) -> None:
    totals.patterns += 1
    if totals.patterns > limits.max_patterns:
        _refuse(param, f"the request's schemas hold {totals.patterns} patterns together (the last at {where})",
                limits.max_patterns, "schema_max_patterns")  # fmt: skip
    _check_pattern(param, pattern, limits, where)


def _check_pattern(param: str, pattern: str, limits: SchemaLimits, where: str = "") -> None:
    size = len(pattern.encode("utf-8", "surrogatepass"))
    if size > limits.max_pattern_bytes:
        _refuse(param, f"a regular expression of {size} bytes{f' at {where}' if where else ''}",
                limits.max_pattern_bytes, "schema_max_pattern_bytes")  # fmt: skip


def _refuse(param: str, what: str, limit: int, setting: str) -> None:
    raise SchemaTooComplex(f"too complex to enforce: {what}; the limit is {limit} (input_limits.{setting})",
                           param=param)  # fmt: skip


def _escaped(name: Any) -> str:
    """A JSON Pointer token (RFC 6901), as the messages name a place in a schema."""
    return str(name).replace("~", "~0").replace("/", "~1")
