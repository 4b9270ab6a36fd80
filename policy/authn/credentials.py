"""A request's credential: the one it presents, what it is known by, and the cache of decisions about it.

A caller presents one credential, as ``Authorization: Bearer`` or as
``x-api-key`` (``presented_credential``). The authenticator caches each
decision, and each refusal, under the credential's digest
(``credential_digest``) in a ``CredentialCache``: entries expire, but an
expired one stays as the stale snapshot served while the policy store cannot
be read (``policy.snapshot``).
"""

from __future__ import annotations

import hmac
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from inferflux.policy.digests import sha256
from inferflux.policy.errors import AuthenticationError


def presented_credential(authorization: str | None, api_key: str | None) -> str:
    """The one credential presented. Both headers may carry it only if they carry the same one: a request
    naming two callers is refused rather than served as whichever of them a rule happened to read."""
    bearer = None
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise AuthenticationError(
                "The Authorization header must be 'Bearer <API key or token>'", code="invalid_authorization_header"
            )
        bearer = value.strip()
    key = api_key.strip() if api_key else ""
    if bearer is not None and key and not hmac.compare_digest(bearer.encode("latin-1"), key.encode("latin-1")):
        raise AuthenticationError(
            "'Authorization' and 'x-api-key' carry different credentials: send one", code="conflicting_credentials"
        )
    if bearer is not None:
        return bearer
    if key:
        return key
    raise AuthenticationError(
        "No credentials: send 'Authorization: Bearer <API key or token>' or 'x-api-key'", code="missing_credentials"
    )


def credential_digest(token: str) -> bytes:
    """What a credential is known by in memory: its SHA-256."""
    return sha256(token.encode("utf-8", "surrogatepass")).digest()


class CredentialCache:
    """A bounded map of decisions whose entries expire; keys are digests (``credential_digest``), never raw
    credentials. Not thread-safe: the authenticator uses it from the event loop only."""

    def __init__(self, max_entries: int, clock: Callable[[], float]) -> None:
        self._data: OrderedDict[bytes, tuple[float, int, Any]] = OrderedDict()
        self._max = max_entries
        self._clock = clock
        self._epoch = 0  # entries put before the last ``expire_all`` are expired, whatever their time

    def get(self, key: bytes) -> Any | None:
        item = self._data.get(key)
        if item is None:
            return None
        expires, epoch, value = item
        # An expired entry stays (until evicted, replaced or discarded): it is the
        # stale snapshot served while the store is unreachable (``stale``).
        return None if epoch != self._epoch or self._clock() >= expires else value

    def stale(self, key: bytes) -> Any | None:
        """The entry, expired or not: still what the store said at its last successful read of it."""
        item = self._data.get(key)
        return None if item is None else item[2]

    def put(self, key: bytes, value: Any, ttl: float) -> None:
        if ttl <= 0:
            return
        self._data[key] = (self._clock() + ttl, self._epoch, value)
        self._data.move_to_end(key)
        while len(self._data) > self._max:
            self._data.popitem(last=False)

    def expire_all(self) -> None:
        """Every entry must be read again, but stays as the stale snapshot until it is (O(1))."""
        self._epoch += 1

    def discard(self, key: bytes) -> None:
        self._data.pop(key, None)

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)
