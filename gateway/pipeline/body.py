"""The one decoder for every JSON request body: limits and Unicode rules, or a 400 naming the path.

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
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inferflux.gateway.errors import InvalidRequest, MalformedJSON, UnsupportedMediaType

if TYPE_CHECKING:
    from inferflux.gateway.pipeline.call import Call

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


async def read_body(call: Call) -> dict[str, Any]:
    """An API call's body: JSON by its ``Content-Type`` (415, before the body is read), decoded within the
    app's limits (400)."""
    content_type = call.headers.get("content-type")
    if content_type is not None:
        media_type = content_type.split(";", 1)[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            raise UnsupportedMediaType(f"Content-Type must be application/json, not {media_type or 'empty'!r}")
    return decode_json_body(await call.body(), call.state.json_limits)
