"""The ``upstream`` section of a model and the ``upstreams`` section: what the YAML may say."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from inferflux.gateway.settings import Settings

ENDPOINT = "http://10.0.0.5:8000/v1"


def settings(**model: Any) -> Settings:
    return Settings(upstreams={"allowed_hosts": ["10.0.0.5"]}, models=[{"name": "llama-70b", **model}])


def test_an_upstream_model_needs_no_path_and_gets_the_openai_backend() -> None:
    [(spec, backend)] = settings(upstream={"endpoints": [ENDPOINT + "/"], "model": "meta/llama"}).model_specs()
    assert backend == "openai" and spec.path == ""
    assert spec.upstream is not None
    assert spec.upstream["endpoints"] == [ENDPOINT] and spec.upstream["model"] == "meta/llama"
    assert spec.upstream["max_inflight_per_endpoint"] == 64 and spec.upstream["routing"] == "prefix"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({}, "needs a path"),
        ({"path": "/m.gguf", "upstream": {"endpoints": [ENDPOINT]}}, "not both"),
        ({"backend": "cpu", "upstream": {"endpoints": [ENDPOINT]}}, "served by backend 'openai'"),
        ({"backend": "openai", "path": "/m.gguf"}, "needs an upstream"),
        ({"upstream": {"endpoints": [ENDPOINT], "credential": "c", "api_key_env": "V"}}, "not both"),
        ({"upstream": {"endpoints": ["http://k:s@10.0.0.5/v1"]}}, "credentials"),
        ({"upstream": {"endpoints": ["http://10.0.0.5/v1?key=s"]}}, "query"),
        ({"upstream": {"endpoints": [ENDPOINT, ENDPOINT + "/"]}}, "twice"),
        ({"upstream": {"endpoints": [ENDPOINT], "timeout_seconds": 0}}, "greater than 0"),
        ({"upstream": {"endpoints": [ENDPOINT]}, "dtype": "float32"}, "local models"),
    ],
)
def test_a_wrong_model_entry_is_refused_saying_why(model: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        settings(**model)


def test_allowed_hosts_pin_where_upstreams_may_be() -> None:
    pinned = {"allowed_hosts": ["10.0.0.5", "*.fleet.internal"]}
    Settings(upstreams=pinned, models=[{"name": "a", "upstream": {"endpoints": [ENDPOINT]}},
                                       {"name": "b", "upstream": {"endpoints": ["https://gpu-1.fleet.internal/v1"]}}])
    with pytest.raises(ValidationError, match="not in upstreams.allowed_hosts"):
        Settings(upstreams=pinned, models=[{"name": "c", "upstream": {"endpoints": ["http://10.0.0.6/v1"]}}])
    with pytest.raises(ValidationError, match="not in upstreams.allowed_hosts"):  # the bare domain is not a subdomain
        Settings(upstreams=pinned, models=[{"name": "d", "upstream": {"endpoints": ["http://fleet.internal/v1"]}}])


def test_client_credentials_can_never_be_forwarded_upstream() -> None:
    assert Settings().upstreams.forward_headers == ["traceparent", "tracestate"]
    with pytest.raises(ValidationError, match="authorization"):
        Settings(upstreams={"forward_headers": ["traceparent", "Authorization"]})
