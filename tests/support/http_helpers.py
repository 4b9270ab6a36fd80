"""Small helpers for reading gateway answers in tests."""

from __future__ import annotations

from typing import Any


def error_of(response: Any) -> dict[str, Any]:
    """The OpenAI-shaped error of ``response``; fails unless the body is exactly that shape."""
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    return error  # type: ignore[no-any-return]


def bearer(key: str) -> dict[str, str]:
    """Headers that present ``key`` as a bearer token."""
    return {"authorization": f"Bearer {key}"}
