"""An engine that is down, or too busy, answers 503 rather than failing or hanging."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from starlette.testclient import TestClient

from inferflux.backends.engine import AsyncEngine
from inferflux.gateway.app import create_app
from inferflux.gateway.models.served import ModelManager, ServedModel
from inferflux.gateway.settings import Settings

BODY = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_stopped_engine_is_503_and_not_ready(
    served_model: ServedModel, gateway_store: Any, auth_headers: dict[str, str]
) -> None:
    # A second AsyncEngine over the same LLMEngine, shut down before it ever
    # started: its thread never touches the shared engine.
    stopped = AsyncEngine(served_model.engine.engine)
    stopped.shutdown()
    manager = ModelManager(expected=[served_model.name])
    manager.add(replace(served_model, engine=stopped))
    client = TestClient(create_app(Settings(), manager, store=gateway_store, owns_models=False), headers=auth_headers)

    for stream in (False, True):
        resp = client.post("/v1/chat/completions", json={**BODY, "stream": stream})
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "model_not_ready"
    ready = client.get("/readyz")
    assert ready.status_code == 503
    assert "not running" in ready.json()["reasons"][0]


def test_queue_limit_is_503_with_retry_after(
    served_model: ServedModel, gateway_store: Any, auth_headers: dict[str, str]
) -> None:
    manager = ModelManager()
    manager.add(served_model)
    client = TestClient(
        create_app(Settings(max_queued_sequences=1), manager, store=gateway_store, owns_models=False),
        headers=auth_headers,
    )
    resp = client.post("/v1/chat/completions", json={**BODY, "n": 2})
    assert resp.status_code == 503
    assert resp.json()["error"]["code"] == "engine_overloaded"
    assert resp.headers["retry-after"] == "1"
