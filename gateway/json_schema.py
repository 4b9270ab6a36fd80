"""Closing a client's JSON Schema before the engine decodes under it.

JSON Schema lets an object hold properties it does not list unless it says
``additionalProperties: false``, and most schemas clients send do not say it.
Decoded under such a schema as written, a small model invents keys for as long
as ``max_tokens`` lets it (SmolLM2 does, at temperature 0): the answer is
valid, and useless. So an object that lists its ``properties`` and says
nothing of other properties takes only those, as under xgrammar's default
"strict mode", which vLLM serves. Closing only removes answers: every answer
decoded under the closed schema is valid against the schema the client gave.

An object is closed only where that cannot remove every answer.
``additionalProperties`` sees only the ``properties`` beside it, so a
subschema that applies to the same object as other subschemas (a branch of
``allOf``, ``then``/``else``, ``dependentSchemas``; a branch of
``anyOf``/``oneOf`` whose parent has properties of its own) is left open, and
so is an object with any of those beside its ``properties``, and a definition
that such a place refers to (``$ref``): closing two ``allOf`` branches that
list different properties would leave only the empty object. Their nested
objects are closed as usual. Nothing under ``not`` or ``if`` is touched:
narrowing there widens the whole.
"""

from __future__ import annotations

from typing import Any

# Subschemas that describe other values than the object they sit in (its items, its properties' values).
_ELSEWHERE_ONE = ("items", "additionalItems", "contains", "additionalProperties", "unevaluatedProperties")
_ELSEWHERE_MAP = ("properties", "patternProperties")
_DEFINITIONS = ("$defs", "definitions")
# Subschemas that describe the same object as the one they sit in.
_SAME_ONE = ("then", "else")
_SAME_LIST = ("allOf",)
_SAME_MAP = ("dependentSchemas",)
_ALTERNATIVES = ("anyOf", "oneOf", "prefixItems")
# Beside any of these an object's properties are not only its ``properties``.
_OPEN_BESIDE = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
                "$ref", "dependentSchemas", "if", "then", "else")  # fmt: skip


def closed_schema(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties``, and takes properties from nowhere else,
    closed to them (``additionalProperties: false``)."""
    shared: set[str] = set()
    _find_shared_refs(schema, shared)
    return _close(schema, close=True, shared=shared, at="#")


def _find_shared_refs(schema: Any, shared: set[str]) -> None:
    """Collect the ``$ref``s of every subschema that applies to an object alongside others."""
    if isinstance(schema, list):
        for item in schema:
            _find_shared_refs(item, shared)
        return
    if not isinstance(schema, dict):
        return
    same = [schema[k] for k in _SAME_ONE if isinstance(schema.get(k), dict)]
    same += [s for k in _SAME_LIST if isinstance(schema.get(k), list) for s in schema[k]]
    same += [s for k in _SAME_MAP if isinstance(schema.get(k), dict) for s in schema[k].values()]
    if _has_own_properties(schema):
        same += [s for k in ("anyOf", "oneOf") if isinstance(schema.get(k), list) for s in schema[k]]
        if isinstance(schema.get("$ref"), str):
            shared.add(schema["$ref"])
    for sub in same:
        if isinstance(sub, dict) and isinstance(sub.get("$ref"), str):
            shared.add(sub["$ref"])
    for value in schema.values():
        if isinstance(value, dict | list):
            _find_shared_refs(value, shared)


def _has_own_properties(schema: dict[str, Any]) -> bool:
    return any(k in schema for k in ("properties", "patternProperties", "required", "additionalProperties"))


def _close(schema: Any, *, close: bool, shared: set[str], at: str) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ELSEWHERE_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], close=True, shared=shared, at=f"{at}/{key}")
    for key in _ELSEWHERE_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {n: _close(s, close=True, shared=shared, at=f"{at}/{key}/{n}") for n, s in out[key].items()}
    for key in _DEFINITIONS:
        if isinstance(out.get(key), dict):
            out[key] = {n: _close(s, close=f"{at}/{key}/{_escaped(n)}" not in shared, shared=shared,
                                  at=f"{at}/{key}/{_escaped(n)}")
                        for n, s in out[key].items()}  # fmt: skip
    for key in _SAME_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], close=False, shared=shared, at=f"{at}/{key}")
    for key in _SAME_LIST:
        if isinstance(out.get(key), list):
            out[key] = [_close(s, close=False, shared=shared, at=f"{at}/{key}/{i}") for i, s in enumerate(out[key])]
    for key in _SAME_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {n: _close(s, close=False, shared=shared, at=f"{at}/{key}/{n}") for n, s in out[key].items()}
    alone = not _has_own_properties(schema)  # alternatives of an object with no properties of its own
    for key in _ALTERNATIVES:
        if isinstance(out.get(key), list):
            out[key] = [_close(s, close=alone or key == "prefixItems", shared=shared, at=f"{at}/{key}/{i}")
                        for i, s in enumerate(out[key])]  # fmt: skip
    if close and isinstance(out.get("properties"), dict) and not any(key in out for key in _OPEN_BESIDE):
        out["additionalProperties"] = False
    return out


def _escaped(name: str) -> str:
    """``name`` as a JSON Pointer token (RFC 6901), as a ``$ref`` to it spells it."""
    return name.replace("~", "~0").replace("/", "~1")
