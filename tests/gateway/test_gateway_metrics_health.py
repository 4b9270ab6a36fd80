"""/metrics, /livez and /readyz."""

from __future__ import annotations

import re
from typing import Any

import httpx
from starlette.testclient import TestClient

from inferflux.gateway.app import create_app
from inferflux.gateway.models.served import ModelManager, ServedModel
from inferflux.gateway.settings import Settings

MODEL = "smollm2-135m-instruct"


def _sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one series in Prometheus text format, or None."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_metrics_after_requests(live_server: str, auth_headers: dict[str, str]) -> None:
    with httpx.Client(base_url=live_server, headers=auth_headers, timeout=60) as http:
        ok = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert ok.status_code == 200
        assert http.get("/v1/models/no-such-model").status_code == 404
        assert http.get("/definitely/not/a/route").status_code == 404
        resp = http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    text = resp.text

    route = "/v1/chat/completions"
    assert (_sample(text, "inferflux_http_requests_total", route=route, method="POST", status="200") or 0) >= 1
    # The route template, not the raw path, labels the 404 on /v1/models/{id}.
    assert _sample(text, "inferflux_http_requests_total", route="/v1/models/{model_id:path}", status="404")
    assert _sample(text, "inferflux_http_requests_total", route="unmatched", status="404")
    assert "no-such-model" not in text and "/definitely" not in text
    assert (_sample(text, "inferflux_http_request_duration_seconds_count", route=route, method="POST") or 0) >= 1
    assert (_sample(text, "inferflux_time_to_first_token_seconds_count", model=MODEL) or 0) >= 1
    assert (_sample(text, "inferflux_prompt_tokens_total", model=MODEL) or 0) > 0
    assert (_sample(text, "inferflux_completion_tokens_total", model=MODEL) or 0) >= 3
    for gauge in ("inferflux_engine_running_sequences", "inferflux_engine_waiting_sequences"):
        assert _sample(text, gauge, model=MODEL) is not None
    used = _sample(text, "inferflux_kv_blocks_used", model=MODEL)
    free = _sample(text, "inferflux_kv_blocks_free", model=MODEL)
    assert used is not None and free is not None and free > 0
    slots_used = _sample(text, "inferflux_kv_slots_used", model=MODEL)
    slots_allocated = _sample(text, "inferflux_kv_slots_allocated", model=MODEL)
    utilisation = _sample(text, "inferflux_kv_slot_utilisation", model=MODEL)
    assert slots_used is not None and slots_allocated is not None and utilisation is not None
    assert 0 <= slots_used <= slots_allocated and 0 <= utilisation <= 1


def test_livez_and_readyz(live_server: str) -> None:
    with httpx.Client(base_url=live_server, timeout=10) as http:
        assert http.get("/livez").json() == {"status": "ok"}
        ready = http.get("/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok"}


def test_readyz_reports_missing_models(served_model: ServedModel, gateway_store: Any) -> None:
    manager = ModelManager(expected=[served_model.name, "still-loading"])
    manager.add(served_model)
    client = TestClient(create_app(Settings(), manager, store=gateway_store, owns_models=False))
    resp = client.get("/readyz")
    assert resp.status_code == 503
    assert resp.json()["reasons"] == ["model 'still-loading' is not loaded"]
    assert client.get("/livez").status_code == 200

    empty = TestClient(create_app(Settings(), ModelManager(), store=gateway_store, owns_models=False))
    assert empty.get("/readyz").status_code == 503


def test_a_scrape_may_ask_for_some_series_only(live_server: str, auth_headers: dict[str, str]) -> None:
    """``?name[]=`` (as Prometheus' own client serves it): only those samples, which is what a poller of two
    gauges wants (benchmarks/serving_extras.py); past the bounds, a 400 naming the parameter."""
    names = ["inferflux_kv_slots_used", "inferflux_kv_slots_allocated"]
    with httpx.Client(base_url=live_server, headers=auth_headers, timeout=60) as http:
        some = http.get("/metrics", params={"name[]": names})
        every = http.get("/metrics")
        too_many = http.get("/metrics", params={"name[]": [f"m{i}" for i in range(65)]})
    assert some.status_code == 200 and every.status_code == 200
    sampled = {line.split("{", 1)[0].split(" ", 1)[0] for line in some.text.splitlines() if not line.startswith("#")}
    assert sampled == set(names), some.text
    assert "inferflux_http_requests_total" in every.text and "inferflux_http_requests_total" not in some.text
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "name[]", too_many.text
