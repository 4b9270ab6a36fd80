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

# Subschemas that describe other values than the object they sit in (its items, its properties' values),
# and definitions (closed unless a place that describes an object alongside others refers to them).
_ELSEWHERE_ONE = ("items", "additionalItems", "contains", "additionalProperties", "unevaluatedProperties")
_ELSEWHERE_LIST = ("prefixItems",)
_ELSEWHERE_MAP = ("properties", "patternProperties", "$defs", "definitions")
# Subschemas that describe the same object as the one they sit in.
_SAME_ONE = ("then", "else")
_SAME_LIST = ("allOf",)
_SAME_MAP = ("dependentSchemas",)
_ALTERNATIVES = ("anyOf", "oneOf")  # the same object too, but each alone describes all of it
_MAPS = _ELSEWHERE_MAP + _SAME_MAP  # name -> subschema
# Beside any of these an object's properties are not only its ``properties``.
_OPEN_BESIDE = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
                "$ref", "dependentSchemas", "if", "then", "else")  # fmt: skip


def closed_schema(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties``, and takes properties from nowhere else,
    closed to them (``additionalProperties: false``)."""
    shared: set[str] = set()
    _find_shared_refs(schema, shared)
    return _close(schema, "#", close=True, shared=shared)


def _find_shared_refs(schema: Any, shared: set[str]) -> None:
    """Collect the ``$ref``s of every subschema that describes an object alongside others."""
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
        same += [s for k in _ALTERNATIVES if isinstance(schema.get(k), list) for s in schema[k]]
        same.append(schema)  # a $ref beside its own properties
    shared.update(sub["$ref"] for sub in same if isinstance(sub, dict) and isinstance(sub.get("$ref"), str))
    for value in schema.values():
        if isinstance(value, dict | list):
            _find_shared_refs(value, shared)


def _has_own_properties(schema: dict[str, Any]) -> bool:
    return any(k in schema for k in ("properties", "patternProperties", "required", "additionalProperties"))


def _close(schema: Any, at: str, *, close: bool, shared: set[str]) -> Any:
    """``schema`` (found at the JSON Pointer ``at``) closed; ``close=False`` leaves its own object open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)

    def each(keys: tuple[str, ...], close: bool) -> None:
        for key in keys:
            value = out.get(key)
            if isinstance(value, dict) and key in _MAPS:
                out[key] = {n: _close(s, f"{at}/{key}/{pointer_token(n)}", close=close, shared=shared)
                            for n, s in value.items()}  # fmt: skip
            elif isinstance(value, dict):
                out[key] = _close(value, f"{at}/{key}", close=close, shared=shared)
            elif isinstance(value, list):
                out[key] = [_close(s, f"{at}/{key}/{i}", close=close, shared=shared) for i, s in enumerate(value)]

    each(_ELSEWHERE_ONE + _ELSEWHERE_LIST + _ELSEWHERE_MAP, True)
    each(_SAME_ONE + _SAME_LIST + _SAME_MAP, False)
    each(_ALTERNATIVES, not _has_own_properties(schema))
    close = close and at not in shared  # a place a same-object $ref points at
    if close and isinstance(out.get("properties"), dict) and not any(key in out for key in _OPEN_BESIDE):
        out["additionalProperties"] = False
    return out


def pointer_token(name: str) -> str:
    """``name`` as a JSON Pointer token (RFC 6901), as a ``$ref`` to it spells it."""
    return name.replace("~", "~0").replace("/", "~1")
