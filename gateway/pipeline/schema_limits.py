"""Size limits on a request's schemas, tools and guided constraints, decided before any guardrail or grammar work.

What a generation request asks to be enforced — ``response_format.json_schema.schema``,
each ``tools[i].function.parameters``, ``guided_regex``, ``guided_choice`` — costs the
gateway before the model runs, in proportion to its size and shape: the input
guardrails scan every string of it (an enum of 5,000 values is 5,000 texts), and the
grammar engine builds each into a grammar, where some shapes cost exponentially (a
string with many ``pattern``s in an ``allOf``). So the route checks the body as
decoded against these limits first, before the input guardrails
(``check_schemas``, called by the driver, ``gateway.pipeline.run``, before
``RequestPolicy.screen``): over one is a 400 ``schema_too_complex`` whose ``param``
names the field, at the cost of one walk of the schemas. The shape the limits pass
may still be hard to compile: the grammar budget (``gateway.pipeline.grammars``,
``backends.engine.grammar_sandbox``) bounds that.

The totals count every schema of the request together (the response format's and
each tool's parameters); a body that is not the API's shape is left to the parser.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from inferflux.gateway.errors import SchemaTooComplex
from inferflux.gateway.pipeline.tools import MAX_TOOLS

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
