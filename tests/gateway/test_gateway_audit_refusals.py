"""Every refusal is on the audit trail, and a flood of them cannot fill the disk.

* a forged token on an admin route, and a tenant admin's attempts to grant
  platform-admin (a key, a role binding), each leave an event naming who
  (the principal, else the presented key's prefix or token's claimed issuer
  and subject, else the address), what route (its template) and why (the
  error code); before, only successful admin changes were recorded;
* 1,000 forged credentials in a row give a bounded number of events whose
  counts add up to 1,000: the first written before its answer, the rest
  counted and written when the window ends or the app stops;
* a path that is not a route (or holds a pasted key) never reaches the
  event: the route is a template, so a 401 on a 300-character path is
  recorded instead of failing the audit event (which answered 500).

The events are read from the app's spool itself, after the app has stopped
(which writes the open windows' counts).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from admin_seed import Seeded, seed_store
from idp import hand_built_token
from starlette.testclient import TestClient

from inferflux.policy.audit import verify_spool
from inferflux.policy.authn.apikeys import generate_key


def spool_events(spool_dir: Path) -> list[dict[str, Any]]:
    events = []
    for segment in sorted((spool_dir / "segments").glob("*.jsonl")):
        events += [json.loads(line)["event"] for line in segment.read_bytes().splitlines() if line]
    return events


def count(event: dict[str, Any]) -> int:
    """How many refusals an event stands for: an aggregate's count, else one."""
    return int((event.get("detail") or {}).get("aggregated", 1))


@pytest.fixture
def world(make_app: Any, tmp_path: Path) -> Iterator[tuple[Seeded, Any, Path]]:
    """A seeded store and an app over it with a refusal window longer than any test here."""
    seeded = seed_store(tmp_path)
    app = make_app(seeded.store, data_dir=tmp_path / "app", audit={"refusal_aggregation_seconds": 60})
    try:
        yield seeded, app, tmp_path / "app" / "audit"
    finally:
        seeded.store.close()


def test_a_forged_token_on_an_admin_route_is_audited(world: tuple[Seeded, Any, Path]) -> None:
    seeded, app, spool_dir = world
    forged_key = generate_key()
    forged_jwt = hand_built_token({"alg": "RS256", "kid": "k"}, {"iss": "https://evil.example", "sub": "mallory"})
    with TestClient(app) as client:
        assert client.get("/admin/v1/tenants", headers={"authorization": f"Bearer {forged_key.token}"}).status_code == 401
        assert client.post("/admin/v1/tenants", json={"name": "x"},
                           headers={"authorization": f"Bearer {forged_jwt}"}).status_code == 401  # fmt: skip
        assert client.get("/admin/v1/tenants").status_code == 401  # no credential at all
    events = [e for e in spool_events(spool_dir) if e["status"] == 401]
    by_principal = {e["principal"]: e for e in events}
    key_event = by_principal[f"unverified:key:{forged_key.prefix}"]
    assert key_event["kind"] == "admin" and key_event["decision"] == "deny"
    assert key_event["route"] == "GET /admin/v1/tenants" and key_event["reasons"] == ["invalid_api_key"]
    jwt_event = by_principal["unverified:jwt:https://evil.example#mallory"]
    assert jwt_event["route"] == "POST /admin/v1/tenants" and jwt_event["reasons"], jwt_event
    anonymous = by_principal["addr:testclient"]
    assert anonymous["reasons"] == ["missing_credentials"] and anonymous["detail"] == {"client": "testclient"}
    assert forged_key.secret not in json.dumps(events) and forged_jwt not in json.dumps(events)
    assert verify_spool(spool_dir).ok


def test_a_tenant_admins_attempts_to_grant_platform_admin_are_audited(world: tuple[Seeded, Any, Path]) -> None:
    seeded, app, spool_dir = world
    acme = seeded.acme.id
    with TestClient(app) as client:
        key = client.post(f"/admin/v1/tenants/{acme}/keys", json={"name": "root", "role": "platform-admin"},
                          headers=seeded.acme_admin)  # fmt: skip
        binding = client.post(f"/admin/v1/tenants/{acme}/role-bindings", headers=seeded.acme_admin, json={
            "provider_id": seeded.provider.id, "kind": "subject", "subject": "mallory", "role": "platform-admin"})
        assert key.status_code in (403, 422) and binding.status_code in (403, 422), (key.text, binding.text)
    events = [e for e in spool_events(spool_dir) if e["principal"] == seeded.acme_admin_subject]
    routes = {e["route"]: e for e in events}
    for route, answer in (("POST /admin/v1/tenants/{tenant_id}/keys", key),
                          ("POST /admin/v1/tenants/{tenant_id}/role-bindings", binding)):  # fmt: skip
        event = routes[route]
        assert event["tenant_id"] == acme and event["kind"] == "admin" and event["status"] == answer.status_code
        assert event["reasons"] == [answer.json()["error"]["code"]]


def test_a_flood_of_forged_tokens_is_aggregated_and_every_refusal_counted(world: tuple[Seeded, Any, Path]) -> None:
    seeded, app, spool_dir = world
    with TestClient(app) as client:
        # 50 forged keys, each sent 20 times: a caller without a principal is its address, whatever it sends.
        forged = [generate_key().token for _ in range(50)]
        for i in range(1000):
            response = client.get("/admin/v1/whoami", headers={"authorization": f"Bearer {forged[i % 50]}"})
            assert response.status_code == 401
        written_before_stop = len([e for e in spool_events(spool_dir) if e["status"] == 401])
    events = [e for e in spool_events(spool_dir) if e["route"] == "GET /admin/v1/whoami"]
    assert written_before_stop == 1, "the first refusal is written at once, the repeats only counted"
    assert len(events) == 2, [e["detail"] for e in events]
    assert sum(count(e) for e in events) == 1000
    aggregate = events[-1]
    assert aggregate["detail"]["aggregated"] == 999 and aggregate["principal"] == "addr:testclient"
    assert aggregate["reasons"] == ["invalid_api_key"] and aggregate["status"] == 401
    assert verify_spool(spool_dir).ok


def test_a_refusal_on_a_long_path_is_recorded_by_its_template(world: tuple[Seeded, Any, Path]) -> None:
    seeded, app, spool_dir = world
    pasted = generate_key().token
    with TestClient(app) as client:
        response = client.get(f"/v1/models/{pasted * 5}", headers={"authorization": f"Bearer {pasted}"})
        assert response.status_code == 401, response.text
        assert client.get(f"/no/such/{pasted}", headers=seeded.admin).status_code == 404
    events = spool_events(spool_dir)
    assert {e["route"] for e in events} >= {"GET /v1/models/{model_id:path}", "GET unmatched"}
    assert pasted not in json.dumps(events)


def test_the_app_checkpoints_its_chain_into_the_store(make_app: Any, tmp_path: Path) -> None:
    """The served trail signs its head (here at shutdown) into the store; the CLI's check then finds a cut."""
    from inferflux.policy.audit.checkpoint import CHECKPOINT_PURPOSE, CheckpointSigner
    from inferflux.policy.audit.cli import spool_chain_id

    seeded = seed_store(tmp_path)
    try:
        app = make_app(seeded.store, data_dir=tmp_path / "app")
        with TestClient(app) as client:
            for _ in range(3):
                assert client.get("/v1/models", headers=seeded.admin).status_code == 200
        spool_dir = tmp_path / "app" / "audit"
        checkpoint = app.state.audit_store.latest_checkpoint(spool_chain_id(spool_dir))
        signer = CheckpointSigner(seeded.store.derive_secret(CHECKPOINT_PURPOSE))
        assert checkpoint is not None and checkpoint.seq == 2 and signer.valid(checkpoint)
        assert verify_spool(spool_dir, checkpoint=checkpoint, signer=signer).ok
        assert spool_events(spool_dir)[-1]["kind"] == "checkpoint"
        segment = sorted((spool_dir / "segments").glob("*.jsonl"))[-1]
        segment.write_bytes(b"".join(segment.read_bytes().splitlines(keepends=True)[:-2]))
        problem = verify_spool(spool_dir, checkpoint=checkpoint, signer=signer).problem
        assert problem is not None and "1 records missing after seq 1" in str(problem)
    finally:
        seeded.store.close()
