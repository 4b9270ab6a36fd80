"""OpenTelemetry traces: a span per request and a child span per stage, off by default.

``tracing.enabled`` (or ``INFERFLUX_TRACING``) turns it on; the standard
variables configure the rest: ``OTEL_TRACES_EXPORTER`` (``otlp``, the default,
``console`` or ``none``), ``OTEL_EXPORTER_OTLP_ENDPOINT`` and the exporter's
other variables, ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf``, the
default; ``grpc`` with ``opentelemetry-exporter-otlp-proto-grpc`` installed),
``OTEL_SERVICE_NAME`` (default ``inferflux``), ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER`` and its argument, ``OTEL_PROPAGATORS`` and
``OTEL_SDK_DISABLED``. Off, nothing of OpenTelemetry is imported and a request
pays one ``None`` check per stage.

The request span continues the client's trace (W3C ``traceparent``) and is what
an upstream sees as its parent (``RequestPolicy.upstream_headers``). Its stages
are sequential child spans that tile it: ``authentication``, ``read_body``,
``guardrails.input``, ``plan``, ``limits``, ``opa``, ``queue_wait``, ``prefill``,
``decode``, ``audit``; what lies between them (middleware, routing, rendering,
writing to the socket) is in no stage. Two stages run beside others and carry
``inferflux.concurrent: true``: the output guardrails (checked as decoding goes,
one span from their first check to their last, their own time in
``inferflux.busy_ms``) and OPA policies decided beside the engine's first step.
The engine's three stages come from its request timestamps
(``backends.engine.RequestTimings``), not from spans inside its loop: queue
wait = admitted - arrived, prefill = first token - admitted, decode = last
token - first token (over a request's choices: the earliest of each moment,
and the last token of any).

Every time here is ``time.perf_counter()``, the engine's clock, turned into
epoch nanoseconds by one offset taken at import, so stages measured in the
gateway and in the engine thread line up.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from starlette.types import Scope

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from inferflux.backends.engine import RequestTimings
    from inferflux.gateway.settings.sections import TracingSettings
    from inferflux.policy.guardrails import OutputStream

_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()
TRACE_HEADERS = ("traceparent", "tracestate")


def epoch_ns(perf: float) -> int:
    """A ``time.perf_counter()`` reading as the epoch nanoseconds OpenTelemetry records."""
    return _EPOCH_OFFSET_NS + round(perf * 1e9)


class TracingConfigError(ValueError):
    """The OTEL_* variables ask for something this installation cannot do."""


def _exporters(env: Mapping[str, str]) -> list[SpanExporter]:
    """The exporters ``OTEL_TRACES_EXPORTER`` names (comma separated; default otlp)."""
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    exporters: list[SpanExporter] = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        elif name == "otlp":
            exporters.append(_otlp_exporter(env))
        else:
            raise TracingConfigError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, console or none)")
    return exporters


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS, _TIMEOUT itself
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError as exc:
            raise TracingConfigError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc installed"
            ) from exc
        return GrpcExporter()  # type: ignore[no-any-return]
    raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported (http/protobuf or grpc)")


class Tracing:
    """The app's tracer, over a ``TracerProvider`` of its own (several apps may share a process, as tests do)."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import propagate

        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("inferflux.gateway")
        self._propagator = propagate.get_global_textmap()  # OTEL_PROPAGATORS, default W3C tracecontext + baggage

    @classmethod
    def build(
        cls, settings: TracingSettings, *, exporter: SpanExporter | None = None, env: Mapping[str, str] | None = None
    ) -> Tracing | None:
        """The tracer ``settings`` and the OTEL_* variables ask for; None when tracing is off.

        ``exporter`` replaces the ones the variables name, exporting each span as it
        ends (tests pass an in-memory one)."""
        env = os.environ if env is None else env
        if not settings.enabled or env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        from inferflux.gateway import VERSION

        resource = Resource.create({"service.version": VERSION})
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "inferflux"}))
        provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER (default parentbased_always_on)
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            for each in _exporters(env):
                provider.add_span_processor(BatchSpanProcessor(each))  # exported off the request path
        return cls(provider)

    def begin(self, scope: Scope, started: float, request_id: str) -> RequestTrace:
        """The request's span, started at ``started`` (when its context was: ``RequestContext.started``),
        a child of the client's trace if it sent one."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        # Every header: the propagators (OTEL_PROPAGATORS) pick theirs, W3C's traceparent by default.
        carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope.get("headers", ())}
        parent = self._propagator.extract(carrier)
        method = scope.get("method", "")
        span = self.tracer.start_span(
            method, context=parent, kind=SpanKind.SERVER, start_time=epoch_ns(started),
            attributes={"http.request.method": method, "inferflux.request_id": request_id},
        )  # fmt: skip
        return RequestTrace(self, span, set_span_in_context(span), method)

    def shutdown(self) -> None:
        """Export what is buffered and stop (the app's shutdown)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's span and the stage spans under it; ``RequestContext.trace`` while it is traced."""

    def __init__(self, tracing: Tracing, span: Span, context: Any, method: str) -> None:
        self.tracing = tracing
        self.span = span
        self.context = context  # the OpenTelemetry context whose current span is the request's
        self.method = method
        self.recording = span.is_recording()  # False when the sampler dropped it: no stage spans then
        self.status = 500
        span_context = span.get_span_context()
        self.trace_id = format(span_context.trace_id, "032x")
        self.span_id = format(span_context.span_id, "016x")

    def stage(self, name: str, start: float, end: float, error: BaseException | None = None,
              **attributes: Any) -> None:  # fmt: skip
        """A finished stage, from ``start`` to ``end`` (``time.perf_counter()`` readings)."""
        if not self.recording:
            return
        span = self.tracing.tracer.start_span(name, context=self.context, start_time=epoch_ns(start),
                                              attributes=attributes or None)  # fmt: skip
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        span.end(end_time=epoch_ns(max(start, end)))

    def engine(self, timings: RequestTimings) -> None:
        """The engine's stages of the request, from its timestamps."""
        self.stage("queue_wait", timings.arrived, timings.admitted)
        self.stage("prefill", timings.admitted, timings.first_token)
        self.stage("decode", timings.first_token, timings.finished)

    def output_checks(self, meter: GuardMeter) -> None:
        if meter.checks:
            self.stage("guardrails.output", meter.first, meter.last, **{
                "inferflux.concurrent": True, "inferflux.busy_ms": meter.busy * 1e3, "inferflux.checks": meter.checks})  # fmt: skip

    def headers(self) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming the request's span: what an upstream gets."""
        carrier: dict[str, str] = {}
        self.tracing._propagator.inject(carrier, context=self.context)
        return carrier

    def exemplar(self) -> dict[str, str] | None:
        """The labels that link a latency observation to this trace (sampled traces only)."""
        return {"trace_id": self.trace_id, "span_id": self.span_id} if self.recording else None

    def end(self, route: str, tenant: str | None, model: str | None) -> None:
        """Close the request's span now, named by its route template (``gateway.context.route_template``),
        with what the request became: the tenant it was authenticated as and the model it named, if any."""
        span = self.span
        if route != "unmatched":
            span.update_name(f"{self.method} {route}")
            span.set_attribute("http.route", route)
        span.set_attribute("http.response.status_code", self.status)
        if tenant is not None:
            span.set_attribute("inferflux.tenant", tenant)
        if model is not None:
            span.set_attribute("inferflux.model", model)
        if self.status >= 500:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=epoch_ns(time.perf_counter()))


# -- the hooks the request path calls: each costs a None check when tracing is off

_OFF: AbstractContextManager[None] = contextlib.nullcontext()


class _Stage(AbstractContextManager[None]):
    __slots__ = ("trace", "name", "attributes", "start")

    def __init__(self, trace: RequestTrace, name: str, attributes: dict[str, Any]) -> None:
        self.trace, self.name, self.attributes = trace, name, attributes
        self.start = time.perf_counter()

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        self.trace.stage(self.name, self.start, time.perf_counter(), error, **self.attributes)


class Traced(Protocol):
    """What ``stage`` reads of a request: its trace, if it is traced (``gateway.context.RequestContext``)."""

    trace: RequestTrace | None


def stage(ctx: Traced, name: str, **attributes: Any) -> AbstractContextManager[None]:
    """``with stage(ctx, "limits"):`` records the block as a stage of the request's trace, if it is traced."""
    trace = ctx.trace
    return _OFF if trace is None else _Stage(trace, name, attributes)


@dataclass
class GuardMeter:
    """The output guardrails' checks of one request: when the first began, the last ended, their time."""

    first: float = 0.0
    last: float = 0.0
    busy: float = 0.0
    checks: int = 0

    def timed(self, make: Callable[[], OutputStream]) -> Callable[[], OutputStream]:
        """``make``'s checkers, each timed by this meter."""
        return lambda: cast("OutputStream", TimedOutputStream(make(), self))

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self.first = self.first or start
            self.last, self.busy, self.checks = end, self.busy + end - start, self.checks + 1


class TimedOutputStream:
    """An ``OutputStream`` (the output guardrails' incremental checker) whose checks a ``GuardMeter`` times."""

    def __init__(self, stream: OutputStream, meter: GuardMeter) -> None:
        self._stream, self._meter = stream, meter

    def feed(self, text: str) -> Any:
        with self._meter.timing():
            return self._stream.feed(text)

    def flush(self, last: str = "") -> Any:
        with self._meter.timing():
            return self._stream.flush(last)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
