"""What can go wrong between the gateway and an upstream fleet, in four kinds.

The gateway answers each kind its own way (503 with Retry-After, the client's
own 4xx, a 502-style failure), so the fleet sorts every failure into one of
them. ``str(error)`` is shown to API clients: it is built here from a short,
scrubbed message, never from an upstream's raw body, headers or URL, so a
fleet's internals and its credential cannot reach a client through an error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

MAX_MESSAGE_CHARS = 300
REDACTED = "[redacted]"
UPSTREAM = "[upstream]"

# A URL up to the first space or quote, less the punctuation of the sentence around it.
_URL = re.compile(r"\b(?:https?|wss?)://[^\s\"'<>]*[^\s\"'<>.,;:!?)]", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


class UpstreamError(Exception):
    """The base of the fleet's errors; ``message`` (and ``str``) is safe to show a client."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UpstreamUnavailable(UpstreamError):
    """No endpoint can take the request now: all down, circuits open, or every one at its cap.

    ``retry_after`` (seconds) is when trying again is worth it: the soonest
    breaker's half-open time, else a second.
    """

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class UpstreamRejected(UpstreamError):
    """The upstream answered our request with a 4xx: the request (or our credential) is the problem.

    ``status`` is the upstream's status; ``code`` and ``param`` are its OpenAI
    error fields when it sent them (scrubbed), so the gateway can answer the
    client as the upstream would have.
    """

    def __init__(self, message: str, *, status: int, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


class UpstreamFailed(UpstreamError):
    """The upstream failed: 5xx after retries, protocol garbage, a cut or stalled stream."""


class Scrubber:
    """Makes upstream text safe to show: no credential, no endpoint address, one short line.

    Built once per fleet from its api key and endpoint URLs; upstreams echo
    both back in error messages (a proxy's "connection to http://10.0.0.5:8000
    refused", a misconfigured server repeating the Authorization header).
    """

    def __init__(self, secrets: Iterable[str], endpoints: Iterable[str]) -> None:
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)
        places: set[str] = set()
        for url in endpoints:
            netloc = url.split("://", 1)[-1].split("/", 1)[0]
            places.add(netloc)
            places.add(netloc.rsplit(":", 1)[0] if not netloc.endswith("]") else netloc)
        # Whole names only: an endpoint called "gpu" must not turn "gpus" into "[upstream]s".
        alternatives = "|".join(re.escape(p) for p in sorted((p for p in places if p), key=len, reverse=True))
        self._places = re.compile(rf"(?<![\w.-])(?:{alternatives})(?![\w-]|\.\w)", re.I) if alternatives else None

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        text = _URL.sub(UPSTREAM, text)
        if self._places is not None:
            text = self._places.sub(UPSTREAM, text)
        text = _CONTROL.sub(" ", text).strip()
        if len(text) > MAX_MESSAGE_CHARS:
            text = text[: MAX_MESSAGE_CHARS - 1].rstrip() + "…"
        return text


def _error_fields(raw: bytes) -> tuple[str | None, str | None, str | None]:
    """(message, code, param) from an OpenAI-shaped error body, or vLLM's older flat shape; Nones otherwise."""
    try:
        body: Any = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, None, None
    if not isinstance(body, dict):
        return None, None, None
    error = body.get("error", body)
    if isinstance(error, str):
        return error, None, None
    if not isinstance(error, dict):
        return None, None, None
    message, code, param = error.get("message"), error.get("code"), error.get("param")
    # vLLM's flat shape puts the HTTP status in "code": only a string code means something of its own.
    return (
        message if isinstance(message, str) else None,
        code if isinstance(code, str) else None,
        param if isinstance(param, str) else None,
    )


def error_from_answer(status: int, raw: bytes, scrub: Scrubber) -> UpstreamError:
    """The error for an upstream's non-2xx answer (``raw``: the start of its body).

    A 4xx is the request's fault: the upstream's own message (scrubbed) tells
    the client what to fix. A 401/403 is about the gateway's credential, not
    the client: a fixed message, since the upstream's may describe our key. A
    5xx says only its status: its body is the upstream's internals (a stack
    trace, a proxy's page).
    """
    if 400 <= status < 500:
        if status in (401, 403):
            return UpstreamRejected("the upstream refused the gateway's credential", status=status)
        message, code, param = _error_fields(raw)
        text = scrub(message) if message else ""
        return UpstreamRejected(
            text or f"the upstream refused the request (HTTP {status})",
            status=status,
            code=scrub(code) or None if code else None,
            param=scrub(param) or None if param else None,
        )
    return UpstreamFailed(f"the upstream failed (HTTP {status})")


def error_in_stream(chunk: dict[str, Any], scrub: Scrubber, where: str = "mid-stream") -> UpstreamFailed:
    """The error for an ``{"error": ...}`` event an upstream sent in place of a chunk, mid-stream
    (or, ``where``, in place of a whole answer with a 2xx status)."""
    message, _, _ = _error_fields(json.dumps(chunk).encode())
    text = scrub(message) if message else ""
    return UpstreamFailed(f"the upstream failed {where}: {text}" if text else f"the upstream failed {where}")


def retry_after_seconds(value: str | None) -> float:
    """A Retry-After in seconds, kept within 1-60 s; 1 when absent or an HTTP date (not worth parsing)."""
    try:
        seconds = float(value) if value is not None else 1.0
    except ValueError:
        return 1.0
    return min(60.0, max(1.0, seconds)) if seconds == seconds else 1.0
