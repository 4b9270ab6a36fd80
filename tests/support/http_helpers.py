"""Small helpers for reading gateway answers in tests."""

from __future__ import annotations

from typing import Any


def error_of(response: Any) -> dict[str, Any]:
    """The OpenAI-shaped error of ``response``; fails unless the body is exactly that shape (on
    ``/v1/messages`` and its count_tokens with Anthropic's top-level ``"type": "error"`` beside it, as those
    routes answer)."""
    body = response.json()
    if response.request.url.path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert body.pop("type", None) == "error", body
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    return error  # type: ignore[no-any-return]


def bearer(key: str) -> dict[str, str]:
    """Headers that present ``key`` as a bearer token."""
    return {"authorization": f"Bearer {key}"}


def assert_same_answer(seen: Any, absent: Any, replace: dict[str, str]) -> None:
    """Two answers that differ in nothing but what ``replace`` maps (real -> missing), headers included
    (but the request id): what tells an existing object of another tenant from a missing one."""
    assert seen.status_code == absent.status_code, (seen.text, absent.text)
    text = seen.text
    for real, missing in replace.items():
        text = text.replace(real, missing)
    assert text == absent.text

    def headers(r: Any) -> dict[str, str]:
        return {k: v for k, v in r.headers.items() if k != "x-request-id"}

    assert headers(seen) == headers(absent)
