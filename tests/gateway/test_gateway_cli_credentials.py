"""``inferctl credentials`` against a live server: the platform admin stores, lists, rotates and deletes
upstream credentials, the secret read from stdin, an environment variable or a prompt, never argv."""

from __future__ import annotations

import io
import json
import secrets
import sys
from typing import Any

import pytest

from inferflux.gateway import cli
from inferflux.policy.errors import NotFound
from secret_watch import remember


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def stdin(monkeypatch: pytest.MonkeyPatch, text: str, *, tty: bool = False) -> None:
    fake = io.StringIO(text)
    fake.isatty = lambda: tty  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stdin", fake)


def test_credential_lifecycle(live_server: str, admin_key: str, gateway_store: Any, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    admin = ["--url", live_server, "--api-key", admin_key]
    name = f"fleet-{secrets.token_hex(4)}"
    first, second, third = (remember(f"sk-cli-{secrets.token_urlsafe(16)}") for _ in range(3))

    # From stdin, as `echo $SECRET | inferctl ...` sends it: the trailing newline is not part of it.
    stdin(monkeypatch, first + "\n")
    code, out, err = run(capsys, "credentials", "create", "--name", name, "--secret-stdin", "--json", *admin)
    assert code == 0, err
    made = json.loads(out)
    assert set(made) == {"object", "id", "name", "created_at", "updated_at"} and made["name"] == name
    assert gateway_store.credential_secret_by_name(name) == first

    code, out, _ = run(capsys, "credentials", "list", *admin)
    assert code == 0 and out.splitlines()[0].split() == ["ID", "NAME", "CREATED_AT", "UPDATED_AT"]
    assert made["id"] in out and name in out
    code, out, _ = run(capsys, "credentials", "show", made["id"], "--json", *admin)
    assert code == 0 and json.loads(out)["id"] == made["id"]

    # From an environment variable, then from the prompt on a terminal.
    monkeypatch.setenv("UPSTREAM_TOKEN", second)
    code, out, err = run(capsys, "credentials", "rotate", made["id"], "--secret-env", "UPSTREAM_TOKEN", *admin)
    assert code == 0, err
    assert gateway_store.credential_secret_by_name(name) == second
    stdin(monkeypatch, "", tty=True)
    monkeypatch.setattr("getpass.getpass", lambda prompt: third)
    code, _, err = run(capsys, "credentials", "rotate", made["id"], *admin)
    assert code == 0, err
    assert gateway_store.credential_secret_by_name(name) == third

    code, out, _ = run(capsys, "credentials", "delete", made["id"], *admin)
    assert code == 0 and made["id"] in out
    code, _, err = run(capsys, "credentials", "show", made["id"], *admin)
    assert code == 1 and "HTTP 404" in err


def test_the_secret_never_comes_from_argv_and_mistakes_are_one_line(
    live_server: str, admin_key: str, gateway_store: Any, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    admin = ["--url", live_server, "--api-key", admin_key]
    name = f"argv-{secrets.token_hex(4)}"
    with pytest.raises(SystemExit) as usage:  # there is no option that takes the secret itself
        cli.main(["credentials", "create", "--name", name, "--secret", "sk-in-ps", *admin])
    assert usage.value.code == 2
    capsys.readouterr()

    stdin(monkeypatch, "sk-piped")  # not a terminal, and no secret option: refused, never prompted
    code, _, err = run(capsys, "credentials", "create", "--name", name, *admin)
    assert code == 1 and "--secret-stdin or --secret-env" in err
    stdin(monkeypatch, "\n")
    code, _, err = run(capsys, "credentials", "create", "--name", name, "--secret-stdin", *admin)
    assert code == 1 and "empty" in err
    monkeypatch.delenv("NO_SUCH_VAR", raising=False)
    code, _, err = run(capsys, "credentials", "create", "--name", name, "--secret-env", "NO_SUCH_VAR", *admin)
    assert code == 1 and "$NO_SUCH_VAR" in err and "empty" in err
    # The server's refusals: a line break inside the secret, a name that is not a slug.
    stdin(monkeypatch, "sk-one\nsk-two\n")
    code, _, err = run(capsys, "credentials", "create", "--name", name, "--secret-stdin", *admin)
    assert code == 1 and "HTTP 422" in err and "sk-one" not in err and "Traceback" not in err
    stdin(monkeypatch, "sk-fine")
    code, _, err = run(capsys, "credentials", "create", "--name", "Not A Slug", "--secret-stdin", *admin)
    assert code == 1 and "HTTP 422" in err and "name" in err
    with pytest.raises(NotFound):
        gateway_store.credential_secret_by_name(name)  # nothing was made

    # Not a platform admin: the routes do not exist for it.
    tenant = gateway_store.create_tenant(f"cred-cli-{secrets.token_hex(4)}")
    tenant_admin = gateway_store.create_api_key(tenant.id, "admin", "tenant-admin")[1]
    code, _, err = run(capsys, "credentials", "list", "--url", live_server, "--api-key", tenant_admin)
    assert code == 1 and "HTTP 404" in err
