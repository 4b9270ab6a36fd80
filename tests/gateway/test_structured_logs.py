"""JSON logs (``log_format: json``): one object a line with the request's ids, and never a secret.

The formatter is tested on real records through the redaction filter as ``serve``
installs it, and without it (it redacts again on its own); the request's ids come
from a request served through the real request-context middleware with tracing on.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inferflux.gateway.context import RequestContextMiddleware, get_context
from inferflux.gateway.logs.redaction import RedactSecrets, log_config
from inferflux.gateway.settings import TracingSettings
from inferflux.gateway.logs.structured import JsonFormatter
from inferflux.gateway.tracing import Tracing
from inferflux.policy.authn.apikeys import generate_key


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, io.StringIO, logging.Handler]]:
    """A logger whose one handler writes JSON lines into a buffer, through the redaction filter."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.addFilter(RedactSecrets())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("inferflux.test.json")
    logger.propagate, logger.level = False, logging.DEBUG
    logger.addHandler(handler)
    yield logger, buffer, handler
    logger.removeHandler(handler)


def lines(buffer: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_a_line_is_one_json_object_with_the_fields(logged: Any) -> None:
    logger, buffer, _ = logged
    logger.warning("engine %s is %d%% busy", "cpu", 95)
    [line] = lines(buffer)
    assert line["level"] == "warning" and line["logger"] == "inferflux.test.json"
    assert line["message"] == "engine cpu is 95% busy"
    assert line["timestamp"].endswith("Z") and "T" in line["timestamp"]
    assert "request_id" not in line and "trace_id" not in line  # outside a request


@pytest.mark.parametrize("filtered", [True, False])
def test_no_api_key_reaches_the_output(logged: Any, filtered: bool) -> None:
    logger, buffer, handler = logged
    if not filtered:  # the formatter redacts again on its own: a handler someone added without the filter
        handler.filters.clear()
    key = generate_key().token
    logger.info("a key in the arguments: %s", key)
    logger.info(f"a key in the message: {key}")
    logger.info('127.0.0.1:5000 - "%s %s HTTP/%s" %d', "GET", f"/v1/models?api_key={key}&x=1", "1.1", 401)
    try:
        raise ValueError(f"bad key {key}")
    except ValueError:
        logger.exception("failed with the key in the traceback")
    out = buffer.getvalue()
    secret = key.rsplit("_", 1)[1]
    assert secret not in out and key not in out
    parsed = lines(buffer)
    assert len(parsed) == 4 and "?api_key=[REDACTED]&x=1" in parsed[2]["message"]
    assert "[REDACTED]" in parsed[3]["exception"]


def test_a_line_written_while_serving_names_the_request_its_trace_and_tenant(logged: Any) -> None:
    logger, buffer, _ = logged
    exporter = InMemorySpanExporter()
    tracing = Tracing.build(TracingSettings(enabled=True), exporter=exporter)
    assert tracing is not None

    async def app(scope: Any, receive: Any, send: Any) -> None:
        get_context(scope).principal = SimpleNamespace(tenant_id="tenant-7")
        logger.info("serving")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": "GET", "path": "/x", "headers": [(b"x-request-id", b"req-42")]}
    asyncio.run(RequestContextMiddleware(app, tracing=tracing)(scope, receive, send))
    logger.info("after the request")
    during, after = lines(buffer)
    [span] = exporter.get_finished_spans()
    assert during["request_id"] == "req-42" and during["tenant"] == "tenant-7"
    assert during["trace_id"] == format(span.context.trace_id, "032x")
    assert during["span_id"] == format(span.context.span_id, "016x")
    assert "request_id" not in after  # the request's context does not leak past it
    tracing.shutdown()


def test_serves_logging_config_is_json_and_filtered_everywhere() -> None:
    config = log_config("json")
    assert config["formatters"] and all(f == {"()": "inferflux.gateway.logs.structured.JsonFormatter"}
                                        for f in config["formatters"].values())  # fmt: skip
    assert all("redact_secrets" in h["filters"] for h in config["handlers"].values())
    assert "JsonFormatter" not in json.dumps(log_config())  # text stays uvicorn's own
