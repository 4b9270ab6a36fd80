"""``inferctl idps`` against a live server: a tenant admin manages its own tenant's identity providers
and no other's; the platform admin registers platform-owned ones with the tenants they map into."""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest

from inferflux.gateway import cli


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_identity_provider_lifecycle(live_server: str, admin_key: str, gateway_store: Any,
                                     capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    admin = ["--url", live_server, "--api-key", admin_key]
    n = secrets.token_hex(4)
    tenant = gateway_store.create_tenant(f"idp-cli-{n}")
    other = gateway_store.create_tenant(f"idp-cli-other-{n}")
    own = ["--url", live_server, "--api-key", gateway_store.create_api_key(tenant.id, "admin", "tenant-admin")[1]]

    # A tenant admin registers its tenant's own provider: owned by its tenant, mapping nowhere else.
    code, out, _ = run(capsys, "idps", "create", "--name", "sso", "--issuer", f"https://sso-{n}.example.com",
                       "--audience", "inferflux", "--role-map", "admin=tenant-admin,dev=member", "--json", *own)  # fmt: skip
    assert code == 0, out
    mine = json.loads(out)
    assert (mine["tenant_id"], mine["tenant_ids"], mine["allow_platform"]) == (tenant.id, [], False)
    assert mine["role_map"] == {"admin": "tenant-admin", "dev": "member"}
    code, out, _ = run(capsys, "idps", "list", *own)
    assert code == 0 and out.splitlines()[0].startswith("ID") and mine["id"] in out
    # It cannot widen it, nor register one for another tenant (404: that tenant does not exist for it).
    code, _, err = run(capsys, "idps", "update", mine["id"], "--tenants", other.id, *own)
    assert code == 1 and "HTTP 422" in err and "tenant_ids" in err
    code, _, err = run(capsys, "idps", "create", "--name", "x", "--issuer", "https://x.example.com", "--audience",
                       "a", "--tenant", other.id, *own)  # fmt: skip
    assert code == 1 and "HTTP 404" in err
    code, _, err = run(capsys, "idps", "create", "--name", "x", "--issuer", "https://x.example.com", "--audience",
                       "a", "--role-map", "root", *own)  # fmt: skip
    assert code == 1 and "claim=role" in err

    # The platform admin: a platform-owned provider for the other tenant, then widened to both.
    code, out, _ = run(capsys, "idps", "create", "--platform", "--name", f"corp-{n}", "--issuer",
                       f"https://corp-{n}.example.com", "--audience", "inferflux", "--tenants", other.id,
                       "--json", *admin)  # fmt: skip
    assert code == 0, out
    shared = json.loads(out)
    assert shared["tenant_id"] is None and shared["tenant_ids"] == [other.id]
    code, out, _ = run(capsys, "idps", "update", shared["id"], "--tenants", f"{other.id},{tenant.id}", "--disable",
                       "--json", *admin)  # fmt: skip
    assert code == 0 and json.loads(out)["tenant_ids"] == [other.id, tenant.id] and not json.loads(out)["enabled"]
    # Invisible to the tenant admin, which lists only its own.
    code, _, err = run(capsys, "idps", "show", shared["id"], *own)
    assert code == 1 and "HTTP 404" in err
    code, out, _ = run(capsys, "idps", "list", "--json", *own)
    assert [p["id"] for p in json.loads(out)] == [mine["id"]]

    for provider, who in ((mine["id"], own), (shared["id"], admin)):
        code, out, _ = run(capsys, "idps", "delete", provider, *who)
        assert code == 0 and provider in out
