"""Speculative decoding through the API: a model configured for it, the per-request
``speculative`` extension, clear errors, and the metrics."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from http_helpers import error_of

COPY_PROMPT = "Copy the list exactly.\nList: red, green, blue, yellow, purple, orange, black, white.\nCopy: red,"


@pytest.fixture(scope="module")
def speculative_model() -> Iterator[Any]:
    """The default model again, in its own engine with n-gram speculation (k = 4)."""
    from inferflux.backends.base import ModelSpec
    from inferflux.backends.engine import EngineConfig
    from inferflux.backends.engine.speculative import SpeculativeConfig
    from inferflux.backends.models import default_model_path

    from inferflux.gateway.models.served import load_served_model

    spec = ModelSpec(name="smollm2-spec", path=default_model_path(), dtype="float32")
    model = load_served_model(spec, "cpu", EngineConfig(kv_cache_bytes=32 << 20, speculative=SpeculativeConfig(k=4)))
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def draft_model() -> Iterator[Any]:
    """The default model with a draft model: itself again, loaded as the draft through the gateway's loader."""
    from inferflux.backends.base import ModelSpec
    from inferflux.backends.engine import EngineConfig
    from inferflux.backends.engine.speculative import SpeculativeConfig
    from inferflux.backends.models import default_model_path

    from inferflux.gateway.models.served import load_served_model

    spec = ModelSpec(name="smollm2-draft", path=default_model_path(), dtype="float32")
    draft = SpeculativeConfig(method="draft", draft_model=default_model_path(), k=3)
    model = load_served_model(spec, "cpu", EngineConfig(kv_cache_bytes=32 << 20, speculative=draft))
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def client(served_model: Any, speculative_model: Any, draft_model: Any, gateway_store: Any) -> Iterator[TestClient]:
    import tempfile

    from inferflux.gateway.app import create_app
    from inferflux.gateway.models.served import ModelManager
    from inferflux.gateway.settings import Settings

    manager = ModelManager(expected=[served_model.name, speculative_model.name, draft_model.name])
    manager.add(served_model)
    manager.add(speculative_model)
    manager.add(draft_model)
    app = create_app(Settings(data_dir=tempfile.mkdtemp(prefix="inferflux-app-")), manager, store=gateway_store,
                     owns_models=False)  # fmt: skip
    with TestClient(app) as test_client:
        yield test_client


def complete(client: TestClient, headers: dict[str, str], model: str, **extra: Any) -> Any:
    body = {"model": model, "prompt": COPY_PROMPT, "max_tokens": 24, "temperature": 0, **extra}
    return client.post("/v1/completions", json=body, headers=headers)


def test_speculation_changes_nothing_a_client_sees(client: TestClient, auth_headers: dict[str, str]) -> None:
    plain = complete(client, auth_headers, DEFAULT_MODEL_NAME)
    speculative = complete(client, auth_headers, "smollm2-spec")
    opted_out = complete(client, auth_headers, "smollm2-spec", speculative={"k": 0})
    capped = complete(client, auth_headers, "smollm2-spec", speculative={"method": "ngram", "k": 2})
    texts = [r.json()["choices"][0]["text"] for r in (plain, speculative, opted_out, capped)]
    assert all(r.status_code == 200 for r in (plain, speculative, opted_out, capped))
    assert texts[1:] == [texts[0]] * 3  # greedy: token for token the plain model's text
    usage = [r.json()["usage"]["completion_tokens"] for r in (plain, speculative)]
    assert usage[0] == usage[1] == 24


def test_a_draft_model_changes_nothing_a_client_sees(client: TestClient, auth_headers: dict[str, str]) -> None:
    plain = complete(client, auth_headers, DEFAULT_MODEL_NAME)
    drafted = complete(client, auth_headers, "smollm2-draft", speculative={"method": "draft"})
    assert plain.status_code == drafted.status_code == 200, drafted.text
    assert drafted.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    text = client.get("/metrics", headers=auth_headers).text
    proposed = re.search(r'^inferflux_spec_proposed_tokens_total{model="smollm2-draft"} (\S+)$', text, re.M)
    accepted = re.search(r'^inferflux_spec_accepted_tokens_total{model="smollm2-draft"} (\S+)$', text, re.M)
    assert proposed and accepted and float(proposed.group(1)) > 0
    # The draft is the model itself: it proposes what the model would say.
    assert float(accepted.group(1)) >= 0.9 * float(proposed.group(1))
    wrong = complete(client, auth_headers, "smollm2-draft", speculative={"method": "ngram"})
    assert wrong.status_code == 400 and "it uses draft" in error_of(wrong)["message"]


def test_drafts_are_counted_in_the_metrics(client: TestClient, auth_headers: dict[str, str]) -> None:
    complete(client, auth_headers, "smollm2-spec")
    text = client.get("/metrics", headers=auth_headers).text

    def sample(name: str) -> float:
        match = re.search(rf'^{name}{{model="smollm2-spec"}} (\S+)$', text, re.M)
        assert match, f"{name} missing"
        return float(match.group(1))

    proposed = sample("inferflux_spec_proposed_tokens_total")
    accepted = sample("inferflux_spec_accepted_tokens_total")
    assert proposed >= accepted > 0
    assert sample("inferflux_spec_acceptance_rate") == pytest.approx(accepted / proposed)


@pytest.mark.parametrize(
    ("model", "speculative", "status", "message"),
    [
        (DEFAULT_MODEL_NAME, {"k": 2}, 400, "not enabled"),  # this model has no speculation
        (DEFAULT_MODEL_NAME, {"method": "ngram"}, 400, "not enabled"),
        ("smollm2-spec", {"method": "eagle"}, 400, "speculative"),
        ("smollm2-spec", {"k": 17}, 400, "speculative"),
        ("smollm2-spec", {"k": "2"}, 400, "speculative"),
        ("smollm2-spec", {"depth": 3}, 400, "speculative"),
        ("smollm2-spec", [2], 400, "speculative"),
    ],
)
def test_bad_speculative_requests_are_clear_errors(
    client: TestClient, auth_headers: dict[str, str], model: str, speculative: Any, status: int, message: str
) -> None:
    response = complete(client, auth_headers, model, speculative=speculative)
    assert response.status_code == status, response.text
    error = error_of(response)
    assert message in error["message"] and (error["param"] or "").startswith("speculative")


def test_k_zero_is_allowed_where_speculation_is_off(client: TestClient, auth_headers: dict[str, str]) -> None:
    assert complete(client, auth_headers, DEFAULT_MODEL_NAME, speculative={"k": 0}).status_code == 200
