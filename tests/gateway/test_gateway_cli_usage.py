"""``inferctl admin usage|prices|budgets`` against the live server: a price, a token budget that
refuses the request after the one that spent it, the usage table, JSON and CSV; a tenant admin
reads its own usage and budgets, not another tenant's, and may not set prices. A stream its
client closes is counted as cancelled, not refused, in usage and in the metrics."""

from __future__ import annotations

import csv
import io
import json
import secrets
import time
from argparse import Namespace
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from inferflux.gateway import cli
from inferflux.gateway.cli.client import admin_call
from inferflux.gateway.settings import DEFAULT_MODEL_NAME


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def until(check: Callable[[], Any], seconds: float = 15.0) -> Any:
    deadline = time.monotonic() + seconds
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_prices_budgets_and_usage(live_server: str, admin_key: str, capsys: pytest.CaptureFixture[str]) -> None:
    ns = Namespace(url=live_server, api_key=admin_key)
    tenant = admin_call(ns, "POST", "/tenants", {"name": f"usage-{secrets.token_hex(4)}"})
    other = admin_call(ns, "POST", "/tenants", {"name": f"usage-{secrets.token_hex(4)}"})
    tadmin = admin_call(ns, "POST", f"/tenants/{tenant['id']}/keys", {"name": "t", "role": "tenant-admin"})["key"]
    admin = ["--url", live_server, "--api-key", admin_key]
    mine = ["--url", live_server, "--api-key", tadmin]

    code, out, err = run(capsys, "admin", "prices", "set", DEFAULT_MODEL_NAME, "--prompt", "2", "--completion",
                         "4.5", "--json", *admin)  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["completion_usd_per_million"] == "4.500000"
    code, out, _ = run(capsys, "admin", "prices", "list", *admin)
    assert code == 0 and DEFAULT_MODEL_NAME in out and "2.000000" in out
    code, _, err = run(capsys, "admin", "prices", "set", "m", "--prompt", "0.1", "--completion", "0.1", *mine)
    assert code == 1 and "HTTP 404" in err  # platform-only: as if it did not exist
    code, _, err = run(capsys, "admin", "prices", "set", "m", "--prompt", "x", "--completion", "1", *admin)
    assert code == 1 and "HTTP 422" in err and "prompt_usd_per_million" in err

    code, out, err = run(capsys, "admin", "budgets", "set", tenant["id"], "--tokens", "1", "--json", *admin)
    assert code == 0, err
    budget = json.loads(out)
    assert (budget["kind"], budget["spec"]) == ("budget", {"tokens": 1})
    code, out, _ = run(capsys, "admin", "budgets", "get", tenant["id"], "--json", *mine)
    assert code == 0 and [b["id"] for b in json.loads(out)] == [budget["id"]]
    complete = ["complete", "Hi", "--max-tokens", "2", "--no-stream", *mine]
    first, second = run(capsys, *complete), run(capsys, *complete)
    assert first[0] == 0 and second[0] == 1 and "HTTP 429" in second[2] and "token budget" in second[2], second

    def usage() -> list[dict[str, Any]] | None:
        code, out, _ = run(capsys, "admin", "usage", "--by", "tenant,model", "--json", *mine)
        rows = [r for r in json.loads(out) if r["model"] == DEFAULT_MODEL_NAME] if code == 0 else []
        return rows if rows and rows[0]["requests"] >= 2 else None  # both completions indexed

    rows = until(usage)
    assert rows, "no usage within 15 s"
    served = rows[0]
    assert served["tenant_id"] == tenant["id"] and served["refused"] == 1 and served["requests"] == 2
    assert served["refusals"] == {"rate limit: budget_tokens_per_month (tenant)": 1}
    cost = -(-(served["prompt_tokens"] * 2_000_000 + served["completion_tokens"] * 4_500_000) // 1_000_000)
    assert served["cost_usd"] == f"0.{cost:06d}" and cost > 0
    code, out, _ = run(capsys, "admin", "usage", "--by", "model", "--csv", *mine)
    table = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and [r["requests"] for r in table if r["model"] == DEFAULT_MODEL_NAME] == ["2"]
    code, out, _ = run(capsys, "admin", "usage", "--by", "model", "--group", "hour", "--json", *mine)
    hours = [r for r in json.loads(out) if r["model"] == DEFAULT_MODEL_NAME] if code == 0 else []
    assert sum(r["requests"] for r in hours) == 2 and all(r["bucket"].endswith(":00:00Z") for r in hours), out
    code, out, _ = run(capsys, "admin", "usage", "--tenant", tenant["id"], "--group", "minute", "--all", *admin)
    assert code == 0 and out.startswith("BUCKET") and tenant["id"] in out
    code, _, err = run(capsys, "admin", "usage", "--tenant", other["id"], *mine)
    assert code == 1 and "HTTP 404" in err

    code, out, _ = run(capsys, "admin", "budgets", "delete", tenant["id"], budget["id"], *admin)
    assert code == 0 and budget["id"] in out
    code, out, _ = run(capsys, "admin", "prices", "delete", DEFAULT_MODEL_NAME, *admin)
    assert code == 0 and DEFAULT_MODEL_NAME in out


def _closed_streams(live_server: str) -> float:
    """The metrics' count of chat completions whose client left (status 499)."""
    scrape = httpx.get(f"{live_server}/metrics", params={"name[]": "inferflux_http_requests_total"}, timeout=30).text
    mine = [line for line in scrape.splitlines() if line.startswith("inferflux_http_requests_total{")
            and 'route="/v1/chat/completions"' in line and 'status="499"' in line]  # fmt: skip
    return sum(float(line.rsplit(" ", 1)[1]) for line in mine)


def test_a_stream_its_client_closed_is_cancelled_not_refused(live_server: str, admin_key: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    ns = Namespace(url=live_server, api_key=admin_key)
    tenant = admin_call(ns, "POST", "/tenants", {"name": f"leave-{secrets.token_hex(4)}"})
    member = admin_call(ns, "POST", f"/tenants/{tenant['id']}/keys", {"name": "m", "role": "member"})["key"]
    tadmin = admin_call(ns, "POST", f"/tenants/{tenant['id']}/keys", {"name": "t", "role": "tenant-admin"})["key"]
    closed_before = _closed_streams(live_server)
    body = {"model": DEFAULT_MODEL_NAME, "stream": True, "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a long story."}]}  # fmt: skip
    with httpx.Client(base_url=live_server, headers={"authorization": f"Bearer {member}"}, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            # The first chunk: the stream is under way; leaving the block closes the connection.
            assert next(line for line in response.iter_lines() if line.startswith("data: "))
        refused = client.post("/v1/chat/completions", json={"model": DEFAULT_MODEL_NAME, "messages": []})
        assert refused.status_code == 400

    def usage() -> dict[str, Any] | None:
        code, out, _ = run(capsys, "admin", "usage", "--json", "--url", live_server, "--api-key", tadmin)
        rows = json.loads(out) if code == 0 else []
        return rows[0] if rows and rows[0]["requests"] >= 2 else None

    row = until(usage)
    assert row, "no usage within 15 s"
    assert (row["requests"], row["cancelled"], row["refused"]) == (2, 1, 1), row
    assert sum(row["refusals"].values()) == 1 and not {"client_closed", "status 499"} & set(row["refusals"]), row
    code, out, _ = run(capsys, "admin", "usage", "--url", live_server, "--api-key", tadmin)
    assert code == 0 and "CANCELLED" in out.splitlines()[0]
    assert until(lambda: _closed_streams(live_server) >= closed_before + 1), "the metrics did not count the 499"
