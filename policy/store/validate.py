"""Checks on values before they are stored; each failure is a ``ValidationFailed`` naming its field.

The admin API validates request bodies too; these checks are the store's own,
so nothing reaches the database unchecked whoever the caller is.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.rbac import ROLE_NAMES

_SLUG = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def slug(value: str, param: str) -> str:
    if not isinstance(value, str) or not _SLUG.match(value):
        raise ValidationFailed(
            f"{param} must be 1-63 characters of a-z, 0-9 and '-', starting with a letter or digit", param=param
        )
    return value


def text(value: str, param: str, max_length: int, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty) or len(value) > max_length:
        least = 0 if empty else 1
        raise ValidationFailed(f"{param} must be a string of {least} to {max_length} characters", param=param)
    return storable(value, param)


def storable(value: str, param: str) -> str:
    """``value``, unless a database could not keep it as text: U+0000 (PostgreSQL refuses it) or a lone
    UTF-16 surrogate (no encoding holds one), either of which would fail as a 5xx instead."""
    if "\x00" in value:
        raise ValidationFailed(f"{param} must not contain U+0000 (NUL)", param=param)
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValidationFailed(f"{param} holds a lone UTF-16 surrogate, which is not a character",
                                   param=param) from None  # fmt: skip
    return value


def optional_text(value: str | None, param: str, max_length: int) -> str | None:
    return None if value is None else text(value, param, max_length)


def display_name(value: str | None) -> str | None:
    return optional_text(value, "display_name", 200)


def secret(value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValidationFailed("a secret must be a non-empty string")
    return storable(value, "secret")


# Longer than any bearer token or API key a model server issues, within the 8 KiB a header line may take.
MAX_CREDENTIAL_SECRET = 8192
# Control characters (C0, DEL, C1), invisible format characters (zero-width, bidi) and line or
# paragraph separators: none belongs in a token, and CR or LF in a header value would split it.
_UNPRINTABLE = frozenset({"Cc", "Cf", "Zl", "Zp"})


def credential_secret(value: str) -> str:
    """A secret the gateway will present elsewhere (an ``Authorization`` header): refused here,
    when an admin writes it, rather than when the first request would carry it. The message
    never quotes the value."""
    if not isinstance(value, str) or not value or len(value) > MAX_CREDENTIAL_SECRET:
        raise ValidationFailed(f"secret must be a string of 1 to {MAX_CREDENTIAL_SECRET} characters", param="secret")
    storable(value, "secret")
    if not value.isprintable() and any(unicodedata.category(c) in _UNPRINTABLE for c in value):
        raise ValidationFailed(
            "secret must not contain control characters, line breaks or invisible format characters", param="secret"
        )
    return value


def boolean(value: bool, param: str) -> bool:
    if not isinstance(value, bool):
        raise ValidationFailed(f"{param} must be true or false", param=param)
    return value


def strings(values: Sequence[str], param: str) -> list[str]:
    # Something that is no list at all (None from a JSON null) is refused too, not a TypeError.
    is_list = isinstance(values, Sequence) and not isinstance(values, str)
    if not is_list or not all(isinstance(v, str) and v for v in values):
        raise ValidationFailed(f"{param} must be a list of non-empty strings", param=param)
    return list(dict.fromkeys(values))  # without duplicates, in the order given


def models(values: Sequence[str] | None, param: str) -> list[str] | None:
    return None if values is None else strings(values, param)


def role(role: str) -> str:
    if role not in ROLE_NAMES:
        raise ValidationFailed(f"unknown role {role!r}; roles are {', '.join(ROLE_NAMES)}", param="role")
    return role


def role_map(role_map: Mapping[str, str] | None) -> dict[str, str]:
    result = dict(role_map or {})
    for claim_value, role in result.items():
        if not isinstance(claim_value, str) or not claim_value:
            raise ValidationFailed("role_map keys must be non-empty strings", param="role_map")
        if role not in ROLE_NAMES:
            raise ValidationFailed(f"role_map maps {claim_value!r} to the unknown role {role!r}", param="role_map")
    return result


def algorithms(algorithms: Sequence[str]) -> list[str]:
    values = strings(algorithms, "algorithms")
    if not values:
        raise ValidationFailed("algorithms must name at least one algorithm", param="algorithms")
    # The verifier refuses these too; never store them.
    refused = [a for a in values if a.lower() == "none" or a.upper().startswith("HS")]
    if refused:
        raise ValidationFailed(f"algorithms {refused} are not allowed (only asymmetric ones)", param="algorithms")
    return values


def leeway(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 300:
        raise ValidationFailed("leeway_seconds must be an integer from 0 to 300", param="leeway_seconds")
    return value


def url(value: str, param: str) -> str:
    text(value, param, 2048)
    if not value.startswith(("https://", "http://")):
        raise ValidationFailed(f"{param} must be an http(s) URL", param=param)
    return value


def aware(value: datetime, param: str) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise ValidationFailed(f"{param} must be a datetime with a time zone", param=param)
    return value


def json_object(value: Mapping[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValidationFailed(f"{param} must be a JSON object", param=param)
    try:
        # A copy through JSON: what is stored is exactly what will be read back.
        stored = json.dumps(dict(value), allow_nan=False, ensure_ascii=False)
        stored.encode("utf-8")  # a lone surrogate would be stored escaped, and fail whoever reads it
        result: dict[str, Any] = json.loads(stored)
    except (TypeError, ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        raise ValidationFailed(
            f"{param} must be JSON (objects, arrays, strings of characters, finite numbers, booleans, null)",
            param=param,
        ) from None
    return result
