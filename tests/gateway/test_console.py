"""The web console over HTTP (no browser): it answers as the API would, and its sessions, CSRF and headers hold.

The browser test is test_console_browser.py; OIDC sign-in is test_console_oidc.py.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from admin_seed import Seeded, seed_store
from console_support import CSRF, console_app, key_of, sibling, sign_in
from http_helpers import error_of

from inferflux.gateway.console.security import CSP


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Seeded, Any]]:
    data_dir: Path = tmp_path_factory.mktemp("console")
    seeded = seed_store(data_dir)
    app = console_app(seeded.store, data_dir / "app")
    try:
        with TestClient(app) as main:  # one lifespan (audit trail, authenticator) for the module
            yield seeded, main
    finally:
        seeded.store.close()


def client_of(main: TestClient, base_url: str = "http://testserver") -> TestClient:
    return sibling(main, base_url)


def test_unauthenticated_pages_redirect_and_data_answers_as_the_api(world: tuple[Seeded, Any]) -> None:
    seeded, app = world
    client = client_of(app)
    page = client.get(f"/console/tenants/{seeded.acme.id}/keys", follow_redirects=False)
    assert page.status_code == 303
    assert page.headers["location"] == f"/console/login?next=/console/tenants/{seeded.acme.id}/keys"
    api = client.get(f"/admin/v1/tenants/{seeded.acme.id}/keys")
    data = client.get(f"/console/api/tenants/{seeded.acme.id}/keys")
    assert api.status_code == data.status_code == 401
    assert error_of(data)["code"] == error_of(api)["code"] == "missing_credentials"
    assert error_of(data)["type"] == error_of(api)["type"]
    before = len(seeded.store.list_api_keys(seeded.acme.id).items)
    form = client.post(f"/console/tenants/{seeded.acme.id}/keys", data={"csrf": "x", "name": "n", "role": "member"})
    assert form.status_code == 401 and error_of(form)["code"] == "missing_credentials"
    live = client.get("/console/live/events")
    assert live.status_code == 401
    assert len(seeded.store.list_api_keys(seeded.acme.id).items) == before
    # A wrong key on the sign-in form: the API's 401 and message, on the form.
    token = CSRF.search(client.get("/console/login").text).group(1)  # type: ignore[union-attr]
    refused = client.post("/console/login", data={"csrf": token, "api_key": "ifx_" + "0" * 40})
    assert refused.status_code == 401 and "Invalid, expired or revoked API key" in refused.text


def test_cross_tenant_and_platform_routes_answer_as_the_api(world: tuple[Seeded, Any]) -> None:
    seeded, app = world
    client = client_of(app)
    sign_in(client, key_of(seeded.acme_admin))
    for path in (f"tenants/{seeded.globex.id}/keys", f"tenants/{seeded.globex.id}/audit", "tenants/ten_missing/keys",
                 "tenants", "models", f"tenants/{seeded.globex.id}/role-bindings"):
        api = client.get(f"/admin/v1/{path}", headers=seeded.acme_admin)
        data = client.get(f"/console/api/{path}")
        assert api.status_code == data.status_code == 404, (path, data.text)
        assert data.json() == api.json(), path
        page = client.get(f"/console/{path}")
        assert page.status_code == 404, path
        assert error_of(api)["message"] in page.text.replace("&#39;", "'"), path
    # A change aimed at another tenant: the API's 404, and nothing changed.
    csrf = CSRF.search(client.get("/console/").text).group(1)  # type: ignore[union-attr]
    before = len(seeded.store.list_api_keys(seeded.globex.id).items)
    posted = client.post(f"/console/tenants/{seeded.globex.id}/keys", data={"csrf": csrf, "name": "x", "role": "member"})
    assert posted.status_code == 404
    assert len(seeded.store.list_api_keys(seeded.globex.id).items) == before
    # Its own tenant: the page lists what the API lists.
    own = client.get(f"/admin/v1/tenants/{seeded.acme.id}/keys", headers=seeded.acme_admin).json()["data"]
    page = client.get(f"/console/tenants/{seeded.acme.id}/keys")
    assert page.status_code == 200
    assert page.text.count("<tr data-id=") == len(own) and all(k["prefix"] in page.text for k in own)


def test_forms_get_the_api_validation_and_a_new_key_is_shown_once(world: tuple[Seeded, Any]) -> None:
    seeded, app = world
    client = client_of(app)
    csrf = sign_in(client, key_of(seeded.acme_admin))
    keys = f"/console/tenants/{seeded.acme.id}/keys"
    for body in ({"name": "k", "role": "platform-admin"}, {"name": "k", "role": "nobody"},
                 {"name": "k", "role": "member", "expires_in_seconds": "5"}):
        api = client.post(f"/admin/v1/tenants/{seeded.acme.id}/keys", headers=seeded.acme_admin,
                          json={k: int(v) if k.startswith("expires") else v for k, v in body.items()})  # fmt: skip
        page = client.post(keys, data={"csrf": csrf, **body})
        assert page.status_code == api.status_code and api.status_code in (400, 403, 422), (body, page.text)
        assert error_of(api)["message"] in page.text.replace("&#39;", "'").replace("&#34;", '"'), body
    created = client.post(keys, data={"csrf": csrf, "name": "once", "role": "viewer"})
    assert created.status_code == 200 and 'id="new-key-value"' in created.text
    secret = created.text.split('id="new-key-value"')[0].rsplit('value="', 1)[1].split('"')[0]
    assert client.get("/admin/v1/whoami", headers={"authorization": f"Bearer {secret}"}).status_code == 200
    assert secret not in client.get(keys).text and 'id="new-key-value"' not in client.get(keys).text
    # An action's answer is the list page again, its forms posting where the list's do.
    platform_key = seeded.store.list_api_keys(seeded.store.get_tenant_by_name("platform").id).items[0]
    record = next(k for k in seeded.store.list_api_keys(seeded.acme.id).items if k.name == "once")
    rotated = client.post(f"{keys}/{record.id}/rotate", data={"csrf": csrf})
    assert rotated.status_code == 200 and 'id="new-key-value"' in rotated.text
    assert f'action="{keys}"' in rotated.text and f'action="{keys}/{record.id}/revoke"' in rotated.text
    refused = client.post(f"/console/tenants/{platform_key.tenant_id}/keys/{platform_key.id}/revoke", data={"csrf": csrf})
    assert refused.status_code == 404  # the platform tenant is not acme's admin's: the API's 404
    assert created.headers["cache-control"] == "no-store"


def test_csrf_is_required_and_bound_to_the_session(world: tuple[Seeded, Any]) -> None:
    seeded, app = world
    alice, bob = client_of(app), client_of(app)
    alice_csrf = sign_in(alice, key_of(seeded.acme_admin))
    bob_csrf = sign_in(bob, key_of(seeded.acme_admin))
    assert alice_csrf != bob_csrf
    keys = f"/console/tenants/{seeded.acme.id}/keys"
    before = len(seeded.store.list_api_keys(seeded.acme.id).items)
    for data, headers in (({}, {}), ({"csrf": bob_csrf}, {}), ({"csrf": alice_csrf}, {"origin": "https://evil.example"})):
        refused = alice.post(keys, data={"name": "n", "role": "member", **data}, headers=headers)
        assert refused.status_code == 403 and error_of(refused)["code"] == "csrf_failed", data
    assert alice.post(keys, data={"csrf": alice_csrf, "name": "n", "role": "member"},
                      headers={"origin": "http://testserver"}).status_code == 200  # fmt: skip
    assert len(seeded.store.list_api_keys(seeded.acme.id).items) == before + 1
    # Sign-in's double-submit token: a form without the cookie's token is refused.
    fresh = client_of(app)
    refused = fresh.post("/console/login", data={"csrf": "forged", "api_key": key_of(seeded.acme_admin)})
    assert refused.status_code == 403 and error_of(refused)["code"] == "csrf_failed"
    # Signing out needs the token too.
    assert alice.post("/console/logout", data={}).status_code == 403
    assert alice.post("/console/logout", data={"csrf": alice_csrf}, follow_redirects=False).status_code == 303
    assert alice.get("/console/", follow_redirects=False).status_code == 303


def test_security_headers_and_cookie_flags(world: tuple[Seeded, Any]) -> None:
    seeded, app = world
    client = client_of(app)
    sign_in(client, key_of(seeded.acme_admin))
    for path in ("/console/login", "/console/", f"/console/tenants/{seeded.globex.id}/keys", "/console/nowhere",
                 "/console/static/console.js", "/console/api/whoami"):
        headers = client.get(path).headers
        assert headers["content-security-policy"] == CSP, path
        assert headers["x-content-type-options"] == "nosniff" and headers["referrer-policy"] == "same-origin"
    for directive in ("default-src 'self'", "script-src 'self'", "style-src 'self'", "frame-ancestors 'none'",
                      "report-uri /console/csp-report"):
        assert directive in CSP
    assert "unsafe-inline" not in CSP and "unsafe-eval" not in CSP
    for base_url, secure in (("http://testserver", False), ("https://testserver", True)):
        fresh = client_of(app, base_url)
        token = CSRF.search(fresh.get("/console/login").text).group(1)  # type: ignore[union-attr]
        answer = fresh.post("/console/login", data={"csrf": token, "api_key": key_of(seeded.acme_admin)},
                            follow_redirects=False)  # fmt: skip
        cookie = next(c for c in answer.headers.get_list("set-cookie") if c.startswith("inferflux_console="))
        flags = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
        assert {"httponly", "path", "samesite", "max-age"} <= flags and "samesite=strict" in cookie.lower()
        assert ("secure" in flags) is secure, cookie
        value = cookie.split(";")[0].split("=", 1)[1]
        assert len(value) >= 40 and key_of(seeded.acme_admin) not in cookie


def test_a_revoked_key_ends_its_session_and_the_key_is_never_logged(
    world: tuple[Seeded, Any], caplog: pytest.LogCaptureFixture
) -> None:
    seeded, app = world
    record, key = seeded.store.create_api_key(seeded.acme.id, "short-lived", "tenant-admin")
    client = client_of(app)
    with caplog.at_level(logging.DEBUG):
        sign_in(client, key)
    assert key not in caplog.text
    assert client.get(f"/console/tenants/{seeded.acme.id}/keys").status_code == 200
    revoked = client.post(f"/admin/v1/tenants/{seeded.acme.id}/keys/{record.id}/revoke", headers=seeded.acme_admin)
    assert revoked.status_code == 200
    assert client.get(f"/console/tenants/{seeded.acme.id}/keys", follow_redirects=False).status_code == 303
    assert client.get("/console/api/whoami").status_code == 401


def test_csp_reports_are_recorded(world: tuple[Seeded, Any]) -> None:
    _, app = world
    client = client_of(app)
    before = _violations(client)
    report = {"csp-report": {"document-uri": "http://testserver/console/", "violated-directive": "script-src-elem",
                             "blocked-uri": "inline"}}  # fmt: skip
    answer = client.post("/console/csp-report", content=__import__("json").dumps(report),
                         headers={"content-type": "application/csp-report"})  # fmt: skip
    assert answer.status_code == 204
    assert _violations(client) == before + 1
    assert client.post("/console/csp-report", content=b"not json").status_code == 400


def _violations(client: TestClient) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("inferflux_console_csp_violations "):
            return float(line.split()[1])
    raise AssertionError("no inferflux_console_csp_violations gauge")


def test_models_usage_and_live_pages(world: tuple[Seeded, Any]) -> None:
    seeded, main = world
    client = client_of(main)
    csrf = sign_in(client, key_of(seeded.admin))
    # A JSON-body form: the body goes to the API as typed, and comes back with the API's refusal.
    for body in ("{", '{"name": "ghost", "path": "/nonexistent/ghost.gguf", "colour": 1}', '{"path": "/x"}'):
        api = client.post("/admin/v1/models", headers={**seeded.admin, "content-type": "application/json"},
                          content=body)  # fmt: skip
        page = client.post("/console/models", data={"csrf": csrf, "body": body})
        assert page.status_code == api.status_code and 400 <= api.status_code < 500, (body, api.text)
        assert error_of(api)["message"] in page.text.replace("&#39;", "'").replace("&#34;", '"'), body
    listed = client.get("/console/models")
    assert listed.status_code == 200 and 'data-page="models"' in listed.text
    # Usage: the API's route when the gateway has one, a note when it has not.
    api = client.get("/admin/v1/usage", headers=seeded.admin)
    usage = client.get("/console/usage")
    if api.status_code == 404 and error_of(api)["message"].startswith("No route"):
        assert usage.status_code == 200 and 'id="usage-missing"' in usage.text
    else:
        assert usage.status_code == api.status_code == 200 and 'id="usage-filters"' in usage.text
        csv = client.get("/console/api/usage", params={"format": "csv"})
        assert csv.status_code == 200 and csv.text == client.get("/admin/v1/usage", params={"format": "csv"},
                                                                 headers=seeded.admin).text  # fmt: skip
    # The live panel's events: one JSON snapshot a second (no model is served here).
    with client.stream("GET", "/console/live/events") as events:
        assert events.status_code == 200 and events.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in events.iter_lines() if line.startswith("data: "))
    assert __import__("json").loads(first[len("data: "):])["models"] == []


def test_signing_in_again_replaces_the_session_and_streams_are_not_relayed(world: tuple[Seeded, Any]) -> None:
    seeded, main = world
    client = client_of(main)
    sign_in(client, key_of(seeded.admin))
    first = client.cookies["inferflux_console"]
    sign_in(client, key_of(seeded.admin))
    assert client.cookies["inferflux_console"] != first
    stale = client_of(main)
    stale.cookies.set("inferflux_console", first, path="/console")
    assert stale.get("/console/", follow_redirects=False).status_code == 303
    assert client.get("/console/api/audit/stream").status_code == 404


_SEGMENT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(_SEGMENT, max_size=5), form=st.dictionaries(_SEGMENT, _SEGMENT, max_size=4),
       with_csrf=st.booleans())  # fmt: skip
def test_fuzzed_console_requests_never_fail_the_server(
    world: tuple[Seeded, Any], parts: list[str], form: dict[str, str], with_csrf: bool
) -> None:
    seeded, main = world
    client = _fuzz_client(main, seeded)
    path = "/console/" + "/".join(quote(p, safe="") for p in parts)
    if with_csrf:
        form = {**form, "csrf": client.csrf}  # type: ignore[attr-defined]
    for response in (client.get(path, follow_redirects=False), client.post(path, data=form, follow_redirects=False),
                     client.get("/console/api/" + "/".join(quote(p, safe="") for p in parts))):  # fmt: skip
        assert response.status_code < 500, (path, form, response.text[:300])
        if response.headers.get("content-type", "").startswith("text/html"):  # every page (the router's own
            # JSON 404 for a path the console's Mount cannot match, e.g. one with a newline, is not one)
            assert response.headers.get("content-security-policy") == CSP, (response.request.url, response.status_code)


_FUZZ: dict[int, TestClient] = {}


def _fuzz_client(main: TestClient, seeded: Seeded) -> TestClient:
    """One signed-in platform admin for every example (a sign-in per example would be most of the time)."""
    if id(main) not in _FUZZ:
        client = client_of(main)
        client.csrf = sign_in(client, key_of(seeded.admin))  # type: ignore[attr-defined]
        _FUZZ[id(main)] = client
    return _FUZZ[id(main)]


async def test_sessions_expire_idle_and_absolute(world: tuple[Seeded, Any]) -> None:
    from inferflux.gateway.console.sessions import SessionStore

    seeded, main = world
    now = [1000.0]
    sessions = SessionStore(seeded.store, main.app.state.authenticator, lifetime=3600, idle=600, clock=lambda: now[0])
    principal = await main.app.state.authenticator.authenticate(None, key_of(seeded.acme_admin))
    cookie, _ = sessions.open(principal)
    for step in (599, 599, 599, 599, 599):  # used within each idle window: lives on
        now[0] += step
        assert await sessions.resolve(cookie) is not None
    now[0] += 599 + 10  # past the absolute lifetime (3600 s after sign-in), though not idle
    assert await sessions.resolve(cookie) is None and len(sessions) == 0
    idle, _ = sessions.open(principal)
    now[0] += 600
    assert await sessions.resolve(idle) is None
    assert await sessions.resolve("x" * 200) is None and await sessions.resolve(None) is None


def test_a_disabled_console_is_an_unknown_route(world: tuple[Seeded, Any], tmp_path: Path) -> None:
    from inferflux.gateway.app import create_app
    from inferflux.gateway.models.served import ModelManager
    from inferflux.gateway.settings import Settings

    seeded, _ = world
    settings = Settings(data_dir=tmp_path, console={"enabled": False})
    app = create_app(settings, ModelManager(expected=[]), store=seeded.store, owns_store=False, owns_models=False)
    client = TestClient(app)  # not started: nothing here reaches the store
    for path in ("/console/login", "/console/static/console.js", "/console/"):
        answer = client.get(path)
        assert answer.status_code == 401 and error_of(answer)["code"] == "missing_credentials", path


def test_sign_in_and_out_are_on_the_audit_trail(world: tuple[Seeded, Any]) -> None:
    seeded, main = world
    record, key = seeded.store.create_api_key(seeded.acme.id, "audited", "viewer")
    client = client_of(main)
    csrf = sign_in(client, key)
    assert client.post("/console/logout", data={"csrf": csrf}, follow_redirects=False).status_code == 303
    subject = f"key:{record.prefix}"
    deadline = time.monotonic() + 15  # the indexer writes the spool's events into the store
    while True:
        events = client.get("/admin/v1/audit", params={"principal": subject, "kind": "admin"},
                            headers=seeded.admin).json()["data"]  # fmt: skip
        actions = [e.get("action") for e in events]
        if actions == ["console.sign_in", "console.sign_out"]:
            break
        assert time.monotonic() < deadline, events
        time.sleep(0.2)
    assert all(e["tenant_id"] == seeded.acme.id and e["key_id"] == record.id for e in events)
    assert events[0]["detail"] == {"method": "api_key"}


_TH = re.compile(r"<th[^>]*>([^<]*)</th>")
_POINT = re.compile(r'<g class="point s\d" data-series="([^"]*)" data-bucket="([^"]*)" data-value="([^"]*)">')


def _chart_points(html: str, chart_id: str) -> dict[tuple[str, str], float]:
    figure = html.split(f'<figure class="chart" id="{chart_id}">', 1)[1].split("</figure>", 1)[0]
    return {(s, b): float(v) for s, b, v in _POINT.findall(figure)}


def _api_hours(client: TestClient, headers: dict[str, str], names: dict[str, str]) -> dict[tuple[str, str], float]:
    rows = client.get("/admin/v1/usage", params={"group": "hour", "by": "tenant", "limit": "1000"},
                      headers=headers).json()["data"]  # fmt: skip
    return {(names[r["tenant_id"]], datetime.fromisoformat(r["bucket"].replace("Z", "+00:00")).isoformat()):
            float(r["requests"]) for r in rows}  # fmt: skip


def test_usage_page_names_tenants_draws_the_api_hours_and_repeats_no_column(world: tuple[Seeded, Any]) -> None:
    seeded, main = world
    for headers in (seeded.acme_admin, seeded.globex_admin):  # tenant API calls: usage once indexed
        assert main.get("/v1/models", headers=headers).status_code == 200
    names = {t.id: t.name for t in seeded.store.list_tenants(limit=200).items}
    client = client_of(main)
    sign_in(client, key_of(seeded.admin))
    deadline = time.monotonic() + 30
    while True:  # the page against the API's answer around it (the indexer may add between the two)
        before = _api_hours(main, seeded.admin, names)
        page = client.get("/console/usage", params={"group": "minute", "by": "tenant,key"})
        after = _api_hours(main, seeded.admin, names)
        tenants_seen = {series for series, _ in before}
        if before == after and {"acme", "globex"} <= tenants_seen:
            break
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.3)
    assert page.status_code == 200
    headers = _TH.findall(page.text.split('id="usage"', 1)[1])
    assert len(headers) == len(set(headers)) and headers[:3] == ["bucket", "tenant", "key"], headers
    assert "total tokens" in headers and "total_tokens" not in headers
    table = page.text.split('id="usage"', 1)[1]
    assert ">acme<" in table and ">globex<" in table and f">{seeded.acme.id}<" not in table
    # Each drawn point is the API's requests of that tenant and hour; the hours without any are 0.
    for chart_id in ("chart-requests", "chart-total-tokens"):
        assert f'id="{chart_id}"' in page.text
    points = _chart_points(page.text, "chart-requests")
    assert {k: v for k, v in points.items() if v} == {k: v for k, v in before.items() if v}
    assert len({b for _, b in points}) == 24  # the hours of the minute window
    assert "style=" not in page.text.split("<main>", 1)[1]  # the CSP allows no inline style
    # By model: one series per model (no model is served here: the calls have none).
    by_model = client.get("/console/usage", params={"group": "hour", "chart": "model"})
    assert by_model.status_code == 200 and 'data-series="(no model)"' in by_model.text


def test_a_tenant_admin_sees_its_own_tenant_by_name_and_no_other(world: tuple[Seeded, Any]) -> None:
    seeded, main = world
    assert main.get("/v1/models", headers=seeded.globex_admin).status_code == 200
    client = client_of(main)
    sign_in(client, key_of(seeded.acme_admin))
    usage = client.get("/console/usage", params={"chart": "tenant", "tenant_id": seeded.globex.id})
    assert usage.status_code == 200 and ">acme<" in usage.text  # its own tenant, whatever the URL asks
    assert "globex" not in usage.text and seeded.globex.id not in usage.text
    keys = client.get(f"/console/tenants/{seeded.acme.id}/keys")
    assert keys.status_code == 200 and "<h1>API keys · acme</h1>" in keys.text
    assert f'href="/console/tenants/{seeded.acme.id}/audit"' in keys.text
    other = client.get(f"/console/tenants/{seeded.globex.id}/keys")
    assert other.status_code == 404 and "globex" not in other.text
    # A platform admin: the tenants list links each tenant's pages by name, the all-tenant audit names them.
    admin = client_of(main)
    sign_in(admin, key_of(seeded.admin))
    tenants = admin.get("/console/tenants").text
    assert f'<a href="/console/tenants/{seeded.globex.id}/keys">globex</a>' in tenants
    assert f'data-confirm="Delete globex ({seeded.globex.id})?"' in tenants
    deadline = time.monotonic() + 15  # globex's call above, once indexed
    while f'<span title="{seeded.globex.id}">globex</span>' not in (audit := admin.get("/console/audit").text):
        assert time.monotonic() < deadline, audit[-3000:]
        time.sleep(0.3)
    assert f">{seeded.globex.id}<" not in audit


_USAGE_KEYS = st.sampled_from(["group", "by", "from", "to", "chart", "model", "key_id", "tenant_id", "limit", "offset",
                               "format", "x"])  # fmt: skip
_USAGE_VALUES = st.one_of(st.sampled_from(["day", "hour", "minute", "tenant", "model", "tenant,key,model", "",
                                           "2026-11-01T00:00:00Z", "2026-11-01T00:00:00", "1000", "-1", "csv"]),
                          _SEGMENT)  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(query=st.dictionaries(_USAGE_KEYS, _USAGE_VALUES, max_size=5), tenant_admin=st.booleans())
def test_fuzzed_usage_pages_never_fail_the_server(world: tuple[Seeded, Any], query: dict[str, str],
                                                  tenant_admin: bool) -> None:  # fmt: skip
    seeded, main = world
    client = _usage_client(main, seeded, tenant_admin)
    answer = client.get("/console/usage", params=query, follow_redirects=False)
    assert answer.status_code < 500, (query, answer.text[:300])
    assert answer.status_code in (200, 400, 404, 422), (query, answer.status_code)
    if tenant_admin:
        assert "globex" not in answer.text and seeded.globex.id not in answer.text, query


def _usage_client(main: TestClient, seeded: Seeded, tenant_admin: bool) -> TestClient:
    key = id(main) * 2 + tenant_admin
    if key not in _FUZZ:
        client = client_of(main)
        sign_in(client, key_of(seeded.acme_admin if tenant_admin else seeded.admin))
        _FUZZ[key] = client
    return _FUZZ[key]
