"""The hash chain and ``inferctl audit verify``: a changed, removed, inserted or reordered record is found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from audit_support import make_event

from inferflux.gateway.cli import main
from inferflux.policy.audit.chain import GENESIS, canonical_json, seal, sealed_line, verify_lines
from inferflux.policy.audit.cli import verify_files, verify_spool
from inferflux.policy.audit.spool import Spool, SpoolSettings, segment_files


def chain_lines(n: int, chain: str = "gw-1") -> list[bytes]:
    lines, prev = [], GENESIS
    for seq in range(n):
        record = seal(chain, seq, prev, make_event(request_id=f"r{seq}").to_json())
        lines.append(canonical_json(record))
        prev = record["hash"]
    return lines


@pytest.mark.parametrize("request_id", ["r1", "Zürich \u2028 \"quoted\" \\ \x01 \U0001f600", None])
def test_sealed_line_is_the_canonical_encoding_of_the_sealed_record(request_id: str | None) -> None:
    event = make_event(request_id=request_id, latency_ms=0.1 + 0.2).to_json()
    record, line = sealed_line("gw-1.a_b", 12345678901, "f" * 64, event)
    assert record == seal("gw-1.a_b", 12345678901, "f" * 64, event)
    assert line == canonical_json(record)


def check(lines: list[bytes], **kwargs: bool) -> tuple[bool, str | None, int | None]:
    report = verify_lines(((f"line {i + 1}", line) for i, line in enumerate(lines)), **kwargs)
    if report.problem is None:
        return True, None, None
    return False, report.problem.location, report.problem.seq


def edit(line: bytes, **changes: object) -> bytes:
    record = json.loads(line)
    record["event"].update(changes)
    return canonical_json(record)


def test_an_intact_chain_verifies() -> None:
    lines = chain_lines(20)
    assert check(lines) == (True, None, None)
    report = verify_lines((str(i), line) for i, line in enumerate(lines))
    (summary,) = report.chains
    assert (summary.first_seq, summary.last_seq, summary.records, summary.pruned_before) == (0, 19, 20, False)


def test_a_changed_event_is_found() -> None:
    lines = chain_lines(10)
    lines[4] = edit(lines[4], tenant_id="ten_evil")
    assert check(lines) == (False, "line 5", None)  # the line itself no longer matches its hash


def test_a_changed_event_with_a_recomputed_hash_breaks_the_next_link() -> None:
    lines = chain_lines(10)
    record = json.loads(lines[4])
    record["event"]["decision"] = "deny"
    lines[4] = canonical_json(seal(record["chain"], record["seq"], record["prev"], record["event"]))
    assert json.loads(lines[4])["hash"] != record["hash"]
    assert check(lines) == (False, "line 6", 5)


def test_a_removed_event_is_found() -> None:
    lines = chain_lines(10)
    del lines[3]
    assert check(lines) == (False, "line 4", 4)


def test_an_inserted_event_is_found() -> None:
    lines = chain_lines(10)
    forged = json.loads(lines[2])
    forged = seal("gw-1", 3, forged["hash"], make_event(request_id="forged").to_json())
    lines.insert(3, canonical_json(forged))
    assert check(lines) == (False, "line 5", 3)  # the real seq 3 now follows the forged one


def test_reordered_events_are_found() -> None:
    lines = chain_lines(10)
    lines[5], lines[6] = lines[6], lines[5]
    assert check(lines) == (False, "line 6", 6)


def test_a_record_that_is_no_record_is_found() -> None:
    lines = chain_lines(3)
    lines[1] = b'{"not": "a record"}'
    assert check(lines)[:2] == (False, "line 2")
    lines[1] = b"\x00garbage"
    assert check(lines)[:2] == (False, "line 2")


def test_record_zero_must_start_from_genesis() -> None:
    record = seal("gw-1", 0, "1" * 64, make_event().to_json())
    assert check([canonical_json(record)])[0] is False


def test_each_replica_chain_is_checked_on_its_own() -> None:
    a, b = chain_lines(5, "gw-a"), chain_lines(5, "gw-b")
    interleaved = [line for pair in zip(a, b, strict=True) for line in pair]
    assert check(interleaved)[0] is True
    report = verify_lines((str(i), line) for i, line in enumerate(interleaved))
    assert [c.chain for c in report.chains] == ["gw-a", "gw-b"]
    del interleaved[4]  # gw-a's seq 2
    assert check(interleaved) == (False, "line 6", 3)


def test_redeliveries_are_skipped_only_where_allowed() -> None:
    lines = chain_lines(6)
    redelivered = lines[:4] + lines[2:]  # a sink crashed after 3 and sent 2..5 again
    assert check(redelivered, allow_duplicates=True) == (True, None, None)
    assert check(redelivered)[0] is False
    forged_copy = edit(lines[2], status=500)
    assert check(lines[:4] + [forged_copy] + lines[4:], allow_duplicates=True)[0] is False


def test_a_pruned_start_is_reported_not_rejected() -> None:
    lines = chain_lines(10)[4:]
    report = verify_lines((str(i), line) for i, line in enumerate(lines))
    assert report.ok and report.chains[0].first_seq == 4 and report.chains[0].pruned_before


def test_verify_spool_and_the_cli(spool_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Spool.open(SpoolSettings(spool_dir, segment_bytes=2000)) as spool:
        assert all(spool.append(make_event()).wait(10) for _ in range(30))  # one by one: segments rotate
    segments = segment_files(spool_dir)
    assert len(segments) > 1  # the chain continues across segment files
    assert verify_spool(spool_dir).records == 30
    assert main(["audit", "verify", "--spool", str(spool_dir)]) == 0
    out = capsys.readouterr().out
    assert "OK: 1 chain(s), 30 records verified" in out
    assert "not checked" in out and "--checkpoints" in out  # a spool's cut end needs the signed checkpoint

    lines = segments[1].read_bytes().splitlines()
    lines[1] = edit(lines[1], model="other")
    segments[1].write_bytes(b"\n".join(lines) + b"\n")
    assert main(["audit", "verify", "--spool", str(spool_dir)]) == 1
    out = capsys.readouterr().out
    assert f"TAMPERED: {segments[1].name} line 2" in out and "changed" in out


def test_cli_on_files_and_unreadable_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = chain_lines(8)
    older, newer = tmp_path / "audit.jsonl.1", tmp_path / "audit.jsonl"
    older.write_bytes(b"\n".join(lines[:5]) + b"\n")
    newer.write_bytes(b"\n".join(lines[3:]) + b"\n")  # a redelivery across the rotation
    assert main(["audit", "verify", "--file", str(older), "--file", str(newer)]) == 0
    assert "2 identical re-delivered records skipped" in capsys.readouterr().out
    assert verify_files([newer, older]).ok is False  # wrong order: seq goes back
    assert main(["audit", "verify", "--file", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read the audit trail" in capsys.readouterr().err
    assert main(["audit", "verify", "--spool", str(tmp_path)]) == 2
