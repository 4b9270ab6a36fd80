"""A model served by an upstream server (backend ``openai``), with the whole policy chain in front.

The upstream is a real InferFlux gateway serving the default model (the
session's ``live_server``); the gateway under test fronts it over loopback and
is called with the official ``openai`` client. Greedy answers through the front
equal the upstream's own; limits, guardrails and audit act as for a local model.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from http_helpers import bearer, error_of
from idp import closed_loopback_url
from servers import start_uvicorn, stop_uvicorn
from upstream_rules import LOOPBACK, LOOPBACK_UPSTREAMS

from inferflux.backends.base import ModelSpec
from inferflux.gateway.models.served import load_served_model
from inferflux.gateway.settings import DEFAULT_MODEL_NAME
from inferflux.policy.audit import verify_spool
from inferflux.policy.store import PolicyStore, StoreSettings

REMOTE = "fleet"
POLL = 0.05
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Front:
    def __init__(self, url: str, store: PolicyStore, app: Any, data_dir: Path, admin: str) -> None:
        self.url, self.store, self.app, self.data_dir, self.admin = url, store, app, data_dir, admin
        self.n = 0

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.admin, max_retries=0, timeout=60)

    def tenant_key(self) -> tuple[Any, str]:
        self.n += 1
        tenant = self.store.create_tenant(f"up{self.n}")
        return tenant, self.store.create_api_key(tenant.id, "k", "member")[1]

    def settled(self) -> None:
        deadline = time.monotonic() + 10
        while self.app.state.traffic_tasks:
            assert time.monotonic() < deadline, "settlements did not finish"
            time.sleep(0.02)

    def events(self) -> dict[str, dict[str, Any]]:
        spool = self.data_dir / "audit" / "segments"
        lines = [json.loads(line) for seg in sorted(spool.glob("*.jsonl")) for line in seg.read_text().splitlines()]
        return {e["event"]["request_id"]: e["event"] for e in lines}


def remote_model(endpoint: str, key: str | None, name: str = REMOTE, **upstream: Any) -> Any:
    spec = ModelSpec(name=name, path="", upstream={"endpoints": [endpoint], "model": DEFAULT_MODEL_NAME, **upstream})
    return load_served_model(spec, "openai", upstream_key=key, egress=LOOPBACK)


@pytest.fixture(scope="module")
def front(live_server: str, admin_key: str, app_for_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    data_dir = tmp_path_factory.mktemp("front")
    store = PolicyStore.open(StoreSettings(), data_dir)
    front_admin = store.ensure_bootstrap_admin()
    model = remote_model(f"{live_server}/v1", admin_key)
    app = app_for_model(model, store, data_dir=str(data_dir), auth={"revocation_poll_seconds": POLL},
                        upstreams=LOOPBACK_UPSTREAMS)  # the admin API's models may be on loopback too
    server, thread, sock, url = start_uvicorn(app)
    try:
        yield Front(url, store, app, data_dir, str(front_admin))
    finally:
        model.shutdown()  # while the server's loop runs: the fleet's connections close in it
        stop_uvicorn(server, thread, sock)
        store.close()


@pytest.fixture(scope="module")
def upstream(live_server: str, admin_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key=admin_key, max_retries=0, timeout=60)


def stream_text(stream: Any) -> tuple[str, str | None, Any]:
    text, finish, usage = "", None, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)  # chat; a completion's choice has text
            text += (delta.content if delta is not None else choice.text) or ""
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    return text, finish, usage


# -- the same answers as the upstream's ------------------------------------------------------


def test_greedy_chat_through_the_front_equals_the_upstream(front: Front, upstream: openai.OpenAI) -> None:
    direct = upstream.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=24, temperature=0)
    whole = front.client().chat.completions.create(model=REMOTE, messages=QUESTION, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == direct.choices[0].message.content
    assert whole.choices[0].finish_reason == direct.choices[0].finish_reason
    assert whole.model == REMOTE and whole.id.startswith("chatcmpl-")
    # The upstream's own counts, not the estimate.
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (
        direct.usage.prompt_tokens, direct.usage.completion_tokens)

    streamed = front.client().chat.completions.create(model=REMOTE, messages=QUESTION, max_tokens=24, temperature=0,
                                                      stream=True, stream_options={"include_usage": True})
    text, finish, usage = stream_text(streamed)
    assert text == direct.choices[0].message.content and finish == direct.choices[0].finish_reason
    assert usage.completion_tokens == direct.usage.completion_tokens


def test_greedy_completion_through_the_front_equals_the_upstream(front: Front, upstream: openai.OpenAI) -> None:
    args: dict[str, Any] = {"prompt": "The sea is", "max_tokens": 12, "temperature": 0}
    direct = upstream.completions.create(model=DEFAULT_MODEL_NAME, **args)
    whole = front.client().completions.create(model=REMOTE, **args)
    assert whole.choices[0].text == direct.choices[0].text
    text, finish, _ = stream_text(front.client().completions.create(model=REMOTE, stream=True, **args))
    assert (text, finish) == (direct.choices[0].text, direct.choices[0].finish_reason)


def test_n_choices_and_stop_sequences_travel(front: Front, upstream: openai.OpenAI) -> None:
    direct = upstream.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION, max_tokens=24, temperature=0)
    word = direct.choices[0].message.content.split()[1]
    both = front.client().chat.completions.create(model=REMOTE, messages=QUESTION, max_tokens=24, temperature=0, n=2,
                                                  stop=[word])
    assert [c.index for c in both.choices] == [0, 1]
    for choice in both.choices:
        assert word not in choice.message.content and choice.finish_reason == "stop"


def test_response_format_and_logit_bias_travel(front: Front, upstream: openai.OpenAI) -> None:
    """The upstream enforces them (here an InferFlux engine's grammar): the answer is the upstream's own."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    args: dict[str, Any] = {"messages": QUESTION, "max_tokens": 80, "temperature": 0, "logit_bias": {"28": -100},
                            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    direct = upstream.chat.completions.create(model=DEFAULT_MODEL_NAME, **args)
    whole = front.client().chat.completions.create(model=REMOTE, **args)
    assert whole.choices[0].message.content == direct.choices[0].message.content
    assert set(json.loads(whole.choices[0].message.content)) == {"city"}


# -- the policy chain ------------------------------------------------------------------------


def test_a_token_quota_counts_the_upstreams_usage(front: Front) -> None:
    tenant, key = front.tenant_key()
    front.store.create_policy(tenant.id, "rate_limit", "tpm", {"scope": "tenant", "tokens_per_minute": 60})
    time.sleep(3 * POLL)
    first = front.client(key).chat.completions.create(model=REMOTE, messages=QUESTION, max_tokens=24, temperature=0)
    assert first.usage.total_tokens > 30
    front.settled()
    with pytest.raises(openai.RateLimitError):
        front.client(key).chat.completions.create(model=REMOTE, messages=QUESTION, max_tokens=24, temperature=0)


def test_an_output_guardrail_cuts_an_upstream_stream(front: Front) -> None:
    tenant, key = front.tenant_key()
    ask = {"model": REMOTE, "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
           "max_tokens": 24, "temperature": 0}
    text, finish, _ = stream_text(front.client(key).chat.completions.create(stream=True, **ask))
    word = next(w.strip(".,!?") for w in text.split()[2:] if len(w.strip(".,!?")) > 3)
    front.store.create_policy(tenant.id, "guardrail", "out",
                              {"blocklist": [{"id": "w", "literal": word, "direction": "output"}]})
    time.sleep(3 * POLL)
    filtered, finish, _ = stream_text(front.client(key).chat.completions.create(stream=True, **ask))
    assert finish == "content_filter"
    assert word.lower() not in filtered.lower() and filtered == text[: len(filtered)]


def test_an_output_guardrail_cuts_a_whole_answer_as_it_cuts_the_stream(front: Front) -> None:
    """A client that takes its answer whole gets it from one unstreamed upstream request, checked once: the
    same text and finish reason as the streamed check gives; the tokens charged are the upstream's count of
    the whole answer it generated."""
    tenant, key = front.tenant_key()
    ask = {"model": REMOTE, "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
           "max_tokens": 24, "temperature": 0}
    unfiltered = front.client(key).chat.completions.create(**ask)
    text = unfiltered.choices[0].message.content
    word = next(w.strip(".,!?") for w in text.split()[2:] if len(w.strip(".,!?")) > 3)
    front.store.create_policy(tenant.id, "guardrail", "out",
                              {"blocklist": [{"id": "w", "literal": word, "direction": "output"}]})
    time.sleep(3 * POLL)
    whole = front.client(key).chat.completions.create(**ask)
    streamed, finish, _ = stream_text(front.client(key).chat.completions.create(stream=True, **ask))
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (streamed, finish)
    assert finish == "content_filter" and word.lower() not in streamed.lower() and text.startswith(streamed)
    assert whole.usage.completion_tokens == unfiltered.usage.completion_tokens


def test_an_input_guardrail_refuses_before_the_upstream_is_called(front: Front) -> None:
    tenant, key = front.tenant_key()
    front.store.create_policy(tenant.id, "guardrail", "in", {"blocklist": [{"id": "w", "literal": "zebra"}]})
    time.sleep(3 * POLL)
    with pytest.raises(openai.BadRequestError) as info:
        front.client(key).chat.completions.create(model=REMOTE, messages=[{"role": "user", "content": "a zebra"}])
    assert info.value.code == "content_filter"


def test_remote_calls_are_audited_with_the_upstreams_usage(front: Front) -> None:
    _, key = front.tenant_key()
    raw = httpx.post(f"{front.url}/v1/chat/completions", headers=bearer(key), timeout=60,
                     json={"model": REMOTE, "messages": QUESTION, "max_tokens": 8, "temperature": 0})
    assert raw.status_code == 200, raw.text
    usage = raw.json()["usage"]
    front.settled()
    deadline = time.monotonic() + 10
    while raw.headers["x-request-id"] not in front.events():
        assert time.monotonic() < deadline, "the call was not audited"
        time.sleep(0.05)
    event = front.events()[raw.headers["x-request-id"]]
    assert event["model"] == REMOTE and event["decision"] == "allow"
    assert (event["prompt_tokens"], event["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert verify_spool(front.data_dir / "audit").ok


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("completions", {"prompt": "x", "echo": True}, "echo"),
        ("completions", {"prompt": "x", "logprobs": 2}, "logprobs"),
        ("completions", {"prompt": [1, 2, 3]}, "prompt"),
        ("chat/completions", {"messages": QUESTION, "speculative": {"k": 2}}, "speculative"),
    ],
)
def test_what_only_a_local_engine_can_do_is_refused_clearly(front: Front, route: str, body: dict[str, Any],
                                                            param: str) -> None:
    response = httpx.post(f"{front.url}/v1/{route}", headers=bearer(front.admin), json={"model": REMOTE, **body})
    assert response.status_code == 400
    assert error_of(response)["param"] == param and error_of(response)["code"] == "unsupported_parameter"


def test_an_unreachable_upstream_is_a_503_with_retry_after(
    front: Front, app_for_model: Any, tmp_path: Path
) -> None:
    model = remote_model(f"{closed_loopback_url()}/v1", None, name="gone", retries=0)
    store = PolicyStore.open(StoreSettings(), tmp_path)
    key = str(store.ensure_bootstrap_admin())
    server, thread, sock, url = start_uvicorn(app_for_model(model, store, data_dir=str(tmp_path / "app")))
    try:
        response = httpx.post(f"{url}/v1/chat/completions", headers=bearer(key), timeout=30,
                              json={"model": "gone", "messages": QUESTION, "max_tokens": 4})
        assert response.status_code == 503, response.text
        assert "retry-after" in response.headers or error_of(response)["code"] == "service_unavailable"
        assert "127.0.0.1" not in response.text  # no endpoint in what the client sees
    finally:
        model.shutdown()
        stop_uvicorn(server, thread, sock)
        store.close()


# -- the admin API ---------------------------------------------------------------------------


def wait_ready(url: str, headers: dict[str, str], name: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        status = httpx.get(f"{url}/admin/v1/models/{name}", headers=headers).json()
        if status.get("status") != "loading":
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


def test_the_admin_api_adds_an_upstream_model_with_a_stored_credential(front: Front, live_server: str,
                                                                       admin_key: str) -> None:
    admin = bearer(front.admin)
    front.store.create_credential(None, "engine-key", admin_key)
    body = {"name": "fleet-2", "upstream": {"endpoints": [f"{live_server}/v1"], "model": DEFAULT_MODEL_NAME,
                                            "credential": "engine-key"}}
    loading = httpx.post(f"{front.url}/admin/v1/models", headers=admin, json=body)
    assert loading.status_code == 202, loading.text
    status = wait_ready(front.url, admin, "fleet-2")
    assert status["status"] == "ready" and status["backend"] == "openai", status
    assert admin_key not in json.dumps(status)  # the endpoints, never the key
    assert status["upstream"]["endpoints"][0]["url"] == f"{live_server}/v1"
    card = httpx.get(f"{front.url}/v1/models/fleet-2", headers=admin).json()
    assert card["backend"] == "openai"
    answer = front.client().chat.completions.create(model="fleet-2", messages=QUESTION, max_tokens=4, temperature=0)
    assert answer.choices[0].message.content
    # Kept in the registry, so every replica and the next start serve it.
    record = front.store.get_served_model_by_name("fleet-2")
    assert record.backend == "openai" and record.upstream["credential"] == "engine-key"
    assert admin_key not in json.dumps(record.upstream)
    assert httpx.delete(f"{front.url}/admin/v1/models/fleet-2", headers=admin).status_code == 204


@pytest.mark.parametrize(
    ("upstream", "param"),
    [
        ({"endpoints": ["ftp://10.0.0.5/v1"]}, "upstream.endpoints"),
        ({"endpoints": ["http://user:pw@10.0.0.5/v1"]}, "upstream.endpoints"),
        ({"endpoints": []}, "upstream.endpoints"),
        ({"endpoints": ["http://10.0.0.5/v1"], "credential": "a", "api_key_env": "B"}, "upstream"),
        ({"endpoints": ["http://10.0.0.5/v1"], "surprise": 1}, "upstream.surprise"),
    ],
)
def test_a_bad_upstream_is_a_422_naming_the_field(front: Front, upstream: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{front.url}/admin/v1/models", headers=bearer(front.admin),
                          json={"name": "bad", "upstream": upstream})
    assert response.status_code == 422, response.text
    assert error_of(response)["param"] == param
    assert "pw" not in response.text


def test_allowed_hosts_keep_the_admin_api_from_pointing_anywhere(app_for_model: Any, tmp_path: Path,
                                                                 live_server: str, admin_key: str) -> None:
    from starlette.testclient import TestClient

    model = remote_model(f"{live_server}/v1", admin_key)
    store = PolicyStore.open(StoreSettings(), tmp_path)
    key = str(store.ensure_bootstrap_admin())
    app = app_for_model(model, store, data_dir=str(tmp_path / "app"), upstreams={"allowed_hosts": ["*.fleet.internal"]})
    try:
        with TestClient(app) as client:
            refused = client.post("/admin/v1/models", headers=bearer(key),
                                  json={"name": "x", "upstream": {"endpoints": ["http://169.254.169.254/v1"]}})
            assert refused.status_code == 422 and error_of(refused)["param"] == "upstream.endpoints"
            allowed = client.post("/admin/v1/models", headers=bearer(key),
                                  json={"name": "y", "upstream": {"endpoints": ["http://gpu-1.fleet.internal:8000/v1"]}})
            assert allowed.status_code == 202, allowed.text
            member = store.create_api_key(store.create_tenant("t").id, "k", "tenant-admin")[1]
            foreign = client.post("/admin/v1/models", headers=bearer(member),
                                  json={"name": "z", "upstream": {"endpoints": ["http://gpu-1.fleet.internal/v1"]}})
            assert foreign.status_code == 404  # only platform admins define upstreams
    finally:
        model.shutdown()
        store.close()


def test_a_rotated_credential_reaches_the_running_model(front: Front, live_server: str, admin_key: str) -> None:
    admin = bearer(front.admin)
    wrong = front.store.create_credential(None, "rotating", "not-the-upstream-key")
    body = {"name": "fleet-3", "upstream": {"endpoints": [f"{live_server}/v1"], "model": DEFAULT_MODEL_NAME,
                                            "credential": "rotating", "health_interval_seconds": 0}}
    assert httpx.post(f"{front.url}/admin/v1/models", headers=admin, json=body).status_code == 202
    assert wait_ready(front.url, admin, "fleet-3")["status"] == "ready"
    ask = {"model": "fleet-3", "messages": QUESTION, "max_tokens": 2}
    refused = httpx.post(f"{front.url}/v1/chat/completions", headers=admin, json=ask, timeout=30)
    assert refused.status_code == 503  # the upstream refuses our key: the operator's problem, not the client's
    assert "not-the-upstream-key" not in refused.text
    front.store.update_credential(None, wrong.id, secret=admin_key)
    deadline = time.monotonic() + 10
    while httpx.post(f"{front.url}/v1/chat/completions", headers=admin, json=ask, timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the rotated key was not taken up"
        time.sleep(0.2)
    assert httpx.delete(f"{front.url}/admin/v1/models/fleet-3", headers=admin).status_code == 204


def test_a_credential_a_model_uses_cannot_be_deleted(front: Front, live_server: str, admin_key: str) -> None:
    admin = bearer(front.admin)
    used = front.store.create_credential(None, "in-use", admin_key)
    body = {"name": "fleet-4", "upstream": {"endpoints": [f"{live_server}/v1"], "credential": "in-use"}}
    assert httpx.post(f"{front.url}/admin/v1/models", headers=admin, json=body).status_code == 202
    assert wait_ready(front.url, admin, "fleet-4")["status"] == "ready"
    refused = httpx.delete(f"{front.url}/admin/v1/credentials/{used.id}", headers=admin)
    assert refused.status_code == 409 and "fleet-4" in error_of(refused)["message"]
    assert httpx.delete(f"{front.url}/admin/v1/models/fleet-4", headers=admin).status_code == 204
    assert httpx.delete(f"{front.url}/admin/v1/credentials/{used.id}", headers=admin).status_code == 204


def test_hostile_upstream_sections_get_a_clear_answer_never_a_500(app_for_model: Any, tmp_path: Path,
                                                                    live_server: str, admin_key: str) -> None:
    """Arbitrary JSON where the admin API expects an upstream section: 202 or a 4xx naming it, never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from starlette.testclient import TestClient

    scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                                  max_size=4), max_leaves=12)  # fmt: skip
    urls = st.sampled_from(["http://upstream.invalid/v1", "https://upstream.invalid:8443/v1", "http://elsewhere/v1",
                            "http://upstream.invalid/v1?x=1", "upstream.invalid", "", "http://[::1/v1"])  # fmt: skip
    fields = st.fixed_dictionaries({}, optional={
        "endpoints": st.lists(urls, max_size=3) | values, "model": values | st.text(max_size=300),
        "credential": values, "api_key_env": values | st.text(max_size=10), "timeout_seconds": values,
        "max_inflight_per_endpoint": values, "retries": values, "routing": values, "context_length": values,
        "ca_file": values,
    })  # fmt: skip
    model = remote_model(f"{live_server}/v1", admin_key)
    store = PolicyStore.open(StoreSettings(), tmp_path)
    key = bearer(str(store.ensure_bootstrap_admin()))
    app = app_for_model(model, store, data_dir=str(tmp_path / "app"), upstreams={"allowed_hosts": ["upstream.invalid"]})
    names = iter(range(10**6))
    try:
        with TestClient(app) as client:

            @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
            @given(upstream=fields | values)
            def probe(upstream: Any) -> None:
                name = f"h{next(names)}"
                response = client.post("/admin/v1/models", headers=key, json={"name": name, "upstream": upstream})
                assert response.status_code in (202, 400, 409, 422), response.text
                if response.status_code == 202:
                    assert isinstance(upstream, dict) and upstream["endpoints"]  # only a valid section loads
                    while client.get(f"/admin/v1/models/{name}", headers=key).json()["status"] == "loading":
                        time.sleep(0.01)
                    assert client.delete(f"/admin/v1/models/{name}", headers=key).status_code == 204
                else:
                    assert error_of(response)["message"]

            probe()
    finally:
        model.shutdown()
        store.close()
