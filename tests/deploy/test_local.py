"""deploy/local/run.py: up starts two engines and three gateways on loopback, down --purge leaves nothing.

The gateways share one PostgreSQL store (a key created through one authenticates on the
others) and front the engines (backend ``openai``: a greedy answer through each gateway is
the engine's own); where the openai backend is not installed, ``--mode auto`` makes each
gateway serve the model itself, and the three must then agree with each other.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "local" / "run.py"

# Real `inferctl serve` processes loading the default model (the tiers: tests/conftest.py).
pytestmark = [pytest.mark.model, pytest.mark.slow]


def free_run(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports (run.py numbers its servers' ports so).

    Below Linux's ephemeral range (32768 and up): the servers start a minute after this
    check, and meanwhile any outgoing connection (to PostgreSQL, Redis, an engine) could
    take an ephemeral port as its own.
    """
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(20000, 32768 - count)
        if all(port_free(port) for port in range(base, base + count)):
            return base
    raise AssertionError(f"no {count} consecutive free loopback ports")


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def local(pg_server: str, redis_server: str, tmp_path: Path) -> Iterator[dict[str, Any]]:
    from sqlalchemy.engine import make_url

    url = make_url(pg_server)
    common = [
        "--state-dir", str(tmp_path / "state"),
        "--pg-server", f"postgresql://{url.username}@{url.host}:{url.port or 5432}",
        "--redis-url", redis_server,
        "--database", f"inferflux_test_local_{secrets.token_hex(4)}",
    ]  # fmt: skip

    def run(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(SCRIPT), *common, *args], capture_output=True, text=True, timeout=timeout,
            env={**os.environ}, cwd=ROOT,
        )  # fmt: skip

    engine_port = free_run(5)
    gateway_port = engine_port + 2
    started = run("up", "--engine-port", str(engine_port), "--gateway-port", str(gateway_port),
                  "--kv-cache-bytes", "32MiB", "--timeout", "240")  # fmt: skip
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        secrets_file = json.loads((tmp_path / "state" / "secrets.json").read_text())
        yield {
            "gateways": [f"http://127.0.0.1:{gateway_port + i}" for i in range(3)],
            "engines": [f"http://127.0.0.1:{engine_port + i}" for i in range(2)],
            "admin": secrets_file["admin_key"],
            "fleet_admin": secrets_file["fleet_admin_key"],
            "output": started.stdout,
            "run": run,
            "database": common[-1],
        }
    finally:
        stopped = run("down", "--purge", timeout=120)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not (tmp_path / "state").exists()


def chat(base: str, key: str) -> str:
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 8, "temperature": 0}  # fmt: skip
    response = httpx.post(base + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
                          timeout=120)  # fmt: skip
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def test_up_starts_three_gateways_on_one_store_fronting_two_engines(local: dict[str, Any]) -> None:
    gateways, engines, admin = local["gateways"], local["engines"], local["admin"]
    for url in gateways:
        assert url in local["output"] and admin in local["output"]

    # One store: a key made through gateway 1 authenticates on gateways 2 and 3.
    headers = {"authorization": f"Bearer {admin}"}
    tenant = httpx.post(gateways[0] + "/admin/v1/tenants", json={"name": "demo"}, headers=headers, timeout=30)
    assert tenant.status_code == 201, tenant.text
    key = httpx.post(f"{gateways[0]}/admin/v1/tenants/{tenant.json()['id']}/keys",
                     json={"name": "demo", "role": "member"}, headers=headers, timeout=30)  # fmt: skip
    assert key.status_code == 201, key.text
    member = key.json()["key"]

    answers = {url: chat(url, member) for url in gateways}
    assert len(set(answers.values())) == 1, answers
    if "upstream mode" in local["output"]:
        # Fronting the engines: the gateways' answer is the engines' own (greedy).
        assert set(answers.values()) == {chat(engines[0], local["fleet_admin"])}
        # The engines never see the client's key.
        refused = httpx.get(engines[0] + "/v1/models", headers={"authorization": f"Bearer {member}"}, timeout=30)
        assert refused.status_code == 401

    status = local["run"]("status")
    assert status.returncode == 0 and status.stdout.count(" ok") == 5, status.stdout
