"""No credential reaches a log: ``inferctl serve`` at debug level, access log on, every secret grepped,
with the plain and the JSON log format (``log_format``).

A real ``serve`` process (its logging configured as in production) gets API
keys (the generated bootstrap key, admin-created and rotated keys, a forged
one) and OIDC tokens (valid, and from an unknown issuer) in query strings,
headers and paths, valid and not; an identity provider is registered with a
client secret. Then every byte the process wrote is searched for every one
of them. Before the redaction filter, uvicorn's access log wrote
``GET /v1/models?api_key=<the key>`` verbatim.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
from idp import running_idp
from replica import Replica

from inferflux.policy.authn.apikeys import generate_key

# A real `inferctl serve` with the default model (the tiers: tests/conftest.py).
pytestmark = pytest.mark.model

_BANNER_KEY = re.compile(r"^\s+(ifx_[a-z2-7]{12}_[0-9A-Za-z]{43})\s*$", re.MULTILINE)


def _requests(client: httpx.Client, secret: str) -> None:
    """The ways a client sends (or mis-sends) a credential, each once."""
    for name in ("api_key", "key", "access_token", "token", "client_secret", "password"):
        client.get(f"/v1/models?{name}={secret}")
        client.get(f"/admin/v1/whoami?x=1&{name}={secret}&y=2")
    client.get("/v1/models", headers={"authorization": f"Bearer {secret}"})
    client.get("/v1/models", headers={"x-api-key": secret})
    client.get("/admin/v1/whoami", headers={"authorization": f"Bearer {secret}"})
    if secret.startswith(("ifx_", "eyJ")):  # a key or token pasted into the path: known by its shape only
        client.get(f"/v1/models/{secret}", headers={"authorization": f"Bearer {secret}"})


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_no_secret_in_the_logs_of_a_served_gateway(tmp_path: Path, log_format: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERFLUX_")}
    env["INFERFLUX_LOG_FORMAT"] = log_format
    replica = Replica("gateway", tmp_path / "data", env, tmp_path / "serve.log", ["--log-level", "debug"])
    secrets: list[str] = []
    try:
        with running_idp() as idp:
            kid = idp.add_key("RSA")
            replica.wait_ready()
            bootstrap = _BANNER_KEY.findall(replica.output())
            assert len(bootstrap) == 1, "serve shows a generated bootstrap key exactly once"
            admin_key = bootstrap[0]
            admin = httpx.Client(base_url=replica.url, headers={"authorization": f"Bearer {admin_key}"}, timeout=30)
            tenant = admin.post("/admin/v1/tenants", json={"name": "acme"}).json()
            created = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys", json={"name": "ci", "role": "member"})
            assert created.status_code == 201, created.text
            member_key = created.json()["key"]
            rotated = admin.post(f"/admin/v1/tenants/{tenant['id']}/keys/{created.json()['id']}/rotate",
                                 json={"grace_seconds": 60})  # fmt: skip
            assert rotated.status_code in (200, 201), rotated.text
            client_secret = "cs-" + generate_key().secret
            provider = admin.post("/admin/v1/oidc-providers", json={
                "name": "corp", "issuer": idp.issuer, "audience": "inferflux", "client_secret": client_secret,
                "tenant_id": tenant["id"],
                "role_map": {"engineer": "member"},
            })  # fmt: skip
            assert provider.status_code == 201, provider.text
            token = idp.mint(idp.claims(roles=["engineer"]), kid=kid)
            # Signed by a real key, but for an issuer nobody registered.
            unknown_issuer_token = idp.mint(idp.claims(iss="https://nobody.example.com"), kid=kid)
            forged_key = generate_key().token
            secrets = [admin_key, member_key, rotated.json()["key"], forged_key, token, unknown_issuer_token,
                       client_secret]  # fmt: skip

            anonymous = httpx.Client(base_url=replica.url, timeout=30)
            valid = anonymous.get("/v1/models", headers={"authorization": f"Bearer {token}"})
            assert valid.status_code == 200, valid.text
            assert anonymous.get("/v1/models", headers={"x-api-key": member_key}).status_code == 200
            for secret in secrets:
                _requests(anonymous, secret)
    finally:
        replica.stop()
    log = (tmp_path / "serve.log").read_text(errors="replace")
    access = '"GET /v1/models?api_key=[REDACTED] HTTP/1.1" 401'
    if log_format == "text":
        assert access in log, "the access log was on and redacted"
    else:  # one JSON object a line (the banner is printed, not logged), the access lines with their request's id
        lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        assert lines and all({"timestamp", "level", "logger", "message"} <= line.keys() for line in lines)
        refused = [line for line in lines if line["logger"] == "uvicorn.access" and access in line["message"]]
        assert refused and all(len(line["request_id"]) == 24 for line in refused), "the access log was on and redacted"
    assert log.count(admin_key) == 1, "the bootstrap key appears only in its one-time banner"
    # The audit spool names refused callers too (a key's prefix, a token's claimed issuer): never the secret.
    spool = b"".join(p.read_bytes() for p in (tmp_path / "data" / "audit").rglob("*.jsonl"))
    assert spool.count(b"unverified:key:") > 0
    log += spool.decode()
    rest = log.replace(admin_key, "")
    # Nor any long piece of one (a secret cut at a separator): its last 24 characters.
    leaked = [s[:12] + "..." for s in secrets if s[-24:] in rest]
    assert not leaked, f"secrets in the log: {leaked}"
