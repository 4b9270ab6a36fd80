"""inferctl's operator commands against the live server: status, the admin groups over the API
(guardrails, limits, models, oidc, credentials), audit tail, tenants enable/disable, completion;
and two checks over the whole command tree: every command is run by some test, every command that
prints has --json."""

from __future__ import annotations

import io
import json
import os
import pathlib
import queue
import re
import secrets
import subprocess
import sys
import threading
import time
from argparse import Namespace
from collections.abc import Callable
from typing import Any

import pytest

from inferflux.gateway import cli
from inferflux.gateway.cli.client import admin_call
from inferflux.gateway.cli.common import subcommands
from inferflux.gateway.cli.completion import leaves, walk

INFERCTL = [sys.executable, "-m", "inferflux.gateway.cli"]
UNREACHABLE = json.dumps({"endpoints": ["http://upstream.invalid/v1"], "model": "up"})
# Commands that print no result to ask for as JSON: the server itself and a shell script.
NO_JSON = {"serve", "completion"}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def until(check: Callable[[], Any], seconds: float = 15.0) -> Any:
    """``check()``'s first truthy value, polled (the audit index fills a moment after an event)."""
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tenant(live_server: str, admin_key: str) -> dict[str, Any]:
    """A tenant made with inferctl, with a member key and a tenant-admin key."""
    admin = ["--url", live_server, "--api-key", admin_key]
    name = f"ops-{secrets.token_hex(4)}"
    ns = Namespace(url=live_server, api_key=admin_key)
    record = admin_call(ns, "POST", "/tenants", {"name": name})
    keys = {role: admin_call(ns, "POST", f"/tenants/{record['id']}/keys", {"name": role, "role": role})["key"]
            for role in ("member", "tenant-admin")}  # fmt: skip
    return {"id": record["id"], "name": name, "admin": admin,
            "member": ["--url", live_server, "--api-key", keys["member"]],
            "tadmin": ["--url", live_server, "--api-key", keys["tenant-admin"]]}  # fmt: skip


def test_status(live_server: str, admin_key: str, tenant: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "status", "--json", *tenant["admin"])
    report = json.loads(out)
    assert code == 0 and report["live"]["ok"] and report["ready"]["ok"]
    status = report["status"]
    assert status["ready"] and status["version"] and status["reasons"] == []
    [model] = [m for m in status["models"] if m["id"] == "smollm2-135m-instruct"]
    assert model["running"] and model["kv_blocks_total"] > 0 and 0 <= model["kv_usage"] <= 1
    assert 0 <= model["kv_slot_utilisation"] <= 1
    assert status["queue_depth"] >= 0 and status["running_sequences"] >= 0
    code, out, _ = run(capsys, "status", *tenant["member"])  # any key that reads
    assert code == 0 and "ready:    yes" in out and "smollm2-135m-instruct" in out and "KV USE" in out
    # A key narrowed to no model sees none of these models' figures (as /v1/models lists none).
    ns = Namespace(url=live_server, api_key=admin_key)
    narrow = admin_call(ns, "POST", f"/tenants/{tenant['id']}/keys", {"name": "narrow", "role": "viewer",
                                                                        "allowed_models": []})["key"]  # fmt: skip
    code, out, _ = run(capsys, "status", "--json", "--url", live_server, "--api-key", narrow)
    assert code == 0 and json.loads(out)["status"]["models"] == []
    code, out, _ = run(capsys, "status", "--url", live_server)  # no key: the probes only
    assert code == 0 and "live:     yes" in out and "no --api-key" in out
    code, _, err = run(capsys, "status", "--url", live_server, "--api-key", "ifx_wrong")
    assert code == 1 and "HTTP 401" in err and "Traceback" not in err
    code, _, err = run(capsys, "status", "--url", "http://127.0.0.1:9")  # nothing listens: one line
    assert code == 1 and "cannot reach" in err


def test_guardrails_block_then_stop_blocking(tenant: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    spec = json.dumps({"direction": "input", "blocklist": [{"id": "no-zebra", "literal": "zebra"}]})
    code, out, err = run(capsys, "admin", "guardrails", "create", "--name", "animals", "--spec", spec, "--json",
                         *tenant["tadmin"])  # fmt: skip
    assert code == 0, err
    policy = json.loads(out)
    assert policy["tenant_id"] == tenant["id"] and policy["enabled"]
    chat = ["chat", "tell me about the zebra", "--max-tokens", "1", *tenant["member"]]
    code, _, err = run(capsys, *chat)
    assert code == 1 and "HTTP 400" in err
    code, out, _ = run(capsys, "admin", "guardrails", "list", *tenant["tadmin"])
    assert code == 0 and out.startswith("ID") and policy["id"] in out
    code, out, _ = run(capsys, "admin", "guardrails", "show", policy["id"], *tenant["tadmin"])
    assert code == 0 and '"no-zebra"' in out
    code, out, _ = run(capsys, "admin", "guardrails", "update", policy["id"], "--disable", "--json", *tenant["tadmin"])
    assert code == 0 and json.loads(out)["enabled"] is False
    assert run(capsys, *chat)[0] == 0
    # The platform admin names the tenant; a member may not manage guardrails (404: no such route for it).
    code, out, _ = run(capsys, "admin", "guardrails", "list", "--tenant", tenant["id"], "--json", *tenant["admin"])
    assert code == 0 and [p["id"] for p in json.loads(out)] == [policy["id"]]
    code, _, err = run(capsys, "admin", "guardrails", "list", *tenant["member"])
    assert code == 1 and ("HTTP 403" in err or "HTTP 404" in err)
    code, out, _ = run(capsys, "admin", "guardrails", "delete", policy["id"], "--json", *tenant["tadmin"])
    assert code == 0 and json.loads(out) == {"id": policy["id"], "deleted": True}
    code, _, err = run(capsys, "admin", "guardrails", "create", "--name", "x", "--spec", "[1]", *tenant["tadmin"])
    assert code == 1 and "--spec takes a JSON object" in err


def test_limits_set_get_delete(tenant: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "admin", "limits", "set", tenant["id"], "--name", "tight", "--requests-per-minute",
                         "1", "--json", *tenant["admin"])  # fmt: skip
    assert code == 0, err
    policy = json.loads(out)
    assert (policy["kind"], policy["spec"]) == ("rate_limit", {"requests_per_minute": 1})
    complete = ["complete", "Hi", "--max-tokens", "1", "--no-stream", *tenant["member"]]
    first, second = run(capsys, *complete), run(capsys, *complete)
    assert first[0] == 0 and second[0] == 1 and "HTTP 429" in second[2]
    # set again: the same policy, its spec replaced; a tenant admin may read its limits, not raise them.
    code, out, _ = run(capsys, "admin", "limits", "set", tenant["id"], "--name", "tight", "--requests-per-minute",
                       "1000", "--json", *tenant["admin"])  # fmt: skip
    assert code == 0 and json.loads(out)["id"] == policy["id"]
    code, out, _ = run(capsys, "admin", "limits", "get", tenant["id"], "--json", *tenant["tadmin"])
    assert code == 0 and [p["spec"] for p in json.loads(out)] == [{"requests_per_minute": 1000}]
    # The table prints the spec as it is given (--spec JSON), not as a Python dict.
    code, out, _ = run(capsys, "admin", "limits", "get", tenant["id"], *tenant["tadmin"])
    assert code == 0 and '{"requests_per_minute":1000}' in out and "{'" not in out, out
    code, _, err = run(capsys, "admin", "limits", "set", tenant["id"], "--name", "tight", "--requests-per-minute",
                       "5000", *tenant["tadmin"])  # fmt: skip
    assert code == 1 and ("HTTP 403" in err or "HTTP 404" in err)
    code, out, _ = run(capsys, "admin", "limits", "get", "--global", *tenant["admin"])
    assert code == 0 and out.startswith("ID")
    code, _, err = run(capsys, "admin", "limits", "get", *tenant["admin"])
    assert code == 1 and "--global" in err
    code, out, _ = run(capsys, "admin", "limits", "delete", tenant["id"], policy["id"], *tenant["admin"])
    assert code == 0 and policy["id"] in out
    assert run(capsys, "admin", "limits", "get", tenant["id"], "--json", *tenant["admin"])[1].strip() == "[]"


def test_models_under_both_names(tenant: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A model served by an unreachable upstream loads at once (no weights): load, wait, default, unload."""
    admin, name = tenant["admin"], f"far-{secrets.token_hex(3)}"
    code, out, err = run(capsys, "admin", "models", "load", name, "--upstream", UNREACHABLE, "--wait", "--json", *admin)
    assert code == 0, err
    assert json.loads(out)["status"] == "ready" and err == ""  # no progress line: not a terminal, and --json
    code, out, _ = run(capsys, "admin", "models", "list", *admin)
    assert code == 0 and name in out and "smollm2-135m-instruct" in out
    code, out, _ = run(capsys, "served-models", "list", "--json", *admin)
    assert code == 0 and name in [m["id"] for m in json.loads(out)]
    code, out, _ = run(capsys, "admin", "models", "show", name, "--json", *admin)
    assert code == 0 and json.loads(out)["backend"] == "openai"
    code, out, _ = run(capsys, "served-models", "show", name, *admin)
    assert code == 0 and name in out
    try:
        code, out, _ = run(capsys, "admin", "models", "default", name, "--json", *admin)
        assert code == 0 and json.loads(out)["default"] is True
    finally:
        code, out, _ = run(capsys, "served-models", "default", "smollm2-135m-instruct", "--json", *admin)
        assert code == 0 and json.loads(out)["default"] is True
    code, out, _ = run(capsys, "admin", "models", "unload", name, "--json", *admin)
    assert code == 0 and json.loads(out) == {"id": name, "unloaded": True}
    # On a terminal, --wait draws a progress line on stderr and clears it at the end.
    other, terminal = f"far-{secrets.token_hex(3)}", io.StringIO()
    terminal.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["served-models", "load", other, "--upstream", UNREACHABLE, "--wait", *admin]) == 0
    monkeypatch.undo()
    drawn = terminal.getvalue()
    assert f"loading {other}: " in drawn and "ready" in drawn and drawn.endswith("\r") and "\n" not in drawn
    code, out, _ = run(capsys, "served-models", "unload", other, *admin)
    assert code == 0 and f"unloaded model {other}" in out
    code, _, err = run(capsys, "admin", "models", "list", *tenant["tadmin"])  # platform admins only
    assert code == 1 and "HTTP 404" in err


def test_oidc_and_credentials_in_the_admin_group(tenant: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    own, admin, n = tenant["tadmin"], tenant["admin"], secrets.token_hex(4)
    code, out, err = run(capsys, "admin", "oidc", "create", "--name", "sso", "--issuer", f"https://sso-{n}.example.com",
                         "--audience", "inferflux", "--json", *own)  # fmt: skip
    assert code == 0, err
    provider = json.loads(out)
    assert provider["tenant_id"] == tenant["id"]
    code, out, _ = run(capsys, "admin", "oidc", "update", provider["id"], "--disable", "--json", *own)
    assert code == 0 and json.loads(out)["enabled"] is False
    code, out, _ = run(capsys, "admin", "oidc", "list", *own)
    assert code == 0 and provider["id"] in out
    code, out, _ = run(capsys, "admin", "oidc", "show", provider["id"], "--json", *own)
    assert code == 0 and json.loads(out)["issuer"] == f"https://sso-{n}.example.com"
    code, out, _ = run(capsys, "admin", "oidc", "delete", provider["id"], "--json", *own)
    assert code == 0 and json.loads(out)["deleted"] is True

    monkeypatch.setenv("CLI_OPS_SECRET", f"sk-ops-{secrets.token_urlsafe(12)}")
    code, out, err = run(capsys, "admin", "credentials", "create", "--name", f"ops-{n}", "--secret-env",
                         "CLI_OPS_SECRET", "--json", *admin)  # fmt: skip
    assert code == 0, err
    credential = json.loads(out)
    assert os.environ["CLI_OPS_SECRET"] not in out
    code, out, _ = run(capsys, "admin", "credentials", "list", *admin)
    assert code == 0 and credential["id"] in out
    monkeypatch.setenv("CLI_OPS_SECRET", f"sk-ops-{secrets.token_urlsafe(12)}")
    code, out, _ = run(capsys, "admin", "credentials", "rotate", credential["id"], "--secret-env", "CLI_OPS_SECRET",
                       "--json", *admin)  # fmt: skip
    assert code == 0 and json.loads(out)["id"] == credential["id"]
    code, out, _ = run(capsys, "admin", "credentials", "show", credential["id"], *admin)
    assert code == 0 and f"ops-{n}" in out
    code, out, _ = run(capsys, "admin", "credentials", "delete", credential["id"], *admin)
    assert code == 0 and credential["id"] in out


def test_tenant_disable_enable(tenant: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "tenants", "disable", tenant["id"], "--json", *tenant["admin"])
    assert code == 0 and json.loads(out)["disabled"] is True
    code, _, err = run(capsys, "whoami", *tenant["member"])
    assert code == 1 and ("HTTP 401" in err or "HTTP 403" in err)
    code, out, _ = run(capsys, "tenants", "enable", tenant["id"], *tenant["admin"])
    assert code == 0 and tenant["name"] in out
    assert until(lambda: run(capsys, "whoami", *tenant["member"])[0] == 0)


def test_audit_tail_and_follow(tenant: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    """The tenant admin's change is in its tail; --follow prints the next one as it is indexed."""
    spec = json.dumps({"blocklist": [{"literal": "okapi"}]})
    code, out, _ = run(capsys, "admin", "guardrails", "create", "--name", "tail", "--spec", spec, "--json",
                       *tenant["tadmin"])  # fmt: skip
    assert code == 0
    policy = json.loads(out)["id"]

    def changes(*extra: str) -> list[dict[str, Any]]:
        code, out, _ = run(capsys, "audit", "tail", "-n", "50", "--kind", "admin", "--json", *extra)
        assert code == 0
        return [e for e in map(json.loads, out.splitlines()) if e.get("target_id") == policy]

    events = until(lambda: changes(*tenant["tadmin"]))
    assert [(e["action"], e["tenant_id"], e["decision"]) for e in events] == [("guardrail.create", tenant["id"],
                                                                               "allow")]  # fmt: skip
    assert events[0]["hash"] and events[0]["chain"]
    assert until(lambda: changes("--tenant", tenant["id"], *tenant["admin"])) == events  # a platform admin's view
    code, out, _ = run(capsys, "audit", "tail", "-n", "2", *tenant["tadmin"])
    assert code == 0 and 1 <= len(out.splitlines()) <= 2 and tenant["id"] in out
    code, _, err = run(capsys, "audit", "tail", "--tenant", "ten_elsewhere", *tenant["tadmin"])
    assert code == 1 and "HTTP 404" in err  # another tenant's trail does not exist for a tenant admin

    follow = subprocess.Popen([*INFERCTL, "audit", "tail", "--follow", "--interval", "0.3", "--json", "-n", "1",
                               "--kind", "admin", *tenant["tadmin"]], stdout=subprocess.PIPE, text=True)  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in follow.stdout or ()], daemon=True).start()
    try:
        json.loads(lines.get(timeout=30))  # the last change so far: it has started polling
        assert run(capsys, "admin", "guardrails", "delete", policy, *tenant["tadmin"])[0] == 0
        deadline = time.monotonic() + 30
        while True:
            event = json.loads(lines.get(timeout=max(deadline - time.monotonic(), 0.1)))
            if (event.get("action"), event.get("target_id")) == ("guardrail.delete", policy):
                break
    finally:
        follow.kill()
        follow.wait()


def test_completion_scripts(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path) -> None:
    code, script, _ = run(capsys, "completion", "bash")
    assert code == 0
    (tmp_path / "c.bash").write_text(script)

    def complete(*words: str) -> list[str]:
        line = " ".join(f"'{w}'" for w in words)
        probe = (f"source {tmp_path / 'c.bash'}; COMP_WORDS=(inferctl {line}); COMP_CWORD={len(words)}; "
                 "_inferctl; echo \"${COMPREPLY[*]}\"")  # fmt: skip
        return subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.split()

    assert complete("adm") == ["admin"]
    admin_groups = complete("admin", "")
    assert admin_groups == sorted(subcommands(subcommands(cli.build_parser())["admin"]))  # the parser's own list
    assert {"credentials", "guardrails", "limits", "models", "oidc", "rotate-key"} <= set(admin_groups)
    assert complete("admin", "guardrails", "cr") == ["create"]
    assert "--sensitive-stdin" in complete("admin", "guardrails", "create", "--s")
    assert complete("--url", "x", "chat", "--inter") == ["--interactive"]
    code, text, _ = run(capsys, "completion", "zsh")
    assert code == 0 and "bashcompinit" in text and '"admin guardrails")' in text
    code, text, _ = run(capsys, "completion", "fish")
    assert code == 0 and "test (__inferctl_path) = 'chat'\" -l interactive" in text


def _leaf_paths() -> list[str]:
    return leaves(cli.build_parser())


def test_every_command_is_run_by_a_test() -> None:
    """Each leaf of the command tree appears in some test as its words in order ("admin", "limits", "set")."""
    sources = "\n".join(p.read_text() for p in pathlib.Path(__file__).parents[1].rglob("test_*.py"))
    missing = []
    for path in _leaf_paths():
        words = path.split()
        quoted = r"""["']\s*,\s*["']""".join(map(re.escape, words))
        if not re.search(rf"""["']{quoted}["']""", sources):
            missing.append(path)
    assert not missing, f"commands no test runs: {missing}"
    assert {"status", "chat", "admin guardrails create", "admin limits set", "audit tail"} <= set(_leaf_paths())


def test_every_command_that_prints_has_json() -> None:
    without = {path for path, subs, options in walk(cli.build_parser()) if not subs and "--json" not in options}
    assert without == NO_JSON
