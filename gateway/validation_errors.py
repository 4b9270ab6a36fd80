"""One readable line for a pydantic ``ValidationError``, the same for every body and setting.

A client or an operator is told the first error only: where, written as the
OpenAI API writes a parameter (``messages[0].content``), and what, in pydantic's
words without the ``Value error, `` that pydantic puts before a validator's own
message. Pydantic's location also holds the tags of union members (``str``,
``list[str]``, ``function-after[...]``); they name no field and are left out.
A field the model does not know (``extra="forbid"``) is named by the caller's
word for one: "unknown field" in a request body, "unknown setting" in the settings.

Used by the OpenAI request parser (``gateway.pipeline.protocol``), the admin body parser
(``gateway.routes.admin.common``) and the settings loader
(``gateway.settings.loading``). It imports nothing of the project, so any layer
that validates with pydantic could use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

# Pydantic's tags for the members of a union; other tags carry brackets ("list[str]").
_UNION_MEMBER_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
_VALUE_ERROR_PREFIX = "Value error, "


@dataclass(frozen=True)
class FirstError:
    """The first error of a ``ValidationError``, ready to show."""

    loc: tuple[int | str, ...]  # pydantic's location, for callers that look it up (where a setting came from)
    path: str | None  # ``loc`` as a parameter; None for the whole body
    message: str
    type: str  # pydantic's error type, e.g. "missing", "extra_forbidden"
    cause: Any  # the exception a validator raised (pydantic's ``ctx["error"]``), else None

    def line(self) -> str:
        """``path: message``, or the message alone for an error of the whole body."""
        return f"{self.path}: {self.message}" if self.path else self.message


def parameter_path(loc: tuple[int | str, ...]) -> str | None:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``; union-member tags left out."""
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif "[" in item or item in _UNION_MEMBER_TAGS:
            continue
        else:
            out += f".{item}" if out else item
    return out or None


def first_error(exc: ValidationError, *, unknown: str = "unknown field") -> FirstError:
    """The first of ``exc``'s errors; ``unknown`` is the message for a field the model forbids."""
    first = exc.errors(include_url=False)[0]
    loc = tuple(first.get("loc", ()))
    kind = first.get("type", "")
    message = first.get("msg", "invalid value").removeprefix(_VALUE_ERROR_PREFIX)
    if kind == "extra_forbidden":
        message = unknown
    return FirstError(loc, parameter_path(loc), message, kind, first.get("ctx", {}).get("error"))
