"""inferctl's admin clients (whoami, tenants, keys) against a live server."""

from __future__ import annotations

import json
import secrets

import pytest

from inferflux.gateway import cli


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tenant_and_key_lifecycle(live_server: str, admin_key: str, capsys: pytest.CaptureFixture[str]) -> None:
    admin = ["--url", live_server, "--api-key", admin_key]
    name = f"cli-{secrets.token_hex(4)}"

    code, out, _ = run(capsys, "tenants", "create", name, "--models", "smollm2-135m-instruct", "--json", *admin)
    assert code == 0
    tenant = json.loads(out)
    assert tenant["name"] == name and tenant["allowed_models"] == ["smollm2-135m-instruct"]

    code, out, _ = run(capsys, "tenants", "list", *admin)
    assert code == 0 and name in out and out.splitlines()[0].startswith("ID")

    code, out, err = run(capsys, "keys", "create", tenant["id"], "--name", "app", "--role", "member", *admin)
    assert code == 0 and "shown only now" in err
    key = out.strip()
    assert key.startswith("ifx_") and len(out.splitlines()) == 1  # the key alone on stdout

    member = ["--url", live_server, "--api-key", key]
    code, out, _ = run(capsys, "whoami", "--json", *member)
    assert code == 0
    me = json.loads(out)
    assert me["tenant"] == name and me["roles"] == ["member"]

    # A member may not administer (a platform-only route does not exist for it); one line, no traceback.
    code, _, err = run(capsys, "tenants", "list", *member)
    assert code == 1 and "HTTP 404" in err and "Traceback" not in err

    code, out, _ = run(capsys, "keys", "list", tenant["id"], "--json", *admin)
    listed = json.loads(out)
    assert code == 0 and [k["prefix"] for k in listed] == [key.split("_")[1]]
    assert all("key" not in k and "key_hash" not in k for k in listed)

    code, out, _ = run(capsys, "keys", "rotate", tenant["id"], listed[0]["id"], "--grace", "0", *admin)
    new_key = out.strip()
    assert code == 0 and new_key.startswith("ifx_") and new_key != key
    code, _, err = run(capsys, "whoami", *member)
    assert code == 1 and "HTTP 401" in err  # grace 0: the old key is gone at once
    code, out, _ = run(capsys, "whoami", "--url", live_server, "--api-key", new_key)
    assert code == 0 and name in out

    new_id = json.loads(run(capsys, "keys", "list", tenant["id"], "--json", *admin)[1])
    active = [k for k in new_id if k["revoked_at"] is None and k["replaced_by"] is None]
    code, out, _ = run(capsys, "keys", "revoke", tenant["id"], active[0]["id"], "--json", *admin)
    assert code == 0 and json.loads(out)["revoked_at"] is not None

    code, out, _ = run(capsys, "tenants", "delete", tenant["id"], *admin)
    assert code == 0 and tenant["id"] in out
    code, _, err = run(capsys, "keys", "list", tenant["id"], *admin)
    assert code == 1 and "HTTP 404" in err
