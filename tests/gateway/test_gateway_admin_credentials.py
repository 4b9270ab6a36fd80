"""Upstream credentials over the admin API (issue 20): ``/admin/v1/credentials``.

* create, read, list (paginated), rotate and delete, by a platform admin: the
  secret is in no answer, no log record, no audit event and no file the app
  wrote, and the database row holds only its ciphertext; a rotation changes
  what ``credential_secret_by_name`` (the openai backend's lookup) returns;
* names unique (409), names and secrets checked (422 naming the field, 400 for
  what is not JSON), OpenAI-shaped, the secret never quoted back, nothing made;
* every other role, in any tenant, is answered as if the routes did not exist
  (404, the same answer as a made-up route), and a tenant's own credential in
  the store is not served here; refusals are on the audit trail too.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from starlette.testclient import TestClient

from admin_seed import Seeded, seeded_app
from audit_wait import wait_indexed
from http_helpers import assert_same_answer, bearer, error_of
from secret_watch import remember

URL = "/admin/v1/credentials"
FIELDS = {"object", "id", "name", "created_at", "updated_at"}


@dataclass
class World(Seeded):
    app: Any
    client: TestClient
    data_dir: Path


@pytest.fixture(scope="module")
def world(make_app: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    data_dir: Path = tmp_path_factory.mktemp("admin-credentials")
    with seeded_app(make_app, data_dir) as (seeded, app, client):
        yield World(**seeded.seeded(), app=app, client=client, data_dir=data_dir)


def new_secret() -> str:
    """A secret no one else made, watched in every log record of the session (``secret_watch``)."""
    return remember(f"sk-upstream-{secrets.token_urlsafe(24)}")


def when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def app_files(world: World) -> bytes:
    """Every byte the app and its store wrote: audit spool and cursors, the SQLite file and its WAL."""
    return b"".join(path.read_bytes() for path in sorted(world.data_dir.rglob("*")) if path.is_file())


def test_the_lifecycle_never_shows_the_secret(world: World, caplog: pytest.LogCaptureFixture) -> None:
    client, admin, store = world.client, world.admin, world.store
    first, second = new_secret(), new_secret()
    name = unique("vllm-fleet")
    answers = []
    with caplog.at_level(logging.DEBUG):
        created = client.post(URL, json={"name": name, "secret": first}, headers=admin)
        answers.append(created)
        assert created.status_code == 201, created.text
        record = created.json()
        assert set(record) == FIELDS and record["object"] == "credential" and record["name"] == name
        assert record["id"].startswith("cred_") and record["created_at"] == record["updated_at"]
        assert store.credential_secret_by_name(name) == first

        answers.append(got := client.get(f"{URL}/{record['id']}", headers=admin))
        assert got.status_code == 200 and got.json() == record
        answers.append(listed := client.get(URL, headers=admin))
        assert listed.status_code == 200 and record in listed.json()["data"]

        answers.append(rotated := client.post(f"{URL}/{record['id']}/rotate", json={"secret": second}, headers=admin))
        assert rotated.status_code == 200, rotated.text
        after = rotated.json()
        assert set(after) == FIELDS and (after["id"], after["name"]) == (record["id"], name)
        assert when(after["updated_at"]) > when(record["updated_at"]) and after["created_at"] == record["created_at"]
        assert store.credential_secret_by_name(name) == second  # what the openai backend reads now

        answers.append(deleted := client.delete(f"{URL}/{record['id']}", headers=admin))
        assert deleted.status_code == 204 and deleted.content == b""
        answers.append(gone := client.get(f"{URL}/{record['id']}", headers=admin))
        assert gone.status_code == 404 and error_of(gone)["code"] == "not_found"
        assert client.post(f"{URL}/{record['id']}/rotate", json={"secret": first}, headers=admin).status_code == 404
        assert client.delete(f"{URL}/{record['id']}", headers=admin).status_code == 404
        assert record["id"] not in client.get(URL, headers=admin).text

    for answer in answers:
        assert first not in answer.text and second not in answer.text
        assert all(first not in v and second not in v for v in answer.headers.values())
    assert caplog.records, "nothing was logged at debug level: the grep below would prove nothing"
    assert first not in caplog.text and second not in caplog.text

    # The trail: each change's event names the credential, not its secret; attempts before each.
    request_ids = [created.headers["x-request-id"], rotated.headers["x-request-id"], deleted.headers["x-request-id"]]
    events = wait_indexed(world.app, lambda es: set(request_ids) <= {e["request_id"] for e in es
                                                                     if e["action"] != "attempt"})  # fmt: skip
    ours = sorted((e for e in events if e["request_id"] in request_ids and e["action"] != "attempt"),
                  key=lambda e: request_ids.index(e["request_id"]))  # fmt: skip
    assert [(e["action"], e["target_kind"], e["target_id"], e["tenant_id"], e["detail"]) for e in ours] == [
        (action, "credential", record["id"], None, {"name": name})
        for action in ("credential.create", "credential.rotate", "credential.delete")
    ]
    assert all(e["principal"] == world.admin_subject and e["decision"] == "allow" for e in ours)
    assert first not in json.dumps(events) and second not in json.dumps(events)
    # Nor anywhere on disk in the clear: the spool, the index, the store (its WAL too).
    on_disk = app_files(world)
    assert first.encode() not in on_disk and second.encode() not in on_disk


def test_the_database_holds_only_ciphertext(world: World) -> None:
    secret = new_secret()
    created = world.client.post(URL, json={"name": unique("raw"), "secret": secret}, headers=world.admin)
    assert created.status_code == 201
    with world.store.engine.connect() as connection:
        row = connection.execute(text("SELECT tenant_id, secret FROM credentials WHERE id = :id"),
                                 {"id": created.json()["id"]}).one()  # fmt: skip
    raw = bytes(row.secret)
    assert row.tenant_id is None  # the platform's
    assert secret.encode() not in raw and len(raw) > len(secret)  # sealed: nonce, ciphertext, tag
    assert world.store.get_credential(None, created.json()["id"]).secret == secret


def test_lists_are_paginated(world: World) -> None:
    client, admin = world.client, world.admin
    made = [client.post(URL, json={"name": unique(f"page-{i}"), "secret": new_secret()}, headers=admin).json()["id"]
            for i in range(5)]  # fmt: skip
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        params = {"limit": 2, **({"after": after} if after else {})}
        page = client.get(URL, params=params, headers=admin)
        assert page.status_code == 200, page.text
        body = page.json()
        assert body["object"] == "list" and len(body["data"]) <= 2
        assert all(set(item) == FIELDS for item in body["data"])
        seen += [item["id"] for item in body["data"]]
        pages += 1
        after = body["next_cursor"]
        if after is None:
            break
    assert [i for i in seen if i in made] == made  # creation order, each once
    assert len(seen) == len(set(seen)) and pages >= 3
    bad = client.get(URL, params={"limit": 0}, headers=admin)
    assert bad.status_code == 422 and error_of(bad)["param"] == "limit"


def test_a_name_is_taken_once(world: World) -> None:
    name = unique("taken")
    assert world.client.post(URL, json={"name": name, "secret": new_secret()}, headers=world.admin).status_code == 201
    again = world.client.post(URL, json={"name": name, "secret": new_secret()}, headers=world.admin)
    assert again.status_code == 409 and error_of(again)["code"] == "conflict"
    # A tenant's credential of the same name (in the store only) is another owner's: no conflict with it.
    world.store.create_credential(world.acme.id, "tenant-named", "tenant-secret")
    made = world.client.post(URL, json={"name": "tenant-named", "secret": new_secret()}, headers=world.admin)
    assert made.status_code == 201


# (body, status, param) of bodies refused: the secret's rules are the store's (policy.store.validate).
REFUSED: list[tuple[Any, int, str | None]] = [
    ({"name": "Bad Name", "secret": "s"}, 422, "name"),
    ({"name": "x" * 64, "secret": "s"}, 422, "name"),
    ({"secret": "s"}, 422, "name"),
    ({"name": "ok"}, 422, "secret"),
    ({"name": "ok", "secret": ""}, 422, "secret"),
    ({"name": "ok", "secret": 12345}, 422, "secret"),
    ({"name": "ok", "secret": "k" * 8193}, 422, "secret"),
    ({"name": "ok", "secret": "sk-abc\r\nx-injected: 1"}, 422, "secret"),
    ({"name": "ok", "secret": "sk-abc\u200b"}, 422, "secret"),
    ({"name": "ok", "secret": "sk-abc", "tenant_id": None}, 422, "tenant_id"),  # platform-only: no owner to pick
    ("not an object", 400, None),
]


@pytest.mark.parametrize(("body", "status", "param"), REFUSED)
def test_bad_bodies_are_refused_and_nothing_is_made(world: World, body: Any, status: int, param: str | None) -> None:
    before = world.store.policy_version()
    refused = world.client.post(URL, json=body, headers=world.admin)
    assert refused.status_code == status, refused.text
    error = error_of(refused)
    assert error["param"] == param
    if isinstance(body, dict) and isinstance(body.get("secret"), str) and len(body["secret"]) > 3:
        assert body["secret"] not in refused.text
    assert world.store.policy_version() == before


def test_a_rotation_is_checked_like_a_creation(world: World) -> None:
    name, secret = unique("rotating"), new_secret()
    made = world.client.post(URL, json={"name": name, "secret": secret}, headers=world.admin).json()
    for body, param in (({"secret": "a\nb"}, "secret"), ({}, "secret"), ({"secret": "s", "name": "new"}, "name")):
        refused = world.client.post(f"{URL}/{made['id']}/rotate", json=body, headers=world.admin)
        assert refused.status_code == 422 and error_of(refused)["param"] == param, refused.text
    assert world.store.credential_secret_by_name(name) == secret  # unchanged


def test_no_one_but_a_platform_admin_finds_the_routes(world: World) -> None:
    client, store = world.client, world.store
    platform = store.get_tenant_by_name("platform")
    callers = {
        "acme tenant-admin": world.acme_admin,
        "acme member": bearer(store.create_api_key(world.acme.id, "m", "member")[1]),
        "acme viewer": bearer(store.create_api_key(world.acme.id, "v", "viewer")[1]),
        # In the platform tenant itself but without admin:platform: still no such routes.
        "platform tenant-admin": bearer(store.create_api_key(platform.id, "ta", "tenant-admin")[1]),
        "platform viewer": bearer(store.create_api_key(platform.id, "pv", "viewer")[1]),
    }
    name, secret = unique("hidden"), new_secret()
    real = client.post(URL, json={"name": name, "secret": secret}, headers=world.admin).json()["id"]
    before = store.policy_version()
    requests = [("GET", URL, None), ("POST", URL, {"name": "mine", "secret": "s"}), ("GET", f"{URL}/{real}", None),
                ("POST", f"{URL}/{real}/rotate", {"secret": "stolen"}), ("DELETE", f"{URL}/{real}", None)]  # fmt: skip
    nowhere = "/admin/v1/" + "z" * len("credentials")
    for who, headers in callers.items():
        for method, url, body in requests:
            seen = client.request(method, url, json=body, headers=headers)
            assert seen.status_code == 404, (who, method, url, seen.text)
            assert error_of(seen)["code"] == "not_found"
            absent = client.request(method, url.replace(URL, nowhere), json=body, headers=headers)
            assert_same_answer(seen, absent, {URL: nowhere})
            assert secret not in seen.text and name not in seen.text
    assert store.policy_version() == before, "a refused request changed something"
    assert store.credential_secret_by_name(name) == secret

    # The refusals are on the trail, as every admin refusal is (the route's template, the status).
    events = wait_indexed(world.app, lambda es: any(e.get("route") == "DELETE /admin/v1/credentials/{credential_id}"
                                                    and e.get("status") == 404 for e in es))  # fmt: skip
    refused = [e for e in events if (e.get("route") or "").startswith("POST /admin/v1/credentials") and
               e.get("status") == 404]  # fmt: skip
    assert refused and all(e["decision"] == "deny" for e in refused)


def test_a_tenants_credential_is_not_served_here(world: World) -> None:
    """Tenant-owned credentials exist in the store, but the API serves the platform's only (for now)."""
    theirs = world.store.create_credential(world.globex.id, unique("siem"), remember("globex-sink-token-5d1e"))
    assert world.client.get(f"{URL}/{theirs.id}", headers=world.admin).status_code == 404
    assert world.client.post(f"{URL}/{theirs.id}/rotate", json={"secret": "x"}, headers=world.admin).status_code == 404
    assert world.client.delete(f"{URL}/{theirs.id}", headers=world.admin).status_code == 404
    listed = world.client.get(URL, params={"limit": 200}, headers=world.admin).json()["data"]
    assert theirs.id not in {item["id"] for item in listed}
    assert world.store.get_credential(world.globex.id, theirs.id).secret == "globex-sink-token-5d1e"
