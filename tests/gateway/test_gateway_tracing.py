"""OpenTelemetry traces of real requests: a span per stage, tiling the request's span; the client's
trace continued; the gateway's span passed to an upstream; exemplars in the OpenMetrics scrape.

One app (the session model, and a model an in-thread fake upstream serves) with
``tracing.enabled`` and an in-memory span exporter; the tenant has a rate limit,
an input and output blocklist and the operator a global Rego policy, so every
stage of the chain runs.

What "tiles" means here, precisely: the request span's children that run one
after another (every stage but those marked ``inferflux.concurrent``) do not
overlap, each starts and ends within the request span, and their durations add
up to at least 95 % of the request span's duration (in the best of up to five
requests: the share is of wall time, see the test). What no stage covers
(routing, middleware, rendering, writing to the socket) is the rest.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.testclient import TestClient

from inferflux.backends.base import ModelSpec
from fake_upstream import running_fake_upstream
from inferflux.gateway.app import create_app
from inferflux.gateway.models.served import ModelManager, load_served_model
from inferflux.gateway.settings import DEFAULT_MODEL_NAME, Settings
from http_helpers import bearer
from upstream_rules import LOOPBACK
from inferflux.policy.store import PolicyStore, StoreSettings

MODEL, REMOTE = DEFAULT_MODEL_NAME, "fleet"
SEQUENTIAL = ["authentication", "read_body", "guardrails.input", "plan", "limits", "opa", "queue_wait", "prefill",
              "decode", "audit"]  # fmt: skip
ALLOW_ALL = 'package inferflux.guardrails\ndefault decision := {"allow": true}\n'
CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


class World:
    def __init__(self, client: TestClient, exporter: InMemorySpanExporter, key: str, fake: Any) -> None:
        self.client, self.exporter, self.key, self.fake = client, exporter, key, fake

    def trace_of(self, response: Any) -> tuple[ReadableSpan, list[ReadableSpan]]:
        """The request span of ``response`` (found by its request id) and its children, in start order."""
        spans = self.exporter.get_finished_spans()
        rid = response.headers["x-request-id"]
        [root] = [s for s in spans if s.attributes and s.attributes.get("inferflux.request_id") == rid]
        children = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
        return root, sorted(children, key=lambda s: s.start_time or 0)


@pytest.fixture(scope="module")
def world(served_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    data_dir = tmp_path_factory.mktemp("tracing")
    store = PolicyStore.open(StoreSettings(), data_dir)
    tenant = store.create_tenant("traced")
    key = store.create_api_key(tenant.id, "k", "member")[1]
    store.create_policy(tenant.id, "rate_limit", "limits", {"scope": "tenant", "requests_per_minute": 1000})
    store.create_policy(tenant.id, "guardrail", "words", {"blocklist": [{"id": "w", "literal": "zzyzx"}]})
    store.create_policy(None, "guardrail", "operator", {"opa": {"engine": "embedded", "rego": ALLOW_ALL}})
    exporter = InMemorySpanExporter()
    with running_fake_upstream(token_delay=0.002) as fake:
        remote = load_served_model(ModelSpec(name=REMOTE, path="", upstream={"endpoints": [fake.url], "model": "up"}),
                                   "openai", egress=LOOPBACK)  # fmt: skip
        manager = ModelManager(expected=[MODEL, REMOTE])
        manager.add(served_model)
        manager.add(remote)
        settings = Settings(data_dir=tempfile.mkdtemp(dir=data_dir), tracing={"enabled": True})
        app = create_app(settings, manager, store=store, owns_models=False, span_exporter=exporter)
        try:
            with TestClient(app) as client:
                yield World(client, exporter, key, fake)
                remote.shutdown()  # while the app's loop runs: the fleet's connections close in it
        finally:
            store.close()


def chat(world: World, model: str = MODEL, stream: bool = False, headers: dict[str, str] | None = None,
         max_tokens: int = 2) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip
    response = world.client.post("/v1/chat/completions", json=body, headers={**bearer(world.key), **(headers or {})})
    assert response.status_code == 200, response.text
    return response


def duration(span: ReadableSpan) -> int:
    assert span.start_time is not None and span.end_time is not None
    return span.end_time - span.start_time


def coverage(root: ReadableSpan, sequential: list[ReadableSpan]) -> tuple[float, str]:
    """The share of ``root`` its sequential stages cover, and what to print if it is too small."""
    covered = sum(duration(s) for s in sequential) / duration(root)
    pairs = zip(sequential, sequential[1:])
    gaps = [((after.start_time or 0) - (before.end_time or 0)) / 1e6 for before, after in pairs]
    return covered, f"{covered:.3f} of ms {[(s.name, duration(s) / 1e6) for s in [root, *sequential]]}, gaps {gaps}"


# The 95 % is a share of wall time, so it is the one assertion here a busy machine can break
# with no defect: CI saw 94.3 % beside another test worker, and 92.8 % running alone (serial)
# on a slow 2-core host, where one thread hand-off or collection took 8 ms. A stage left
# untraced is missing from every request, not from one: so each request must pass every
# structural check, and the best of up to five must tile 95 %.
@pytest.mark.serial
@pytest.mark.parametrize("stream", [False, True])
def test_a_traced_request_shows_every_stage_and_they_tile_it(world: World, stream: bool) -> None:
    tries: list[str] = []
    for _ in range(5):
        covered, seen = check_one_traced_request(world, stream)
        if 0.95 <= covered <= 1.0:
            return
        tries.append(seen)
    pytest.fail("no request's stages tiled 95 % of it:\n" + "\n".join(tries))


def check_one_traced_request(world: World, stream: bool) -> tuple[float, str]:
    """One request's trace has every stage, in order, inside the request and not overlapping; the share of
    the request its stages cover, and what to print if it is too small."""
    response = chat(world, stream=stream, max_tokens=8)
    root, children = world.trace_of(response)
    assert root.name == "POST /v1/chat/completions" and root.attributes is not None
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["inferflux.model"] == MODEL
    sequential = [s for s in children if not (s.attributes or {}).get("inferflux.concurrent")]
    assert [s.name for s in sequential] == SEQUENTIAL
    [output] = [s for s in children if s.name == "guardrails.output"]
    assert output.attributes is not None and output.attributes["inferflux.checks"] >= 1
    assert 0 < output.attributes["inferflux.busy_ms"] * 1e6 <= duration(output) + 1
    assert all(s.context.trace_id == root.context.trace_id for s in children)
    assert root.start_time is not None and root.end_time is not None
    assert sequential[0].start_time is not None and sequential[0].start_time >= root.start_time
    for before, after in zip(sequential, sequential[1:]):
        assert before.end_time is not None and after.start_time is not None
        assert after.start_time >= before.end_time, (before.name, after.name)
    assert sequential[-1].end_time is not None and sequential[-1].end_time <= root.end_time
    # Decoding 8 tokens took time.
    assert duration(children[[s.name for s in children].index("decode")]) > 0
    return coverage(root, sequential)


def test_the_clients_trace_is_continued(world: World) -> None:
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    root, children = world.trace_of(chat(world, headers={"traceparent": traceparent}))
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert root.parent is not None and format(root.parent.span_id, "016x") == CLIENT_SPAN
    assert children and all(format(s.context.trace_id, "032x") == CLIENT_TRACE for s in children)
    # An id the client did not send (or a malformed traceparent) starts a trace of the gateway's own.
    fresh, _ = world.trace_of(chat(world, headers={"traceparent": "00-zz-not-a-trace"}))
    assert format(fresh.context.trace_id, "032x") != CLIENT_TRACE and fresh.parent is None


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_gets_the_gateways_span_as_its_parent(world: World, stream: bool) -> None:
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    world.fake.reset_counters()
    response = chat(world, REMOTE, stream=stream, max_tokens=8, headers={"traceparent": traceparent, "tracestate": "vendor=1"})
    root, children = world.trace_of(response)
    [sent] = [h for h in world.fake.headers if "traceparent" in h]
    version, trace_id, parent_id, flags = sent["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", CLIENT_TRACE, "01")
    assert parent_id == format(root.context.span_id, "016x") != CLIENT_SPAN  # the gateway's span, not the client's
    assert sent["tracestate"] == "vendor=1"
    # A remote model's stages are what the gateway saw: no queue, the upstream's first token, the rest.
    names = [s.name for s in children]
    assert {"queue_wait", "prefill", "decode", "audit"} <= set(names)
    assert root.attributes is not None and root.attributes["inferflux.model"] == REMOTE


def test_the_latency_histogram_links_to_traces_in_openmetrics(world: World) -> None:
    root, _ = world.trace_of(chat(world))
    trace_id = format(root.context.trace_id, "032x")
    scraped = world.client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert scraped.status_code == 200 and scraped.headers["content-type"].startswith("application/openmetrics-text")
    exemplars = [line for line in scraped.text.splitlines()
                 if line.startswith("inferflux_http_request_duration_seconds_bucket") and " # {" in line]  # fmt: skip
    assert any(f'trace_id="{trace_id}"' in line for line in exemplars), exemplars[:5]
    # Prometheus' text format (the default) has no exemplars.
    plain = world.client.get("/metrics")
    assert plain.headers["content-type"].startswith("text/plain") and "trace_id=" not in plain.text


def test_a_refused_request_is_traced_too(world: World) -> None:
    response = world.client.post("/v1/chat/completions", headers=bearer(world.key), json={
        "model": MODEL, "messages": [{"role": "user", "content": "say zzyzx"}], "max_tokens": 2})  # fmt: skip
    assert response.status_code == 400
    root, children = world.trace_of(response)
    assert root.attributes is not None and root.attributes["http.response.status_code"] == 400
    assert [s.name for s in children] == ["authentication", "read_body", "guardrails.input", "audit"]
    assert [s.name for s in children if s.status.status_code.name == "ERROR"] == ["guardrails.input"]  # it refused
    assert json.loads(response.text)["error"]["code"] == "content_filter"


def test_tracing_off_makes_no_spans(served_model: Any, tmp_path: Any) -> None:
    exporter = InMemorySpanExporter()
    store = PolicyStore.open(StoreSettings(), tmp_path)
    try:
        key = store.ensure_bootstrap_admin()
        manager = ModelManager(expected=[MODEL])
        manager.add(served_model)
        app = create_app(Settings(data_dir=tmp_path / "data"), manager, store=store, owns_models=False,
                         span_exporter=exporter)  # fmt: skip
        with TestClient(app) as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert client.post("/v1/chat/completions", json=body, headers=bearer(str(key))).status_code == 200
            scraped = client.get("/metrics", headers={"accept": "application/openmetrics-text"})
        assert exporter.get_finished_spans() == ()
        assert "trace_id=" not in scraped.text
    finally:
        store.close()
