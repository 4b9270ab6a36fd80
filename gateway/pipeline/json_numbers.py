"""Bounding the numbers of a client's JSON Schema before the engine decodes under it.

An ``integer`` or ``number`` with no bound lets a model write digits for as
long as ``max_tokens`` lets it: at temperature 0 SmolLM2 does, and the answer,
cut, does not parse. So every ``integer`` and ``number`` a schema describes gets
a default bound where the schema gives none, each side on its own:

- an integer lies within ``±INT_BOUND`` (at most 19 digits and an optional minus:
  int64's range, to within 1,024 of each end, since the grammar engine takes a
  bound as a double and refuses one it cannot read exactly);
- a number lies within ``±NUMBER_BOUND`` (at most 15 digits before the point), is
  a multiple of ``NUMBER_STEP`` (at most 6 after it), and, being bounded, is
  written without an exponent.

A bound the schema gives (``minimum``, ``exclusiveMinimum``, ``maximum``,
``exclusiveMaximum``, a number's ``multipleOf``) is kept, and a default that
would contradict it (a default maximum below its ``minimum``) is not added; a
value with ``enum`` or ``const`` is left as it is. Bounding only removes
answers, so every answer still validates against the schema the client gave;
nothing under ``not`` or ``if``, nor a definition that a ``$ref`` there points
at, is touched: narrowing there widens the whole.
"""

from __future__ import annotations

from typing import Any, Final

from inferflux.gateway.pipeline.json_schema import pointer_token

INT_BOUND: Final = 9_223_372_036_854_774_784  # the largest double below 2**63: int64's range, within 1,024
NUMBER_BOUND: Final = 10**15  # a double's 15 exact digits
NUMBER_STEP: Final = 1e-6  # at most 6 digits after the point
# Subschemas narrowed with the schema they sit in (all but ``not`` and ``if``), by how they hold them.
_ONE: Final = ("items", "additionalItems", "contains", "additionalProperties", "unevaluatedProperties",
               "unevaluatedItems", "then", "else")  # fmt: skip
_LIST: Final = ("items", "prefixItems", "allOf", "anyOf", "oneOf")  # items: a list before draft 2020-12
_MAP: Final = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_WIDENING: Final = ("not", "if")


def bounded_numbers(schema: Any) -> Any:
    """``schema`` with every unbounded ``integer`` and ``number`` given the default bounds (a copy; the
    client's schema is not changed in place)."""
    spared: set[str] = set()
    _find_refs_under_widening(schema, spared, widening=False)
    return _bound(schema, "#", spared)


def _find_refs_under_widening(schema: Any, spared: set[str], *, widening: bool) -> None:
    if isinstance(schema, list):
        for item in schema:
            _find_refs_under_widening(item, spared, widening=widening)
        return
    if not isinstance(schema, dict):
        return
    if widening and isinstance(schema.get("$ref"), str):
        spared.add(schema["$ref"])
    for key, value in schema.items():
        if isinstance(value, dict | list):
            _find_refs_under_widening(value, spared, widening=widening or key in _WIDENING)


def _bound(schema: Any, at: str, spared: set[str]) -> Any:
    """``schema`` (found at the JSON Pointer ``at``) and what it holds bounded, unless a ``$ref`` from
    under ``not``/``if`` points at it."""
    if not isinstance(schema, dict) or at in spared:
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _bound(out[key], f"{at}/{key}", spared)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_bound(s, f"{at}/{key}/{i}", spared) for i, s in enumerate(out[key])]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {n: _bound(s, f"{at}/{key}/{pointer_token(n)}", spared) for n, s in out[key].items()}
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "enum" in out or "const" in out:
        return out
    if "number" in kinds:
        _add_defaults(out, NUMBER_BOUND)
        out.setdefault("multipleOf", NUMBER_STEP)
    elif "integer" in kinds:
        _add_defaults(out, INT_BOUND)
    return out


def _add_defaults(schema: dict[str, Any], bound: int) -> None:
    """``-bound`` and ``bound`` where the schema gives no bound on that side and the default leaves room."""
    low = _given(schema, "minimum", "exclusiveMinimum")
    high = _given(schema, "maximum", "exclusiveMaximum")
    if low is None and (high is None or not isinstance(high, int | float) or high > -bound):
        schema["minimum"] = -bound
    if high is None and (low is None or not isinstance(low, int | float) or low < bound):
        schema["maximum"] = bound


def _given(schema: dict[str, Any], *keys: str) -> Any:
    """The bound the schema gives on one side (any value: a malformed one is the grammar engine's to refuse)."""
    return next((schema[k] for k in keys if k in schema and not isinstance(schema[k], bool)), None)
