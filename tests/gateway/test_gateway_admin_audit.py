"""The admin API's audit trail (issue 4): admin actions on the hash chain, queries, the live tail.

* every admin change is an event on the tamper-evident trail, durable before
  the answer, and the app's spool verifies with ``policy.audit.verify_spool``;
* ``/admin/v1/audit`` and ``/admin/v1/tenants/{id}/audit`` filter, paginate and
  keep a tenant admin inside its tenant; bad values are 422s naming them;
* ``/admin/v1/audit/stream`` over a real socket delivers an event caused after
  subscribing, only within the subscriber's scope, and lets go of the
  subscription when the client leaves.

The query endpoints read an index that a spool sink fills a moment after each
event is durable, so the tests poll it (``audit_wait``), with a bound.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from inferflux.policy.audit import api_event, verify_spool
from admin_seed import Seeded, seeded_app
from audit_wait import eventually, indexed_events, wait_indexed
from http_helpers import error_of
from servers import start_uvicorn, stop_uvicorn


@dataclass
class World(Seeded):
    app: Any
    client: TestClient
    spool_dir: Path

    def record(self, **fields: Any) -> str:
        """Put an API-call event on the app's trail directly (as the audit middleware would); its id."""
        event = api_event(**fields)
        self.client.portal.call(self.app.state.audit_trail.record, event)
        return event.id


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    data_dir: Path = tmp_path_factory.mktemp("admin-audit")
    with seeded_app(make_app, data_dir) as (seeded, app, client):
        yield World(**seeded.seeded(), app=app, client=client, spool_dir=data_dir / "app" / "audit")


def pages(client: TestClient, url: str, headers: dict[str, str], params: dict[str, Any], limit: int) -> list[Any]:
    """Every item of a list walked ``limit`` at a time."""
    items: list[Any] = []
    after = None
    while True:
        page = client.get(url, params={**params, "limit": limit, **({"after": after} if after else {})},
                          headers=headers)  # fmt: skip
        assert page.status_code == 200, page.text
        items += page.json()["data"]
        after = page.json()["next_cursor"]
        if after is None:
            return items


# -- admin actions on the trail --------------------------------------------------------------------


def test_admin_actions_are_on_the_trail_and_the_chain_verifies(world: World) -> None:
    client, store, acme = world.client, world.store, world.acme
    t = f"/admin/v1/tenants/{acme.id}"
    created = client.post(f"{t}/keys", json={"name": "audited", "role": "viewer"}, headers=world.acme_admin)
    revoked = client.post(f"{t}/keys/{created.json()['id']}/revoke", headers=world.acme_admin)
    quota = {"kind": "quota", "name": "q", "spec": {"period": "day", "tokens": 10**9}}
    policy = client.post(f"{t}/policies", json=quota, headers=world.admin)
    provider = client.post("/admin/v1/oidc-providers", json={"name": "audited", "issuer": "https://audited.example.com",
                                                              "audience": "a"}, headers=world.admin)  # fmt: skip
    responses = [created, revoked, policy, provider]
    assert [r.status_code for r in responses] == [201, 200, 201, 201]

    # Durable before the answer: already in the spool when the response came, whatever the index says.
    report = verify_spool(world.spool_dir)
    assert report.ok, report.problem
    assert report.records >= 4

    request_ids = [r.headers["x-request-id"] for r in responses]
    # Each request's change event, not just its attempt (indexed first): the index is written asynchronously.
    events = wait_indexed(world.app, lambda es: set(request_ids) <= {e["request_id"] for e in es
                                                                     if e["action"] != "attempt"})
    ours = sorted((e for e in events if e["request_id"] in request_ids and e["action"] != "attempt"),
                  key=lambda e: request_ids.index(e["request_id"]))  # fmt: skip
    # Each change's attempt went on the trail before the change (gateway.audit.record_attempt).
    attempts = [e for e in events if e["request_id"] in request_ids and e["action"] == "attempt"]
    assert sorted(e["request_id"] for e in attempts) == sorted(request_ids)
    assert [e["principal"] for e in sorted(attempts, key=lambda e: request_ids.index(e["request_id"]))] == [
        world.acme_admin_subject, world.acme_admin_subject, world.admin_subject, world.admin_subject]
    assert [(e["action"], e["tenant_id"], e["principal"], e["target_id"]) for e in ours] == [
        ("key.create", acme.id, world.acme_admin_subject, created.json()["id"]),
        ("key.revoke", acme.id, world.acme_admin_subject, created.json()["id"]),
        ("policy.create", acme.id, world.admin_subject, policy.json()["id"]),
        ("oidc_provider.create", None, world.admin_subject, provider.json()["id"]),
    ]
    assert all(e["kind"] == "admin" and e["decision"] == "allow" for e in ours)
    assert ours[0]["route"] == "POST /admin/v1/tenants/{tenant_id}/keys"
    assert ours[2]["detail"]["spec"] == {"period": "day", "tokens": 10**9}
    assert created.json()["key"] not in json.dumps(ours)
    # The trail replaced the old admin_events table: nothing is written there any more.
    assert store.list_admin_events(None, limit=200).items == ()

    # The API's items carry their place in the chain, and consecutive ones link up.
    listed = client.get("/admin/v1/audit", params={"limit": 200}, headers=world.admin).json()["data"]
    by_seq = {item["seq"]: item for item in listed}
    linked = [(by_seq[s - 1]["hash"], item["prev"]) for s, item in by_seq.items() if s - 1 in by_seq]
    assert linked and all(previous == prev for previous, prev in linked)
    assert {item["chain"] for item in listed} == {report.chains[0].chain}


def test_a_changed_spool_line_is_detected(world: World, tmp_path: Path) -> None:
    # The check the tests above rely on can fail: a copy of the spool with one event edited does not verify.
    import shutil

    copy = tmp_path / "spool"
    shutil.copytree(world.spool_dir, copy, ignore=shutil.ignore_patterns("*.lock", "lock"))
    segment = max((p for p in (copy / "segments").iterdir() if p.stat().st_size), key=lambda p: p.name)
    lines = segment.read_bytes().splitlines(keepends=True)
    lines[0] = lines[0].replace(b'"decision":"allow"', b'"decision":"deny"', 1)
    segment.write_bytes(b"".join(lines))
    assert not verify_spool(copy).ok


# -- queries -------------------------------------------------------------------------------------


def test_filters_and_pagination(world: World) -> None:
    client, acme, globex = world.client, world.acme, world.globex
    start = datetime.now(UTC)
    denied = [world.record(decision="deny", tenant_id=acme.id, principal="key:filtered", reasons=("rate_limited",),
                           route="POST /v1/chat/completions", status=429) for _ in range(3)]  # fmt: skip
    allowed = [world.record(decision="allow", tenant_id=acme.id, principal="key:other", status=200) for _ in range(2)]
    theirs = world.record(decision="deny", tenant_id=globex.id, principal="key:filtered", status=403)
    middle = datetime.now(UTC)
    late = world.record(decision="error", tenant_id=acme.id, principal="key:filtered", status=500)
    wait_indexed(world.app, lambda es: late in {e["id"] for e in es})

    def ids(url: str, headers: dict[str, str], **params: Any) -> list[str]:
        path, _, tenant = url.partition("?tenant_id=")  # httpx's params replace a query in the URL
        params = {"limit": 200, "since": start.isoformat(), **({"tenant_id": tenant} if tenant else {}), **params}
        response = client.get(path, params=params, headers=headers)
        assert response.status_code == 200, response.text
        assert all(item["object"] == "audit_event" for item in response.json()["data"])
        return [item["id"] for item in response.json()["data"]]

    acme_url = f"/admin/v1/tenants/{acme.id}/audit"
    for url, headers in ((acme_url, world.acme_admin), ("/admin/v1/audit", world.acme_admin),
                         (acme_url, world.admin), ("/admin/v1/audit?tenant_id=" + acme.id, world.admin)):
        assert ids(url, headers) == [*denied, *allowed, late], url
        assert ids(url, headers, decision="deny") == denied
        assert ids(url, headers, principal="key:filtered") == [*denied, late]
        assert ids(url, headers, principal="key:filtered", decision="error") == [late]
        assert ids(url, headers, kind="api", until=middle.isoformat()) == [*denied, *allowed]
        assert ids(url, headers, kind="admin") == []
        assert ids(url, headers, since=middle.isoformat().replace("+00:00", "Z")) == [late]
    # A platform admin without tenant_id sees every tenant's.
    assert ids("/admin/v1/audit", world.admin, principal="key:filtered") == [*denied, theirs, late]
    # Pages of any size give the same events, in the same order.
    whole = ids("/admin/v1/audit", world.admin)
    for limit in (1, 2, 5):
        walked = pages(client, "/admin/v1/audit", world.admin, {"since": start.isoformat()}, limit)
        assert [item["id"] for item in walked] == whole


def test_a_tenant_admin_sees_only_its_tenant(world: World) -> None:
    client, acme, globex = world.client, world.acme, world.globex
    ours = world.record(decision="allow", tenant_id=acme.id, principal="key:scoped")
    theirs = world.record(decision="allow", tenant_id=globex.id, principal="key:scoped")
    platform = client.post("/admin/v1/tenants", json={"name": "scoped-new"}, headers=world.admin)
    deleted = client.delete(f"/admin/v1/tenants/{platform.json()['id']}", headers=world.admin)  # tenant None
    assert deleted.status_code == 204
    wait_indexed(world.app, lambda es: deleted.headers["x-request-id"] in {e["request_id"] for e in es
                                                                            if e["action"] != "attempt"})

    def seen(headers: dict[str, str], url: str = "/admin/v1/audit") -> set[str]:
        return {item["id"] for item in pages(client, url, headers, {}, 200)}

    acme_sees, globex_sees, admin_sees = seen(world.acme_admin), seen(world.globex_admin), seen(world.admin)
    assert ours in acme_sees and theirs not in acme_sees
    assert theirs in globex_sees and ours not in globex_sees
    assert {ours, theirs} <= admin_sees
    deletion = [e["id"] for e in indexed_events(world.app)
                if e["request_id"] == deleted.headers["x-request-id"] and e["action"] != "attempt"]
    assert deletion and deletion[0] in admin_sees and deletion[0] not in acme_sees | globex_sees
    # Another tenant, named: 404 as everywhere else, by either route.
    for url in (f"/admin/v1/audit?tenant_id={globex.id}", f"/admin/v1/tenants/{globex.id}/audit",
                f"/admin/v1/audit/stream?tenant_id={globex.id}"):
        response = client.get(url, headers=world.acme_admin)
        assert response.status_code == 404 and error_of(response)["code"] == "not_found", url


@pytest.mark.parametrize(
    "params,param",
    [
        ({"since": "yesterday"}, "since"),
        ({"since": "2026-01-01"}, "since"),
        ({"since": "2026-01-01T00:00:00"}, "since"),  # no time zone
        ({"until": "2026-13-01T00:00:00Z"}, "until"),
        ({"until": "x" * 5000}, "until"),
        ({"since": "2026-02-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, "until"),
        ({"decision": "maybe"}, "decision"),
        ({"kind": "everything"}, "kind"),
        ({"principal": "p" * 300}, "principal"),
        ({"tenant": "x"}, "tenant"),  # a misspelt filter would widen the answer
        ({"limit": "0"}, "limit"),
        ({"after": "garbage"}, "after"),
    ],
)
def test_bad_query_values_are_422(world: World, params: dict[str, str], param: str) -> None:
    for url in ("/admin/v1/audit", f"/admin/v1/tenants/{world.acme.id}/audit"):
        response = world.client.get(url, params=params, headers=world.acme_admin)
        assert response.status_code == 422, (url, response.text)
        error = error_of(response)
        assert error["param"] == param and error["code"] == "invalid_value", (url, error)


def test_rfc3339_variants_are_accepted(world: World) -> None:
    now = datetime.now(UTC)
    for value in (now.isoformat(), now.strftime("%Y-%m-%dT%H:%M:%SZ"), now.strftime("%Y-%m-%dt%H:%M:%S.%fz"),
                  (now + timedelta(hours=2)).astimezone().isoformat()):
        response = world.client.get("/admin/v1/audit", params={"since": value}, headers=world.acme_admin)
        assert response.status_code == 200, (value, response.text)


def test_openapi_documents_every_query_parameter_the_audit_routes_take(world: World) -> None:
    doc = world.client.get("/openapi.json", headers=world.admin).json()
    filters = {"since", "until", "principal", "decision", "kind", "limit", "after"}
    expected = {
        "/admin/v1/tenants/{tenant_id}/audit": filters,
        "/admin/v1/audit": filters | {"tenant_id"},
        "/admin/v1/audit/stream": {"tenant_id", "max_seconds"},
    }
    for path, names in expected.items():
        documented = {p["name"] for p in doc["paths"][path]["get"]["parameters"] if p["in"] == "query"}
        assert documented == names, path
        # and each documented one is accepted: no 422 naming it as unknown (a stream that
        # does open is bounded by max_seconds, so the check cannot hang)
        for name in names:
            params = {"max_seconds": "0.1"} if path.endswith("/stream") else {}
            params[name] = "x"
            response = world.client.get(path.replace("{tenant_id}", world.acme.id), params=params,
                                        headers=world.admin)  # fmt: skip
            assert "unknown query parameter" not in response.text, (path, name)


@pytest.mark.parametrize("value", ["0", "-1", "x", "86401", "1e3", ""])
def test_bad_stream_parameters_are_422(world: World, value: str) -> None:
    response = world.client.get("/admin/v1/audit/stream", params={"max_seconds": value}, headers=world.acme_admin)
    assert response.status_code == 422 and error_of(response)["param"] == "max_seconds", response.text
    assert world.app.state.audit_trail.tail.subscribers == 0


# -- the live tail, over a real socket --------------------------------------------------------------


@pytest.fixture(scope="module")
def live(world: World, make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    """A second replica of the world's gateway (its own spool) on a loopback port: (app, base URL)."""
    app = make_app(world.store, data_dir=tmp_path_factory.mktemp("audit-live"))
    server, thread, sock, url = start_uvicorn(app)
    try:
        yield app, url
    finally:
        stop_uvicorn(server, thread, sock)


def read_events(lines: Iterator[str], until: Any, limit: int = 50) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of the SSE events read from ``lines`` until one satisfies ``until``."""
    out: list[tuple[str, dict[str, Any]]] = []
    name, data = "", ""
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
        elif line == "" and data:
            out.append((name, json.loads(data)))
            name, data = "", ""
            if until(out[-1][1]) or len(out) >= limit:
                return out
    raise AssertionError(f"the stream ended before the event came: {out}")


@pytest.mark.parametrize("who", ["tenant-admin", "platform-admin"])
def test_the_stream_delivers_events_caused_after_subscribing(world: World, live: tuple[Any, str], who: str) -> None:
    app, base = live
    acme, globex = world.acme, world.globex
    headers = world.acme_admin if who == "tenant-admin" else world.admin
    with httpx.Client(base_url=base, timeout=20) as actor, httpx.stream(
        "GET", f"{base}/admin/v1/audit/stream", headers=headers, timeout=20
    ) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        assert next(lines) == ": subscribed"  # from here on, every event in scope reaches us
        theirs = actor.post(f"/admin/v1/tenants/{globex.id}/keys", json={"name": "sse", "role": "viewer"},
                            headers=world.globex_admin)  # fmt: skip
        ours = actor.post(f"/admin/v1/tenants/{acme.id}/keys", json={"name": "sse", "role": "viewer"},
                          headers=world.acme_admin)  # fmt: skip
        assert theirs.status_code == ours.status_code == 201
        got = read_events(lines, lambda record: record["event"]["target_id"] == ours.json()["id"])
    attempts = [record["event"] for _, record in got if record["event"]["action"] == "attempt"]
    if who == "tenant-admin":  # globex's admin's attempt, like its change, is not in acme's scope
        assert [e["tenant_id"] for e in attempts] == [acme.id], attempts
    got = [(name, record) for name, record in got if record["event"]["action"] != "attempt"]
    names = {name for name, _ in got}
    assert names == {"audit"}
    targets = [record["event"]["target_id"] for _, record in got]
    if who == "tenant-admin":
        assert targets == [ours.json()["id"]]  # globex's event, though earlier, is not in its scope
    else:
        assert targets[-2:] == [theirs.json()["id"], ours.json()["id"]]
    record = got[-1][1]
    assert record["event"]["action"] == "key.create" and record["event"]["tenant_id"] == acme.id
    assert record["hash"] and record["prev"] and isinstance(record["seq"], int)
    # The client left: the subscription is let go of.
    eventually(lambda: app.state.audit_trail.tail.subscribers, lambda n: n == 0, timeout=10, what="unsubscribe")


def test_a_bounded_stream_ends_by_itself(world: World, live: tuple[Any, str]) -> None:
    app, base = live
    response = httpx.get(f"{base}/admin/v1/audit/stream", params={"max_seconds": "0.2"}, headers=world.acme_admin,
                         timeout=20)  # fmt: skip
    assert response.status_code == 200 and response.text == ": subscribed\n\n"
    eventually(lambda: app.state.audit_trail.tail.subscribers, lambda n: n == 0, timeout=10, what="unsubscribe")


def test_an_idle_stream_sends_heartbeats(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    from inferflux.gateway.routes.admin import audit as admin_audit

    monkeypatch.setattr(admin_audit, "HEARTBEAT_SECONDS", 0.05)
    response = world.client.get("/admin/v1/audit/stream", params={"max_seconds": "0.5"}, headers=world.acme_admin)
    assert response.status_code == 200
    beats = response.text.split("\n\n")
    assert beats[0] == ": subscribed" and beats.count(": keep-alive") >= 3, response.text
    assert "event:" not in response.text  # nothing of acme happened meanwhile


def test_a_change_the_trail_cannot_record_is_refused_before_it_is_made(
    world: World, make_app: Any, tmp_path: Path
) -> None:
    # A change and its audit event are one unit: while the spool cannot take the event the
    # change is refused up front (gateway/gate.py), so no key exists that nobody audited.
    app = make_app(world.store, data_dir=tmp_path)
    with TestClient(app) as client:
        app.state.audit_trail.spool.close()  # as if its disk had failed
        response = client.post(f"/admin/v1/tenants/{world.acme.id}/keys", json={"name": "unaudited", "role": "viewer"},
                               headers=world.acme_admin)  # fmt: skip
        assert response.status_code == 503, response.text
        assert error_of(response)["code"] == "audit_unavailable"
        assert response.headers["retry-after"]
    assert not any(k.name == "unaudited" for k in world.store.list_api_keys(world.acme.id, limit=200).items)


def spooled_events(data_dir: Path) -> list[dict[str, Any]]:
    """Every event in the spool segments under ``data_dir`` (the audit trail's own files)."""
    events = []
    for path in sorted(data_dir.rglob("*")):
        if path.is_file() and path.suffix in (".log", ".jsonl", ""):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("{") and '"event"' in line:
                    events.append(json.loads(line)["event"])
    return events


def test_a_change_the_trail_fails_to_record_afterwards_still_has_its_attempt_on_record(
    world: World, make_app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The spool's disk fails between the change and its event (injected at the store call):
    # the change is made, and the attempt written before it names the caller and the request.
    app = make_app(world.store, data_dir=tmp_path)
    create = world.store.create_api_key

    def create_then_the_disk_fails(*args: Any, **kwargs: Any) -> Any:
        made = create(*args, **kwargs)
        app.state.audit_trail.spool.close()
        return made

    monkeypatch.setattr(world.store, "create_api_key", create_then_the_disk_fails)
    with TestClient(app) as client:
        response = client.post(f"/admin/v1/tenants/{world.acme.id}/keys", json={"name": "half", "role": "viewer"},
                               headers=world.acme_admin)  # fmt: skip
    assert response.status_code == 503, response.text
    assert "attempt is on the audit trail" in error_of(response)["message"]
    assert any(k.name == "half" for k in world.store.list_api_keys(world.acme.id, limit=200).items)
    request_id = response.headers["x-request-id"]
    attempts = [e for e in spooled_events(tmp_path) if e.get("action") == "attempt" and e.get("request_id") == request_id]
    assert len(attempts) == 1, spooled_events(tmp_path)
    assert attempts[0]["principal"] == world.acme_admin_subject
    assert attempts[0]["route"] == "POST /admin/v1/tenants/{tenant_id}/keys"
