"""Upstream answers and stream bytes into the fleet's errors and events, without sockets."""

from __future__ import annotations

import json

import pytest

from inferflux.backends.openai.errors import Scrubber, UpstreamFailed, UpstreamRejected, error_from_answer
from inferflux.backends.openai.sse import EventReader

SCRUB = Scrubber(["sk-abc123"], ["http://10.0.0.5:8000/v1", "https://[fd00::1]:8443/v1"])


def test_scrubbing_removes_key_addresses_and_control_characters_and_trims() -> None:
    text = "key sk-abc123 at http://10.0.0.5:8000/v1/chat and 10.0.0.5:8000, ws://x/y, [fd00::1]:8443\r\nnext"
    assert SCRUB(text) == "key [redacted] at [upstream] and [upstream], [upstream], [upstream] next"
    assert SCRUB("10.0.0.5 is down") == "[upstream] is down"
    assert SCRUB("10.0.0.55 and 110.0.0.5 are others") == "10.0.0.55 and 110.0.0.5 are others"  # whole names only
    long = SCRUB("word " * 200)
    assert len(long) == 300 and long.endswith("…")


@pytest.mark.parametrize("body, message, code, param", [
    ({"error": {"message": "max_tokens is too large", "type": "invalid_request_error", "param": "max_tokens",
                "code": "invalid_value"}}, "max_tokens is too large", "invalid_value", "max_tokens"),
    # vLLM's older flat shape, with the HTTP status as its code
    ({"object": "error", "message": "This model's maximum context length is 2048 tokens", "type": "BadRequestError",
      "param": None, "code": 400}, "This model's maximum context length is 2048 tokens", None, None),
    ({"error": "a plain string"}, "a plain string", None, None),
    ({"detail": "Not Found"}, "the upstream refused the request (HTTP 400)", None, None),
])  # fmt: skip
def test_4xx_bodies_become_rejections(body: object, message: str, code: str | None, param: str | None) -> None:
    error = error_from_answer(400, json.dumps(body).encode(), SCRUB)
    assert isinstance(error, UpstreamRejected)
    assert (error.message, error.status, error.code, error.param) == (message, 400, code, param)


def test_other_answers_say_only_their_status() -> None:
    too_large = error_from_answer(413, b"<html>too large</html>", SCRUB)
    assert str(too_large) == "the upstream refused the request (HTTP 413)"
    failed = error_from_answer(500, b'{"error": {"message": "CUDA OOM in /srv/model.py"}}', SCRUB)
    assert isinstance(failed, UpstreamFailed) and str(failed) == "the upstream failed (HTTP 500)"
    refused = error_from_answer(403, b'{"error": {"message": "key sk-abc123 revoked"}}', SCRUB)
    assert isinstance(refused, UpstreamRejected) and "sk-abc123" not in str(refused) and refused.status == 403


def test_events_are_found_across_any_split() -> None:
    stream = b'data: {"a":1}\n\n: a comment\nevent: x\ndata: {"b":\ndata: 2}\r\n\r\ndata:[DONE]\n\n'
    expected = [b'{"a":1}', b'{"b":\n2}', b"[DONE]"]
    for size in (1, 2, 3, 7, len(stream)):
        reader = EventReader()
        events = [e for i in range(0, len(stream), size) for e in reader.feed(stream[i : i + size])]
        assert events + reader.close() == expected, size
    reader = EventReader()
    assert reader.feed(b'data: {"last":true}') == [] and reader.close() == [b'{"last":true}']  # no blank line at EOF


def test_an_endless_line_is_refused() -> None:
    reader = EventReader()
    with pytest.raises(UpstreamFailed):
        for _ in range(9):
            reader.feed(b"x" * (1024 * 1024))
