"""The tracer as the OTEL_* variables build it, exporting over a real socket.

No OTLP collector installs from the package registries here (the OpenTelemetry
Collector and Jaeger ship as binaries or images), so the receiver is a small
OTLP/HTTP server in the test: it decodes each POST to ``/v1/traces`` with the
protocol's own protobuf classes (``opentelemetry-proto``) and answers as a
collector does. The gateway's exporter is the real one (``OTLPSpanExporter``,
http/protobuf), configured only by the environment.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from inferflux.gateway.context import RequestContext, route_template
from inferflux.gateway.settings import TracingSettings
from inferflux.gateway.tracing import Tracing, TracingConfigError


class Receiver:
    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """(resource attributes, span) of everything received."""
        out = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                out += [(attributes, span) for scope in resource_spans.scope_spans for span in scope.spans]
        return out


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    got = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["content-length"]))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            got.paths.append(self.path)
            got.requests.append(ExportTraceServiceRequest.FromString(body))
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield got, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_spans_reach_an_otlp_http_receiver(receiver: tuple[Receiver, str], monkeypatch: pytest.MonkeyPatch) -> None:
    got, endpoint = receiver
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_TRACES_SAMPLER", "OTEL_SDK_DISABLED"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gateway-under-test")
    tracing = Tracing.build(TracingSettings(enabled=True))
    assert tracing is not None
    ctx = RequestContext(request_id="req-otlp")
    scope = {"type": "http", "method": "POST", "headers": [(b"traceparent", b"00-" + b"ab" * 16 + b"-" + b"cd" * 8 + b"-01")]}
    trace = tracing.begin(scope, ctx.started, ctx.request_id)
    now = time.perf_counter()
    trace.stage("limits", now, now + 0.001)
    trace.status = 429
    trace.end(route_template(scope), None, None)
    tracing.shutdown()  # the batch processor exports what it holds
    assert got.paths and set(got.paths) == {"/v1/traces"}
    spans = {span.name: (resource, span) for resource, span in got.spans()}
    assert set(spans) == {"POST", "limits"}  # no route matched: the method alone names the request
    resource, request = spans["POST"]
    assert resource["service.name"] == "gateway-under-test"
    assert request.trace_id.hex() == "ab" * 16 and request.parent_span_id.hex() == "cd" * 8
    _, limits = spans["limits"]
    assert limits.parent_span_id == request.span_id and limits.trace_id == request.trace_id
    assert limits.end_time_unix_nano - limits.start_time_unix_nano == pytest.approx(1_000_000, abs=1000)
    assert {a.key: a.value.int_value for a in request.attributes}["http.response.status_code"] == 429


def test_off_or_disabled_builds_nothing() -> None:
    assert Tracing.build(TracingSettings(enabled=False), env={}) is None
    assert Tracing.build(TracingSettings(enabled=True), env={"OTEL_SDK_DISABLED": "true"}) is None


@pytest.mark.parametrize("env, named", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
])  # fmt: skip
def test_an_exporter_this_installation_lacks_is_a_clear_error(env: dict[str, str], named: str) -> None:
    with pytest.raises(TracingConfigError, match=named):
        Tracing.build(TracingSettings(enabled=True), env=env)


def test_the_none_exporter_traces_without_exporting() -> None:
    tracing = Tracing.build(TracingSettings(enabled=True), env={"OTEL_TRACES_EXPORTER": "none"})
    assert tracing is not None  # traced (ids for logs, exemplars, upstreams), exported nowhere
    tracing.shutdown()
