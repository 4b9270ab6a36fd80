"""Prometheus metrics: one registry per app, a recording middleware, the scrape route.

A registry per app (not prometheus_client's global one) lets several apps live
in one process, as tests and multi-listener deployments do, without
duplicate-series errors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferflux.gateway.context import SCOPE_KEY, route_template
from inferflux.gateway.errors import InvalidRequest
from inferflux.policy.audit.events import CLIENT_CLOSED_STATUS

if TYPE_CHECKING:
    from inferflux.backends.engine import EngineStats

    from inferflux.gateway.models.served import ModelManager

log = logging.getLogger("inferflux.gateway.metrics")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# CLIENT_CLOSED_STATUS (499): the status recorded when the client went away before the response was complete.


def _acceptance(stats: EngineStats) -> float:
    return stats.spec_accepted_tokens / stats.spec_proposed_tokens if stats.spec_proposed_tokens else 0.0


# Each engine metric: family type, name, help, and how to read it from EngineStats.
_EngineMetric = tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str, Callable[["EngineStats"], float]]
_ENGINE_METRICS: tuple[_EngineMetric, ...] = (
    (GaugeMetricFamily, "inferflux_engine_running_sequences", "Sequences being generated",
     lambda s: s.num_running),
    (GaugeMetricFamily, "inferflux_engine_waiting_sequences", "Sequences queued for admission",
     lambda s: s.num_waiting),
    (GaugeMetricFamily, "inferflux_kv_blocks_used", "KV cache blocks in use", lambda s: s.num_blocks_used),
    (GaugeMetricFamily, "inferflux_kv_blocks_free", "KV cache blocks free", lambda s: s.num_blocks_free),
    (GaugeMetricFamily, "inferflux_kv_slots_used", "KV token slots holding computed KV of running sequences",
     lambda s: s.kv_slots_used),
    (GaugeMetricFamily, "inferflux_kv_slots_allocated", "KV token slots in the blocks in use",
     lambda s: s.kv_slots_allocated),
    (GaugeMetricFamily, "inferflux_kv_slot_utilisation", "Used / allocated KV token slots (1 with none allocated)",
     lambda s: s.kv_slot_utilisation),
    (GaugeMetricFamily, "inferflux_prefix_cache_blocks", "Full KV blocks the prefix cache holds (in use or evictable)",
     lambda s: s.num_cached_blocks),
    (CounterMetricFamily, "inferflux_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
     lambda s: s.prefix_cache_queried_tokens),
    (CounterMetricFamily, "inferflux_prefix_cache_hit_tokens", "Prompt tokens whose KV the prefix cache supplied",
     lambda s: s.prefix_cache_hit_tokens),
    (CounterMetricFamily, "inferflux_spec_proposed_tokens", "Draft tokens verified by speculative decoding",
     lambda s: s.spec_proposed_tokens),
    (CounterMetricFamily, "inferflux_spec_accepted_tokens", "Draft tokens accepted by speculative decoding",
     lambda s: s.spec_accepted_tokens),
    (GaugeMetricFamily, "inferflux_spec_acceptance_rate", "Accepted / proposed draft tokens since start", _acceptance),
    (CounterMetricFamily, "inferflux_engine_preemptions", "Sequences preempted for KV memory (recomputed or swapped)",
     lambda s: s.num_preemptions),
    (GaugeMetricFamily, "inferflux_engine_swapped_sequences", "Preempted sequences whose KV is parked in swap space",
     lambda s: s.num_swapped),
    (CounterMetricFamily, "inferflux_kv_swap_out_blocks", "KV blocks written to swap space",
     lambda s: s.num_swapped_out_blocks),
    (CounterMetricFamily, "inferflux_kv_swap_in_blocks", "KV blocks read back from swap space",
     lambda s: s.num_swapped_in_blocks),
    # The host loop's cost (issue 47): CPU per step = delta CPU seconds / delta steps over a window.
    (CounterMetricFamily, "inferflux_engine_steps", "Engine steps (batches run through the backend's forward)",
     lambda s: s.num_steps),
    (CounterMetricFamily, "inferflux_engine_step_tokens", "Tokens run through forward (prefill and decode rows)",
     lambda s: s.num_tokens_processed),
    (CounterMetricFamily, "inferflux_engine_sampled_tokens", "Tokens sampled by the engine's steps",
     lambda s: s.num_tokens_generated),
    (CounterMetricFamily, "inferflux_engine_thread_cpu_seconds",
     "CPU seconds of the engine thread while it had work (a backend's wait on its device excluded)",
     lambda s: s.engine_thread_cpu_seconds),
)


class EngineStatsCollector(Collector):
    """Reads every engine's stats at scrape time, so gauges are never stale."""

    def __init__(self, manager: ModelManager) -> None:
        self._manager = manager

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        families = [(family(name, text, labels=["model"]), read) for family, name, text, read in _ENGINE_METRICS]
        for model in self._manager:
            try:
                stats = model.engine.stats()
            except Exception:  # a broken engine must not break the whole scrape
                log.exception("reading stats of %s failed", model.name)
                continue
            for metric, read in families:
                metric.add_metric([model.name], float(read(stats)))
        yield from (metric for metric, _ in families)


class _ReadGauge(Collector):
    """One unlabelled gauge whose value is read when scraped."""

    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name, self._doc, self._read = name, documentation, read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self._name, self._doc, value=float(self._read()))


class _ReadLabelledGauge(Collector):
    """A gauge with one label whose series are read when scraped: a series gone from the reading is gone."""

    def __init__(self, name: str, documentation: str, label: str, read: Callable[[], Mapping[str, float]]) -> None:
        self._name, self._doc, self._label, self._read = name, documentation, label, read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name, self._doc, labels=[self._label])
        for value, reading in sorted(self._read().items()):
            family.add_metric([value], float(reading))
        yield family


class GatewayMetrics:
    def __init__(self, manager: ModelManager | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "inferflux_http_requests",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "inferflux_http_request_duration_seconds",
            "Time from request start to the end of the response (streams included)",
            ["route", "method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "inferflux_time_to_first_token_seconds",
            "Time from request start to the first generated token",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "inferflux_prompt_tokens", "Prompt tokens processed", ["model"], registry=self.registry
        )
        self.completion_tokens = Counter(
            "inferflux_completion_tokens", "Completion tokens generated", ["model"], registry=self.registry
        )
        self.ratelimit_denied = Counter(
            "inferflux_ratelimit_denied",
            "Requests refused by a rate limit or quota, by limit and level",
            ["limit", "level"],
            registry=self.registry,
        )
        self.ratelimit_backend_failures = Counter(
            "inferflux_ratelimit_backend_failures",
            "Rate-limit backend (Redis) calls that failed, by operation",
            ["operation"],
            registry=self.registry,
        )
        self.guardrail_findings = Counter(
            "inferflux_guardrail_findings",
            "Guardrail findings by direction, type and action",
            ["direction", "type", "action"],
            registry=self.registry,
        )
        if manager is not None:
            self.registry.register(EngineStatsCollector(manager))

    def gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge read at scrape time, for state kept elsewhere (the store snapshot's age, the spool's disk)."""
        self.registry.register(_ReadGauge(name, documentation, read))

    def labelled_gauge(self, name: str, documentation: str, label: str,
                       read: Callable[[], Mapping[str, float]]) -> None:  # fmt: skip
        """A gauge read at scrape time with a series per ``label`` value (the manifests in error, by file)."""
        self.registry.register(_ReadLabelledGauge(name, documentation, label, read))

    def observe_limiter_failure(self, operation: str) -> None:
        self.ratelimit_backend_failures.labels(operation).inc()

    def observe_tokens(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        if prompt_tokens:
            self.prompt_tokens.labels(model).inc(prompt_tokens)
        if completion_tokens:
            self.completion_tokens.labels(model).inc(completion_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def render_for(self, accept: str, names: Sequence[str] = ()) -> tuple[bytes, str]:
        """The scrape in the format ``accept`` negotiates: OpenMetrics (which carries the latency
        histograms' exemplars, the trace ids of sampled requests) or Prometheus' text format.
        ``names``: only the samples of those names (``?name[]=``, as Prometheus' own client serves
        it), for a poller that wants a few gauges without the cost of every histogram."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry.restricted_registry(names) if names else self.registry), content_type


# HTTP allows any token as a method; unknown ones share a label.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        ended = False  # the response's last body message went out

        async def send_recording(message: Message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, send_recording)
            if not ended:  # the client left first (a stream's status went out with its head): its own outcome
                status = CLIENT_CLOSED_STATUS
        finally:
            route = route_template(scope)
            method = scope.get("method", "")
            method = method if method in KNOWN_METHODS else "other"
            self.metrics.requests.labels(route, method, str(status)).inc()
            # A traced request links its latency to its trace (an exemplar, shown in OpenMetrics scrapes).
            trace = ctx.trace if (ctx := scope.get(SCOPE_KEY)) is not None else None
            exemplar = trace.exemplar() if trace is not None else None
            self.metrics.latency.labels(route, method).observe(time.perf_counter() - started, exemplar)


# ``name[]`` values a scrape may ask for: a filter, not a way to make the server do unbounded work.
MAX_SCRAPE_NAMES = 64
MAX_SCRAPE_NAME_LENGTH = 200


async def metrics_route(request: Request) -> Response:
    metrics: GatewayMetrics = request.app.state.metrics
    names = request.query_params.getlist("name[]")
    if len(names) > MAX_SCRAPE_NAMES or any(len(n) > MAX_SCRAPE_NAME_LENGTH for n in names):
        raise InvalidRequest(f"at most {MAX_SCRAPE_NAMES} name[] values of at most {MAX_SCRAPE_NAME_LENGTH} "
                             "characters each", param="name[]")
    body, content_type = metrics.render_for(request.headers.get("accept", ""), names)
    return Response(body, headers={"content-type": content_type})
