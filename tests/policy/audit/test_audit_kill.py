"""kill -9 of a writer mid-stream: every acknowledged event still arrives, the chain verifies, tampering shows.

A child process (``audit_child.py``) appends 1,000 events from eight threads
and prints each id once its event is durable, with its sink's receiver down.
The test kills it with SIGKILL midway, opens the spool again with the sink,
starts the receiver, and checks what arrives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from audit_support import FAST, HttpReceiver, Rsyslog, append_events, sink_from_args, wait_for

from inferflux.policy.audit.chain import canonical_json, verify_lines
from inferflux.policy.audit.cli import verify_spool
from inferflux.policy.audit.delivery import Delivery
from inferflux.policy.audit.spool import Spool, SpoolSettings, segment_files

# A child process writing 1,000 events, killed with SIGKILL (the tiers: tests/conftest.py).
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
CHILD = Path(__file__).with_name("audit_child.py")
TOTAL, KILL_AFTER = 1000, 400


def run_and_kill(spool_dir: Path, sink_args: list[str]) -> list[str]:
    """Start the child, SIGKILL it after KILL_AFTER acknowledgements; every id it acknowledged."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(CHILD.parent), str(REPO / "tests" / "support")])}
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(spool_dir), str(TOTAL), *sink_args],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=REPO,
    )  # fmt: skip
    acked: list[str] = []
    killed = threading.Timer(120, child.kill)  # never outlive a broken test
    killed.start()
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.endswith(b"\n"):
                acked.append(line.decode().strip())
            if len(acked) == KILL_AFTER:
                os.kill(child.pid, signal.SIGKILL)
        # Lines already written before the kill are acknowledgements too; the loop read them all.
    finally:
        killed.cancel()
        child.wait(30)
    assert child.returncode == -signal.SIGKILL, "the child ended before it was killed"
    assert KILL_AFTER <= len(acked) < TOTAL
    return acked


def received_ids(records: list[bytes]) -> list[str]:
    return [json.loads(r)["event"]["id"] for r in records]


@pytest.mark.parametrize("receiver_kind", ["http", "rsyslog-tcp"])
def test_kill_9_loses_no_acknowledged_event(
    receiver_kind: str, tmp_path: Path, http_receiver: Callable[..., HttpReceiver], request: pytest.FixtureRequest
) -> None:
    receiver: HttpReceiver | Rsyslog
    if receiver_kind == "http":
        receiver = http_receiver()  # created, not started: the SIEM is down
        sink_args = ["http", receiver.url]
    else:
        receiver = request.getfixturevalue("rsyslog")
        receiver.stop()
        sink_args = ["syslog-tcp", str(receiver.tcp_port)]
    spool_dir = tmp_path / "spool"

    acked = run_and_kill(spool_dir, sink_args)

    # Delivered segments are kept an hour (retention), so the whole chain can be verified below.
    with Spool.open(SpoolSettings(spool_dir, chain_id="gw-kill", retain_seconds=3600)) as spool:
        delivery = Delivery(spool, sink_from_args(sink_args), backoff=FAST).start()
        wait_for(lambda: delivery.stats.failures >= 2, what="delivery failing while the receiver is down")
        receiver.start()
        after_restart = append_events(spool, 10)  # the chain goes on after the crash
        assert delivery.wait_caught_up(60)
        wait_for(lambda: set(acked + after_restart) <= set(received_ids(receiver.records())), timeout=30,
                 what="every acknowledged event at the receiver")  # fmt: skip
        delivery.stop()

    records = receiver.records()
    assert set(acked) <= set(received_ids(records))  # at least once; duplicates carry the same id
    delivered = verify_lines(((str(i), r) for i, r in enumerate(records)), allow_duplicates=True)
    assert delivered.ok, delivered.problem
    report = verify_spool(spool_dir)
    assert report.ok, report.problem
    (chain,) = report.chains
    assert chain.first_seq == 0 and chain.records >= len(acked) + 10
    assert delivered.chains[0].last_hash == chain.last_hash  # the SIEM holds the spool's whole chain

    segments = segment_files(spool_dir)
    segment = segments[len(segments) // 2]
    lines = segment.read_bytes().splitlines()
    middle = len(lines) // 2
    tampered = json.loads(lines[middle])
    tampered["event"]["decision"] = "deny"
    lines[middle] = canonical_json(tampered)
    segment.write_bytes(b"\n".join(lines) + b"\n")
    report = verify_spool(spool_dir)
    assert report.problem is not None and report.problem.location == f"{segment.name} line {middle + 1}"
