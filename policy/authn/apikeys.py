"""API key format, hashing and verification.

A key looks like ``ifx_<prefix>_<secret>``:

* ``prefix`` (12 characters, lower-case base32) is public. It is stored in
  clear, indexed, shown in listings and logs, and used to find the key's row.
* ``secret`` (43 characters of base62, 256 bits) is shown once, at creation.

The store keeps only ``HMAC-SHA256(pepper, full key)``. The pepper is a server
secret kept (encrypted) in the store, so a stolen database alone does not allow
offline guessing, and the hash is compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

KEY_SCHEME = "ifx"
PREFIX_LEN = 12
SECRET_BYTES = 32
_PREFIX_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
_B62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
SECRET_LEN = 43  # ceil(256 / log2(62))
_KEY_RE = re.compile(rf"^{KEY_SCHEME}_([a-z2-7]{{{PREFIX_LEN}}})_([0-9A-Za-z]{{{SECRET_LEN}}})$")


@dataclass(frozen=True)
class ParsedKey:
    prefix: str
    secret: str

    @property
    def token(self) -> str:
        return f"{KEY_SCHEME}_{self.prefix}_{self.secret}"


def _b62(data: bytes, width: int) -> str:
    n = int.from_bytes(data, "big")
    out = []
    for _ in range(width):
        n, r = divmod(n, 62)
        out.append(_B62[r])
    return "".join(reversed(out))


def generate_key() -> ParsedKey:
    prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(PREFIX_LEN))
    return ParsedKey(prefix, _b62(secrets.token_bytes(SECRET_BYTES), SECRET_LEN))


def parse_key(token: str) -> ParsedKey | None:
    """The key's parts, or None if ``token`` is not in our format (not a key of ours)."""
    match = _KEY_RE.match(token)
    return ParsedKey(match.group(1), match.group(2)) if match else None


def looks_like_key(token: str) -> bool:
    return token.startswith(KEY_SCHEME + "_")


def hash_key(pepper: bytes, token: str) -> bytes:
    """The value stored for a key: HMAC-SHA256 keyed with the server's pepper."""
    return hmac.new(pepper, token.encode("ascii"), hashlib.sha256).digest()


def verify_key(pepper: bytes, token: str, stored_hash: bytes) -> bool:
    return hmac.compare_digest(hash_key(pepper, token), stored_hash)


# Used when a prefix matches no row, so a miss costs the same as a wrong secret.
DUMMY_HASH = bytes(32)
