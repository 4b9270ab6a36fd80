"""Upstream settings are least-privilege, wherever they enter: the admin API (over a real socket), a model
record loaded from the store, the settings file. A model cannot be handed the gateway's own secrets, aimed
at a metadata service, a private address nobody allowed or the gateway itself, trust a CA file outside
``upstreams.ca_dir``, or name a key that does not exist."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_upstream import FakeUpstream, running_fake_upstream
from http_helpers import bearer, error_of
from servers import free_loopback_socket, start_uvicorn, stop_uvicorn
from upstream_rules import LOOPBACK_UPSTREAMS

from inferflux.backends.base import BackendError
from inferflux.gateway.models.admin import ModelAdmin
from inferflux.gateway.models.served import ModelManager
from inferflux.gateway.settings import Settings
from inferflux.gateway.models.upstreams import upstream_key
from inferflux.policy.store import PolicyStore, StoreSettings

BOOTSTRAP = "INFERFLUX_BOOTSTRAP_ADMIN_KEY"
POLL = 0.05
ASK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass
class Gateway:
    url: str
    store: PolicyStore
    admin: dict[str, str]
    member: dict[str, str]

    def define(self, name: str, **upstream: Any) -> httpx.Response:
        return httpx.post(f"{self.url}/admin/v1/models", headers=self.admin, json={"name": name, "upstream": upstream})

    def status(self, name: str) -> dict[str, Any]:
        """The model's status once it is no longer loading."""
        deadline = time.monotonic() + 30
        while True:
            answer = httpx.get(f"{self.url}/admin/v1/models/{name}", headers=self.admin).json()
            if answer.get("status") not in ("loading", None) or time.monotonic() > deadline:
                return answer
            time.sleep(POLL)


@pytest.fixture
def serve(fleet_model: Any, app_for_model: Any, tmp_path: Path) -> Iterator[Any]:
    """``serve(sock=None, **settings)``: a gateway over a real socket with a platform admin and a member."""
    started: list[tuple[Any, Any, Any, PolicyStore]] = []

    def start(sock: Any = None, **settings: Any) -> Gateway:
        store = PolicyStore.open(StoreSettings(), tmp_path / f"store{len(started)}")
        admin = str(store.ensure_bootstrap_admin())
        member = store.create_api_key(store.create_tenant("t").id, "m", "member")[1]
        settings = {"model_registry": {"poll_seconds": POLL}, **settings}
        app = app_for_model(fleet_model, store, data_dir=str(tmp_path / f"app{len(started)}"), **settings)
        server, thread, sock, url = start_uvicorn(app, sock)
        started.append((server, thread, sock, store))
        return Gateway(url, store, bearer(admin), bearer(member))

    yield start
    for server, thread, sock, store in started:
        stop_uvicorn(server, thread, sock)
        store.close()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeUpstream]:
    with running_fake_upstream("rules") as served:
        yield served


def refused(answer: httpx.Response, param: str, rule: str) -> str:
    assert answer.status_code == 422, answer.text
    error = error_of(answer)
    assert error["param"] == param and rule in error["message"], error
    return str(error["message"])


# -- the key's variable ------------------------------------------------------------------------------------------


def test_no_model_is_ever_given_the_bootstrap_admin_key(serve: Any, fake: FakeUpstream, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Through the admin API (422), a record already in the store (not loaded, at start or when followed),
    the settings file (refused) and the key lookup itself: the variable is never read for an upstream."""
    secret = "ifx-bootstrap-secret-" + "x" * 20
    monkeypatch.setenv(BOOTSTRAP, secret)
    gateway = serve(upstreams=LOOPBACK_UPSTREAMS)
    fake.reset_counters()
    message = refused(gateway.define("leak", endpoints=[fake.url], api_key_env=BOOTSTRAP), "upstream.api_key_env",
                      "must start with 'INFERFLUX_UPSTREAM_'")  # fmt: skip
    assert secret not in message

    # As an older gateway could have stored it: followed from the registry, it fails instead of loading.
    gateway.store.create_served_model("stored-leak", "", backend="openai", dtype="upstream",
                                      upstream={"endpoints": [fake.url], "api_key_env": BOOTSTRAP})  # fmt: skip
    status = gateway.status("stored-leak")
    assert status["status"] == "failed" and "api_key_env" in status["error"], status
    chat = httpx.post(f"{gateway.url}/v1/chat/completions", headers=gateway.member, json={"model": "stored-leak", **ASK})
    assert chat.status_code == 404, chat.text
    assert fake.requests["chat"] == 0 and not any(secret in str(h) for h in fake.headers)

    # At start (inferctl serve's restore): the record is not loaded either.
    settings = Settings(data_dir=tmp_path, upstreams=LOOPBACK_UPSTREAMS)
    assert ModelAdmin(ModelManager(expected=[]), gateway.store, settings, set()).restore() == ["stored-leak"]
    with pytest.raises(BackendError, match="api_key_env"):
        upstream_key(gateway.store, {"endpoints": [fake.url], "api_key_env": BOOTSTRAP}, settings)
    with pytest.raises(ValueError, match="api_key_env: must start with"):
        Settings(upstreams=LOOPBACK_UPSTREAMS,
                 models=[{"name": "m", "upstream": {"endpoints": [fake.url], "api_key_env": BOOTSTRAP}}])  # fmt: skip


def test_the_prefix_cannot_be_widened_over_the_gateways_own_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for prefix in ("INFERFLUX_", "INFERFLUX_B", "I", "INFERFLUX_STORE_"):
        with pytest.raises(ValueError, match="the gateway's own"):
            Settings(upstreams={"api_key_env_prefix": prefix})
    sink = {"type": "http", "url": "https://siem.example/ingest", "token_env": "FLEET_SIEM_TOKEN"}
    with pytest.raises(ValueError, match="a secret of the gateway's own"):  # an audit sink's token, under the prefix
        Settings(upstreams={"api_key_env_prefix": "FLEET_", "allowed_hosts": ["10.0.0.5"]}, audit={"sinks": [sink]},
                 models=[{"name": "m", "upstream": {"endpoints": ["http://10.0.0.5/v1"], "api_key_env": "FLEET_SIEM_TOKEN"}}])  # fmt: skip


# -- hosts -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "rule"), [
    ("http://169.254.169.254/latest", "metadata"),
    ("http://169.254.10.10:8000/v1", "link-local"),
    ("http://[fd00:ec2::254]/v1", "metadata"),
    ("http://[fe80::1]:8000/v1", "link-local"),
    ("http://metadata.google.internal/computeMetadata/v1", "metadata service"),
    ("http://[::ffff:169.254.169.254]/v1", "metadata"),
    ("http://0.0.0.0:8000/v1", "non-unicast"),
    ("http://10.0.0.5:8000/v1", "private address"),
    ("http://172.16.0.1/v1", "private address"),
    ("http://192.168.1.10/v1", "private address"),
    ("http://127.0.0.1:8000/v1", "private address"),
    ("http://localhost:8000/v1", "private address"),
    ("http://[::1]:8000/v1", "private address"),
    ("http://[fd12:3456::1]/v1", "private address"),
])  # fmt: skip
def test_each_refused_host_kind_is_a_422_naming_the_rule(serve: Any, endpoint: str, rule: str) -> None:
    gateway = serve()  # no upstreams.allowed_hosts
    refused(gateway.define("far", endpoints=[endpoint]), "upstream.endpoints", rule)
    assert httpx.get(f"{gateway.url}/admin/v1/models/far", headers=gateway.admin).status_code == 404


def test_the_gateways_own_port_is_refused_even_when_loopback_is_allowed(serve: Any) -> None:
    sock = free_loopback_socket()
    port = sock.getsockname()[1]
    gateway = serve(sock, port=port, upstreams=LOOPBACK_UPSTREAMS)
    for host in ("127.0.0.1", "localhost", "[::1]"):
        refused(gateway.define("self", endpoints=[f"http://{host}:{port}/v1"]), "upstream.endpoints",
                f"own address and port {port}")  # fmt: skip


def test_the_allow_list_lets_through_what_it_names_and_nothing_else(serve: Any, fake: FakeUpstream) -> None:
    gateway = serve(upstreams={"allowed_hosts": ["127.0.0.0/8", "*.fleet.internal", "169.254.0.0/16"]})
    fake.reset_counters()
    assert gateway.define("near", endpoints=[fake.url], health_interval_seconds=0).status_code == 202
    assert gateway.status("near")["status"] == "ready"
    chat = httpx.post(f"{gateway.url}/v1/chat/completions", headers=gateway.member, json={"model": "near", **ASK})
    assert chat.status_code == 200 and fake.requests["chat"] == 1, chat.text
    assert gateway.define("named", endpoints=["http://gpu-1.fleet.internal:8000/v1"],
                          health_interval_seconds=0).status_code == 202  # fmt: skip
    refused(gateway.define("other", endpoints=["http://10.0.0.5/v1"]), "upstream.endpoints", "not in upstreams.allowed_hosts")
    refused(gateway.define("bare", endpoints=["http://fleet.internal/v1"]), "upstream.endpoints", "not in upstreams")
    # A range does not unlock a metadata address: only the address itself would.
    refused(gateway.define("meta", endpoints=["http://169.254.169.254/v1"]), "upstream.endpoints", "metadata")
    assert serve(upstreams={"allowed_hosts": ["169.254.169.254"]}).define(
        "meta", endpoints=["http://169.254.169.254/v1"], health_interval_seconds=0).status_code == 202


def test_bad_allow_list_entries_are_refused() -> None:
    for entry in ("http://10.0.0.5", "10.0.0.0/40", "*.", "a b"):
        with pytest.raises(ValueError, match="is not a host name"):
            Settings(upstreams={"allowed_hosts": [entry]})


# -- the CA file -------------------------------------------------------------------------------------------------


def test_a_ca_file_outside_ca_dir_is_refused_alike_whether_it_exists_or_not(serve: Any, tmp_path: Path) -> None:
    ca_dir = tmp_path / "ca"
    ca_dir.mkdir()
    (ca_dir / "escape.pem").symlink_to("/etc/passwd")
    (tmp_path / "outside.pem").write_text("not a CA")
    gateway = serve(upstreams={**LOOPBACK_UPSTREAMS, "ca_dir": str(ca_dir)})
    endpoint = "https://127.0.0.1:8443/v1"
    messages = {refused(gateway.define("ca", endpoints=[endpoint], ca_file=path), "upstream.ca_file", "upstreams.ca_dir")
                for path in ("/etc/passwd", "/etc/no-such-file.pem", str(tmp_path / "outside.pem"),
                             str(ca_dir / ".." / "outside.pem"), str(ca_dir / "escape.pem"), "relative.pem",
                             str(ca_dir))}  # fmt: skip
    assert len(messages) == 1, messages  # one answer: nothing learnt about what exists outside the directory
    inside = gateway.define("ca", endpoints=[endpoint], ca_file=str(ca_dir / "fleet.pem"), health_interval_seconds=0)
    assert inside.status_code == 202, inside.text  # under the directory: up to the operator (it fails to load)
    assert gateway.status("ca")["status"] == "failed"
    no_dir = serve(upstreams=LOOPBACK_UPSTREAMS)
    refused(no_dir.define("ca", endpoints=[endpoint], ca_file=str(ca_dir / "fleet.pem")), "upstream.ca_file",
            "which is not set")  # fmt: skip


# -- the key must exist ------------------------------------------------------------------------------------------


def test_a_missing_credential_or_variable_is_a_422_when_the_model_is_defined(
    serve: Any, fake: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway = serve(upstreams=LOOPBACK_UPSTREAMS)
    refused(gateway.define("keyless", endpoints=[fake.url], credential="no-such-credential"), "upstream.credential",
            "no stored credential is named 'no-such-credential'")  # fmt: skip
    variable = "INFERFLUX_UPSTREAM_RULES_TEST_KEY"
    monkeypatch.delenv(variable, raising=False)
    refused(gateway.define("keyless", endpoints=[fake.url], api_key_env=variable), "upstream.api_key_env",
            f"{variable} is not set")  # fmt: skip
    assert httpx.get(f"{gateway.url}/admin/v1/models/keyless", headers=gateway.admin).status_code == 404
    monkeypatch.setenv(variable, "upstream-key-from-env")
    gateway.store.create_credential(None, "fleet-key", "upstream-key-from-store")
    fake.reset_counters()
    for name, source in (("by-env", {"api_key_env": variable}), ("by-store", {"credential": "fleet-key"})):
        assert gateway.define(name, endpoints=[fake.url], health_interval_seconds=0, **source).status_code == 202
        assert gateway.status(name)["status"] == "ready"
        chat = httpx.post(f"{gateway.url}/v1/chat/completions", headers=gateway.member, json={"model": name, **ASK})
        assert chat.status_code == 200, chat.text
    sent = [h.get("authorization") for h in fake.headers]
    assert sent == ["Bearer upstream-key-from-env", "Bearer upstream-key-from-store"]

