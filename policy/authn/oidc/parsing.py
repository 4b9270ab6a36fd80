"""A bearer token's size and shape, read before anything else is done with it.

Cheap, and before any allocation proportional to the attacker's input: a
token longer than ``MAX_TOKEN_LENGTH`` is refused unread. The JSON is read
more strictly than ``json.loads`` does by default (no duplicate members, no
``NaN``/``Infinity``), so that no other parser can read a different claim
from the same bytes. Nothing here is trusted yet: the signature comes later.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inferflux.policy.errors import InvalidToken

MAX_TOKEN_LENGTH = 16 * 1024

_B64URL = re.compile(r"^[A-Za-z0-9_-]*$")


@dataclass(frozen=True)
class ParsedToken:
    """A compact JWS split and decoded, its signature not yet checked."""

    raw: str
    header: Mapping[str, Any]
    claims: Mapping[str, Any]

    @property
    def alg(self) -> str:
        return self.header["alg"]

    @property
    def kid(self) -> str | None:
        return self.header.get("kid")


def parse_token(token: Any) -> ParsedToken:
    """Three base64url parts, a header with a string ``alg``, JSON objects; else 401 ``malformed_token``."""
    if not isinstance(token, str) or not token:
        raise InvalidToken("the bearer token is empty or not text", code="malformed_token")
    if len(token) > MAX_TOKEN_LENGTH:
        raise InvalidToken(f"the bearer token is longer than {MAX_TOKEN_LENGTH} characters", code="malformed_token")
    parts = token.split(".")
    if len(parts) != 3:
        raise InvalidToken("a JWT has three dot-separated parts", code="malformed_token")
    try:
        header = _json_object(_b64url_decode(parts[0]))
        claims = _json_object(_b64url_decode(parts[1]))
        _b64url_decode(parts[2])
    except (ValueError, UnicodeDecodeError, binascii.Error, RecursionError):
        raise InvalidToken("the JWT is not base64url-encoded JSON", code="malformed_token") from None
    if not isinstance(header.get("alg"), str):
        raise InvalidToken("the JWT header has no 'alg'", code="malformed_token")
    if "kid" in header and not isinstance(header["kid"], str):
        raise InvalidToken("the JWT header's 'kid' is not a string", code="malformed_token")
    return ParsedToken(raw=token, header=header, claims=claims)


def _b64url_decode(segment: str) -> bytes:
    if not _B64URL.match(segment) or len(segment) % 4 == 1:
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two parsers reading different values for one claim is how claim
    # smuggling starts; a duplicate member makes the token malformed.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate member {key!r}")
        result[key] = value
    return result


def _json_object(data: bytes) -> dict[str, Any]:
    value = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value
