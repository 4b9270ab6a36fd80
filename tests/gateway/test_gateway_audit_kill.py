"""The audit trail end to end: ``inferctl serve`` killed with SIGKILL under load loses no answered call's event.

The SIEM (a real rsyslogd, over TCP) is down from the start. Eight clients send
1,000 requests (model lists, one-token completions, and calls for an unknown
model that get a 404); once 400 have been answered the gateway gets SIGKILL.
Every answer the clients received is an acknowledgement: its event was written
before the answer left — except a repeated refusal, which is only counted into
its window's aggregate (issue 18): of the 404s, the first is written before
its answer, the repeats' count is in memory and a kill -9 loses it. Then the gateway starts again on the same data
directory, the receiver comes up, and every acknowledged request's event must
arrive there; ``inferctl audit verify`` passes on the spool and on what the
receiver got, and fails, naming the line, once one spooled line is changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from audit_support import Rsyslog, rsyslogd_path, wait_for
from replica import Replica

from inferflux.policy.audit.chain import canonical_json, verify_lines
from inferflux.policy.audit.spool import segment_files
from inferflux.policy.authn.apikeys import generate_key

# A real `inferctl serve` with the default model, and a real rsyslogd (the tiers: tests/conftest.py).
pytestmark = [pytest.mark.model, pytest.mark.service]

REPO = Path(__file__).resolve().parents[2]
TOTAL, KILL_AFTER, CLIENTS = 1000, 400, 8


def request(client: httpx.Client, i: int) -> httpx.Response:
    if i % 10 == 0:
        body = {"model": "smollm2-135m-instruct", "prompt": f"Count to {i}:", "max_tokens": 1, "temperature": 0}
        return client.post("/v1/completions", json=body)
    if i % 20 == 5:
        return client.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi", "max_tokens": 1})
    return client.get("/v1/models")


def load_until_killed(gateway: Replica, key: str) -> list[tuple[str, int]]:
    """Send TOTAL requests from CLIENTS threads, SIGKILL the gateway after KILL_AFTER answers; the answered
    ids and statuses."""
    answered: list[tuple[str, int]] = []
    lock = threading.Lock()
    killed = threading.Event()

    def one(client: httpx.Client, i: int) -> None:
        if killed.is_set():
            return
        try:
            response = request(client, i)
        except httpx.TransportError:
            return  # no answer: not acknowledged
        assert response.status_code in (200, 404), response.text
        with lock:
            answered.append((response.headers["x-request-id"], response.status_code))
            if len(answered) >= KILL_AFTER and not killed.is_set():
                killed.set()
                gateway.kill()

    headers = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as client, ThreadPoolExecutor(CLIENTS) as pool:
        for future in [pool.submit(one, client, i) for i in range(TOTAL)]:
            future.result()
    assert killed.is_set(), "the load ended before the gateway was killed"
    assert KILL_AFTER <= len(answered) < TOTAL
    return answered


def inferctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inferflux.gateway.cli", *args], capture_output=True, text=True, timeout=120, cwd=REPO
    )


def test_kill_9_under_load_loses_no_answered_event(tmp_path: Path) -> None:
    (tmp_path / "rsyslog").mkdir()
    siem = Rsyslog(rsyslogd_path(), tmp_path / "rsyslog")  # made, not started: the SIEM is down
    config = tmp_path / "inferflux.yaml"
    config.write_text(
        "audit:\n"
        "  chain_id: gw-e2e\n"
        "  sinks:\n"
        f"    - {{type: syslog, name: siem, host: 127.0.0.1, port: {siem.tcp_port}, transport: tcp}}\n"
    )
    data_dir = tmp_path / "data"
    admin_key = generate_key().token
    env = {**os.environ, "INFERFLUX_BOOTSTRAP_ADMIN_KEY": admin_key}
    log = tmp_path / "gateway.log"

    gateway = Replica("gateway", data_dir, env, log, ["--config", str(config)])
    gateway.wait_ready()
    answered = load_until_killed(gateway, admin_key)

    restarted = Replica("restarted gateway", data_dir, env, log, ["--config", str(config)])
    try:
        restarted.wait_ready()
        siem.start()
        after = httpx.get(restarted.url + "/v1/models", headers={"authorization": f"Bearer {admin_key}"}, timeout=30)
        assert after.status_code == 200
        expected = {rid for rid, status in answered if status == 200} | {after.headers["x-request-id"]}
        refused = {rid for rid, status in answered if status == 404}

        def arrived() -> set[str]:
            return {json.loads(r)["event"]["request_id"] for r in siem.records()}

        wait_for(lambda: expected <= arrived() and bool(refused & arrived()), timeout=90,
                 what="every answered request's event at the SIEM (of the refusals, the first)")  # fmt: skip
    finally:
        code = restarted.stop()
        siem.stop()
    assert "Traceback" not in restarted.output(), restarted.output()
    assert code in (0, -15), restarted.output()

    # What the SIEM holds is one hash chain, duplicates (at-least-once) aside.
    records = siem.records()
    delivered = verify_lines(((str(i), r) for i, r in enumerate(records)), allow_duplicates=True)
    assert delivered.ok, delivered.problem
    spool = data_dir / "audit"
    verified = inferctl("audit", "verify", "--spool", str(spool))
    assert verified.returncode == 0, verified.stdout + verified.stderr

    segments = segment_files(spool)
    segment = segments[len(segments) // 2]
    lines = segment.read_bytes().splitlines()
    middle = len(lines) // 2
    tampered = json.loads(lines[middle])
    tampered["event"]["status"] = 200 if tampered["event"]["status"] != 200 else 404
    lines[middle] = canonical_json(tampered)
    segment.write_bytes(b"\n".join(lines) + b"\n")
    verified = inferctl("audit", "verify", "--spool", str(spool))
    assert verified.returncode != 0
    assert f"{segment.name} line {middle + 1}" in verified.stdout + verified.stderr
