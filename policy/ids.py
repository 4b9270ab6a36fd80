"""Random identifiers: a kind prefix and lower-case base32 characters (``ten_…``, ``aev_…``)."""

from __future__ import annotations

import base64
import os


def random_id(prefix: str, chars: int) -> str:
    """``prefix`` + ``_`` + ``chars`` random base32 characters (5 bits each), from one ``os.urandom`` call."""
    raw = os.urandom((chars * 5 + 7) // 8)
    return f"{prefix}_" + base64.b32encode(raw).decode("ascii")[:chars].lower()
