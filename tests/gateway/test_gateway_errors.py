"""Bad requests get the right 4xx status and an OpenAI-shaped body, never a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(live_server: str, auth_headers: dict[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server, headers=auth_headers, timeout=60) as c:
        yield c


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 2, **fields}


def comp(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def _without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


# (id, path, body, status, param, code); param/code None means "not checked".
JSON_CASES = [
    ("unknown-model", CHAT, chat(model="nope"), 404, "model", "model_not_found"),
    ("missing-model", CHAT, _without(chat(), "model"), 400, "model", None),
    ("missing-messages", CHAT, _without(chat(), "messages"), 400, "messages", None),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages", None),
    ("bad-role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", None),
    ("message-not-object", CHAT, chat(messages=["hi"]), 400, "messages[0]", None),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages[0].content", None),
    ("user-without-content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0]", None),
    ("max-tokens-0", CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    ("max-tokens-huge", CHAT, chat(max_tokens=10**9), 400, "max_tokens", "context_length_exceeded"),
    ("max-completion-tokens-huge", CHAT, chat(max_completion_tokens=10**6), 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("max-tokens-string", CHAT, chat(max_tokens="many"), 400, "max_tokens", None),
    ("temperature-5", CHAT, chat(temperature=5), 400, "temperature", None),
    ("temperature-negative", COMPLETIONS, comp(temperature=-0.1), 400, "temperature", None),
    ("top-p-0", CHAT, chat(top_p=0), 400, "top_p", None),
    ("n-0", CHAT, chat(n=0), 400, "n", None),
    ("n-too-many", CHAT, chat(n=1000), 400, "n", None),
    ("presence-penalty", CHAT, chat(presence_penalty=3), 400, "presence_penalty", None),
    ("top-k-invalid", CHAT, chat(top_k=-5), 400, "top_k", None),
    ("min-tokens-over-max", CHAT, chat(min_tokens=5, max_tokens=2), 400, "min_tokens", None),
    ("too-many-stops", CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400, "stop", None),
    ("stop-too-long", CHAT, chat(stop=["a", "b" * 513]), 400, "stop[1]", None),
    ("empty-stop", CHAT, chat(stop=""), 400, "stop", None),
    ("logit-bias-outside-vocab", CHAT, chat(logit_bias={"50256": -100}), 400, "logit_bias", None),
    ("tools-bad-name", CHAT, chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), 400,
     "tools[0].function.name", None),
    ("functions", CHAT, chat(functions=[{"name": "f"}]), 400, "functions", "unsupported_parameter"),
    ("response-format-xml", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type", None),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs", None),
    ("top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    ("stream-options-without-stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options",
     None),
    ("prompt-missing", COMPLETIONS, _without(comp(), "prompt"), 400, "prompt", None),
    ("prompt-empty", COMPLETIONS, comp(prompt=""), 400, "prompt", None),
    ("prompt-bad-type", COMPLETIONS, comp(prompt={"text": "x"}), 400, "prompt", None),
    ("prompt-token-out-of-vocab", COMPLETIONS, comp(prompt=[1, 10**7]), 400, "prompt", None),
    ("completion-logprobs-6", COMPLETIONS, comp(logprobs=6), 400, "logprobs", None),
    ("suffix", COMPLETIONS, comp(suffix="end"), 400, "suffix", "unsupported_parameter"),
    ("too-many-choices", COMPLETIONS, comp(prompt=["a"] * 5, n=4), 400, "n", None),
]


def assert_openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error  # type: ignore[no-any-return]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), [c[1:] for c in JSON_CASES],
                         ids=[c[0] for c in JSON_CASES])
def test_bad_json_requests(http: httpx.Client, path: str, body: dict[str, Any], status: int,
                           param: str | None, code: str | None) -> None:
    resp = http.post(path, json=body)
    error = assert_openai_error(resp, status)
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    if status == 400:
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_context(http: httpx.Client, stream: bool) -> None:
    # SmolLM2 has an 8192-token context; each " hello" is one token.
    resp = http.post(CHAT, json=chat(messages=[{"role": "user", "content": " hello" * 9000}], stream=stream))
    error = assert_openai_error(resp, 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"


def test_completion_prompt_longer_than_context(http: httpx.Client) -> None:
    error = assert_openai_error(http.post(COMPLETIONS, json=comp(prompt=[42] * 9000)), 400)
    assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("content", "content_type", "status", "code"),
    [
        (b"{not json", "application/json", 400, "invalid_json"),
        (b"", "application/json", 400, "invalid_json"),
        (b"[1, 2]", "application/json", 400, "invalid_json"),
        (b"\xff\xfe", "application/json", 400, "invalid_json"),
        (b"model=x", "application/x-www-form-urlencoded", 415, "unsupported_media_type"),
        (b"hello", "text/plain", 415, "unsupported_media_type"),
    ],
    ids=["malformed", "empty", "array", "not-utf8", "form", "text"],
)
def test_bad_bodies(http: httpx.Client, content: bytes, content_type: str, status: int, code: str) -> None:
    resp = http.post(CHAT, content=content, headers={"content-type": content_type})
    assert assert_openai_error(resp, status)["code"] == code


def test_oversize_body_is_413(http: httpx.Client) -> None:
    body = json.dumps(chat(messages=[{"role": "user", "content": "x" * (5 * 1024 * 1024)}])).encode()
    assert assert_openai_error(http.post(CHAT, content=body, headers={"content-type": "application/json"}), 413)[
        "code"
    ] == "request_too_large"


def test_oversize_chunked_body_is_413(http: httpx.Client) -> None:
    # No Content-Length: the limit must hold while the body is being read.
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "'
        for _ in range(5):
            yield b"x" * (1024 * 1024)
        yield b'"}]}'

    resp = http.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert assert_openai_error(resp, 413)["code"] == "request_too_large"


def test_unknown_route_and_wrong_method(http: httpx.Client) -> None:
    assert assert_openai_error(http.get("/v1/nothing-here"), 404)["code"] == "not_found"
    assert assert_openai_error(http.get(CHAT), 405)["code"] == "method_not_allowed"


def test_unknown_fields_are_ignored(http: httpx.Client) -> None:
    resp = http.post(CHAT, json=chat(some_future_field={"x": 1}, parallel_tool_calls=True))
    assert resp.status_code == 200, resp.text


def test_request_id_is_echoed(http: httpx.Client) -> None:
    resp = http.post(CHAT, json=chat(model="nope"), headers={"x-request-id": "abc-123"})
    assert resp.headers["x-request-id"] == "abc-123"
    generated = http.get("/livez", headers={"x-request-id": "bad id with spaces"}).headers["x-request-id"]
    assert generated and " " not in generated


@pytest.mark.parametrize("stream", [False, True])
def test_request_larger_than_kv_cache_is_400(http: httpx.Client, stream: bool) -> None:
    # Fits the 8192-token context but not the 64 MiB test cache (~1456 tokens):
    # the engine refuses it before any token, so the status is still real.
    resp = http.post(CHAT, json=chat(max_tokens=4000, stream=stream))
    error = assert_openai_error(resp, 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "max_tokens"


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", True), ("n", "2"), ("stream", "yes"), ("temperature", "0.5"), ("model", 5), ("seed", 1.5)],
)
def test_wrong_json_types_are_rejected_not_coerced(http: httpx.Client, field: str, value: object) -> None:
    error = assert_openai_error(http.post(CHAT, json=chat(**{field: value})), 400)
    assert error["param"] == field
