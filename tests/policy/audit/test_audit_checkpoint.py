"""Signed checkpoints make a cut tail visible (issue 18).

Before them, deleting the last records of a spool left a shorter chain that
verified OK. Now the spool's chain head is signed (HMAC-SHA256 under a key
derived from the store's secret) and kept in the store's
``audit_checkpoints`` table, and ``inferctl audit verify --spool DIR
--checkpoints`` checks the tail against the latest one:

* an intact spool verifies and says which checkpoint its tail reaches;
* cutting the last records reports exactly how many are missing (exit 1);
* a checkpoint signed with another key is reported as forged;
* a chain rewritten from some record on (every hash recomputed, which the
  unkeyed chain cannot see) no longer matches the checkpoint's hash.

On SQLite and PostgreSQL (the store's table), through the real CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from audit_support import make_event

from inferflux.gateway.cli import main
from inferflux.policy.audit.chain import sealed_line
from inferflux.policy.audit.checkpoint import CHECKPOINT_PURPOSE, Checkpointer, CheckpointSigner
from inferflux.policy.audit.cli import verify_spool
from inferflux.policy.audit.spool import Spool, SpoolSettings, segment_files
from inferflux.policy.audit.store import AuditStore
from inferflux.policy.store import PolicyStore, StoreSettings

EVENTS = 40


def write_with_checkpoint(spool_dir: Path, store: PolicyStore, events: int = EVENTS) -> Checkpointer:
    """``events`` events, then a checkpoint of them (its own record follows, at seq ``events``)."""
    signer = CheckpointSigner(store.derive_secret(CHECKPOINT_PURPOSE))
    with Spool.open(SpoolSettings(spool_dir, chain_id="gw-cp")) as spool:
        checkpointer = Checkpointer(spool, signer, every_events=10_000, keep=AuditStore(store.engine).add_checkpoint)
        assert all(spool.append(make_event()).wait(10) for _ in range(events))
        checkpoint = checkpointer.run_once(force=True)
        assert checkpoint is not None and checkpoint.seq == events - 1
        assert checkpointer.run_once(force=True) is None, "its own record makes no new checkpoint due"
    return checkpointer


def cut_lines(spool_dir: Path, count: int) -> None:
    segment = segment_files(spool_dir)[-1]
    lines = segment.read_bytes().splitlines(keepends=True)
    segment.write_bytes(b"".join(lines[:-count]))


def verify_cli(spool_dir: Path, data_dir: Path, store_settings: StoreSettings,
               monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:  # fmt: skip
    if store_settings.url is not None:
        monkeypatch.setenv("INFERFLUX_STORE_URL", store_settings.url)
    code = main(["audit", "verify", "--spool", str(spool_dir), "--checkpoints", "--data-dir", str(data_dir)])
    return code, capsys.readouterr().out


def test_an_intact_spool_reaches_its_checkpoint(
    store: PolicyStore, store_settings: StoreSettings, data_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    write_with_checkpoint(tmp_path / "spool", store)
    code, out = verify_cli(tmp_path / "spool", data_dir, store_settings, monkeypatch, capsys)
    assert code == 0, out
    assert "tail reaches the signed checkpoint" in out and f"seq {EVENTS - 1})" in out


@pytest.mark.parametrize("cut", [1, 5])
def test_a_cut_tail_is_reported_with_how_many_records_are_missing(
    cut: int, store: PolicyStore, store_settings: StoreSettings, data_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    spool_dir = tmp_path / "spool"
    write_with_checkpoint(spool_dir, store)
    assert verify_spool(spool_dir).ok, "without the checkpoint, the chain alone cannot see the cut"
    cut_lines(spool_dir, cut + 1)  # the last `cut` events, and the checkpoint's own record after them
    assert verify_spool(spool_dir).ok
    code, out = verify_cli(spool_dir, data_dir, store_settings, monkeypatch, capsys)
    assert code == 1, out
    assert f"TAMPERED: end of chain gw-cp (chain gw-cp, seq {EVENTS - cut}): {cut} records missing after seq " \
           f"{EVENTS - 1 - cut}: the signed checkpoint of " in out  # fmt: skip
    assert f"covers up to seq {EVENTS - 1} (the tail was cut)" in out


def test_a_forged_checkpoint_is_detected(
    store: PolicyStore, store_settings: StoreSettings, data_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    spool_dir = tmp_path / "spool"
    real = write_with_checkpoint(spool_dir, store).latest
    assert real is not None
    # Someone who can write the store's table but not derive its key: a later checkpoint, signed with their own.
    forger = CheckpointSigner(b"not the store's key, 32 bytes.." * 2)
    AuditStore(store.engine).add_checkpoint(forger.sign(real.chain, real.seq + 1, real.hash))
    code, out = verify_cli(spool_dir, data_dir, store_settings, monkeypatch, capsys)
    assert code == 1 and "signature that does not verify (forged, or signed with another key)" in out, out


def test_a_rewritten_chain_no_longer_matches_its_checkpoint(sqlite_store: PolicyStore, tmp_path: Path) -> None:
    """Changing a record and re-sealing every one after it fools the chain, not the signed head."""
    spool_dir = tmp_path / "spool"
    checkpoint = write_with_checkpoint(spool_dir, sqlite_store).latest
    assert checkpoint is not None
    segment = segment_files(spool_dir)[-1]
    records = [json.loads(line) for line in segment.read_bytes().splitlines()]
    records[10]["event"]["status"] = 200 if records[10]["event"]["status"] != 200 else 201
    prev, lines = records[0]["prev"], []
    for record in records:
        sealed, line = sealed_line(record["chain"], record["seq"], prev, record["event"])
        prev = sealed["hash"]
        lines.append(line + b"\n")
    segment.write_bytes(b"".join(lines))
    assert verify_spool(spool_dir).ok, "the unkeyed chain alone cannot see it"
    signer = CheckpointSigner(sqlite_store.derive_secret(CHECKPOINT_PURPOSE))
    report = verify_spool(spool_dir, checkpoint=checkpoint, signer=signer)
    assert not report.ok and "the chain was rewritten" in str(report.problem)


def test_checkpoints_are_due_by_count_or_time_and_not_for_their_own_record(
    sqlite_store: PolicyStore, tmp_path: Path
) -> None:
    now = [0.0]
    signer = CheckpointSigner(sqlite_store.derive_secret(CHECKPOINT_PURPOSE))
    with Spool.open(SpoolSettings(tmp_path / "spool")) as spool:
        checkpointer = Checkpointer(spool, signer, every_events=5, every_seconds=60, clock=lambda: now[0])
        assert checkpointer.run_once() is None  # nothing written yet
        assert all(spool.append(make_event()).wait(10) for _ in range(4))
        assert checkpointer.run_once() is None  # 4 < 5 events, 0 < 60 s
        assert spool.append(make_event()).wait(10)
        assert checkpointer.run_once().seq == 4  # type: ignore[union-attr]
        now[0] += 120
        assert checkpointer.run_once() is None, "only its own record since: an idle gateway writes none"
        assert spool.append(make_event()).wait(10)
        assert checkpointer.run_once().seq == 6  # type: ignore[union-attr]  # by time: one event after 60 s
