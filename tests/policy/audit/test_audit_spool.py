"""The spool: non-blocking append, batched fsync, durable receipts, torn tails, restart continuity."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from audit_support import make_event

from inferflux.policy.audit.chain import GENESIS, parse_record
from inferflux.policy.audit.cli import verify_spool
from inferflux.policy.audit.errors import AuditUnavailable, SpoolConfigError
from inferflux.policy.audit.spool import Cursor, Receipt, Spool, SpoolSettings, segment_files


def records_of(directory: Path) -> list[dict[str, object]]:
    return [parse_record(line) for path in segment_files(directory) for line in path.read_bytes().splitlines()]


def test_fsync_is_per_batch_not_per_event(spool_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    segment_syncs = 0
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        nonlocal segment_syncs
        if "/segments/" in os.readlink(f"/proc/self/fd/{fd}") and os.path.isfile(f"/proc/self/fd/{fd}"):
            segment_syncs += 1
            time.sleep(0.002)  # a disk's flush takes milliseconds; tmpfs's takes none
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    with Spool.open(SpoolSettings(spool_dir)) as spool:
        syncs_at_open = segment_syncs
        receipts = [spool.append(make_event()) for _ in range(2000)]
        assert all(r.wait(30) for r in receipts)
        stats = spool.stats
    syncs = segment_syncs - syncs_at_open
    assert stats.events == 2000 and stats.fsyncs == stats.batches == syncs
    assert 1 <= syncs < 2000 / 4, syncs  # each fsync covers what was written meanwhile: far fewer than events
    assert [r.seq for r in receipts] == list(range(2000))
    assert verify_spool(spool_dir).records == 2000


def test_an_interval_spaces_the_fsyncs_and_close_does_not_wait_for_it(
    spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced_at: list[float] = []
    real_fsync = os.fsync

    def timed_fsync(fd: int) -> None:
        if "/segments/" in os.readlink(f"/proc/self/fd/{fd}"):
            synced_at.append(time.monotonic())
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", timed_fsync)
    spool = Spool.open(SpoolSettings(spool_dir, sync_interval_seconds=0.2))
    first = spool.append(make_event())
    assert first.wait(5)  # after a quiet spell the first event is fsynced at once
    synced_at.clear()
    receipts = []
    for _ in range(20):  # a trickle: one event every 20 ms for 0.4 s
        receipts.append(spool.append(make_event()))
        time.sleep(0.02)
    assert receipts[-1].wait(5)
    gaps = [b - a for a, b in zip(synced_at, synced_at[1:])]
    assert 1 <= len(synced_at) <= 4 and all(gap >= 0.19 for gap in gaps), (synced_at, gaps)  # not one per event
    late = spool.append(make_event())
    started = time.monotonic()
    spool.close()  # flushes what is written without waiting out the interval
    assert time.monotonic() - started < 0.15 and late.wait(0) and late.seq == 21
    assert verify_spool(spool_dir).records == 22


def test_append_never_blocks_and_receipts_resolve_in_order(spool: Spool) -> None:
    receipts = [spool.append(make_event()) for _ in range(50)]
    assert receipts[-1].wait(10)
    assert all(r.done() for r in receipts)  # a batch is durable as a whole, in order


async def test_receipts_can_be_awaited(spool: Spool) -> None:
    receipts = [spool.append(make_event()) for _ in range(20)]
    await asyncio.wait_for(asyncio.gather(*(r.durable() for r in receipts)), 10)
    await asyncio.wait_for(receipts[0], 1)  # awaiting a resolved receipt returns at once
    assert receipts[-1].seq == 19


def test_appends_from_many_threads_make_one_whole_chain(spool: Spool, spool_dir: Path) -> None:
    # append() seals and writes on the caller's thread: concurrent callers must
    # still get consecutive seqs, each line whole and chained to the one before.
    def append_many(n: int) -> list[Receipt]:
        return [spool.append(make_event()) for _ in range(n)]

    with ThreadPoolExecutor(4) as pool:
        receipts = [r for batch in pool.map(append_many, [200] * 4) for r in batch]
    assert all(r.wait(10) for r in receipts)
    assert sorted(r.seq for r in receipts) == list(range(800))
    assert [r["seq"] for r in records_of(spool_dir)] == list(range(800))
    assert verify_spool(spool_dir).ok


async def test_one_fsync_wakes_a_waiting_loop_once(spool: Spool, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    wakeups = 0
    real = loop.call_soon_threadsafe

    def counting(*args: object) -> object:
        nonlocal wakeups
        wakeups += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (time.sleep(0.05), real_fsync(fd)))  # a slow disk: one batch
    receipts = [spool.append(make_event()) for _ in range(20)]
    await asyncio.wait_for(asyncio.gather(*(r.durable() for r in receipts)), 10)
    assert 1 <= wakeups <= 2 and spool.stats.batches <= 2  # not one per receipt


def test_a_full_queue_refuses_rather_than_blocks(spool_dir: Path) -> None:
    with Spool.open(SpoolSettings(spool_dir, max_pending=5)) as spool:
        with pytest.raises(AuditUnavailable) as caught:
            for _ in range(10_000):
                spool.append(make_event())
        assert caught.value.status_code == 503 and caught.value.code == "audit_unavailable"
    with pytest.raises(AuditUnavailable):
        spool.append(make_event())  # closed


def test_a_failed_write_fails_its_receipts_and_keeps_the_chain_whole(
    spool: Spool, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert spool.append(make_event()).wait(10)
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    failed = spool.append(make_event())
    with pytest.raises(AuditUnavailable):
        failed.wait(10)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert spool.append(make_event()).wait(10)
    assert spool.stats.failed == 1
    assert [r["seq"] for r in records_of(spool_dir)] == [0, 1]
    assert verify_spool(spool_dir).ok


def test_a_failed_write_fails_that_event_alone_and_cuts_its_partial_line(
    spool: Spool, spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = spool.append(make_event())
    real_write = os.write

    def half_then_full_disk(fd: int, data: bytes) -> int:
        real_write(fd, data[: len(data) // 2])  # part of the line reaches the file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full_disk)
    failed = spool.append(make_event())
    monkeypatch.setattr(os, "write", real_write)
    after = spool.append(make_event())
    assert before.wait(10) and after.wait(10)
    with pytest.raises(AuditUnavailable):
        failed.wait(10)
    assert [r["seq"] for r in records_of(spool_dir)] == [0, 1] and verify_spool(spool_dir).ok
    assert spool.stats.failed == 1


def test_a_failed_fsync_after_rotations_keeps_the_chain_whole(spool_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Spool.open(SpoolSettings(spool_dir, segment_bytes=1500)) as spool:
        # One by one, two lines a segment: the 4th fills the 2nd segment, so the fsync that
        # fails is the first one after a rotation.
        assert all(spool.append(make_event()).wait(10) for _ in range(4))
        real_fsync = os.fsync
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(5, "I/O error")))
        with pytest.raises(AuditUnavailable):
            spool.append(make_event()).wait(10)
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert all(spool.append(make_event()).wait(10) for _ in range(3))
    assert len(segment_files(spool_dir)) > 1
    assert [r["seq"] for r in records_of(spool_dir)] == list(range(7)) and verify_spool(spool_dir).ok


def test_an_event_that_cannot_be_encoded_fails_alone(spool: Spool, spool_dir: Path) -> None:
    before = spool.append(make_event())
    bad = spool.append(make_event(route="POST /\ud800"))  # a lone surrogate has no UTF-8 encoding
    after = spool.append(make_event())
    assert before.wait(10) and after.wait(10)
    with pytest.raises(AuditUnavailable):
        bad.wait(10)
    assert [r["seq"] for r in records_of(spool_dir)] == [0, 1] and verify_spool(spool_dir).ok


def test_restart_continues_the_chain(spool_dir: Path) -> None:
    settings = SpoolSettings(spool_dir)
    with Spool.open(settings) as spool:
        chain = spool.chain_id
        assert all(spool.append(make_event()).wait(10) for _ in range(5))
    with Spool.open(settings) as spool:
        assert spool.chain_id == chain
        assert spool.append(make_event()).wait(10)
    records = records_of(spool_dir)
    assert [r["seq"] for r in records] == list(range(6))
    assert records[0]["prev"] == GENESIS and records[5]["prev"] == records[4]["hash"]
    assert verify_spool(spool_dir).ok


@pytest.mark.parametrize("torn", [b'{"chain":"gw-test","event":{"id":"aev_', b"{", b"\x00\x00\x00"])
def test_a_torn_last_line_is_cut_off_on_open(spool_dir: Path, torn: bytes) -> None:
    settings = SpoolSettings(spool_dir, chain_id="gw-test")
    with Spool.open(settings) as spool:
        assert all(spool.append(make_event()).wait(10) for _ in range(3))
    (segment,) = segment_files(spool_dir)
    good = segment.read_bytes()
    with segment.open("ab") as f:
        f.write(torn)  # what a crash in the middle of a write leaves
    assert not verify_spool(spool_dir).ok
    with Spool.open(settings) as spool:
        assert segment.read_bytes() == good
        receipt = spool.append(make_event())
        assert receipt.wait(10) and receipt.seq == 3
    assert verify_spool(spool_dir).records == 4


def test_segments_rotate_by_size_and_restart_picks_the_newest(spool_dir: Path) -> None:
    settings = SpoolSettings(spool_dir, segment_bytes=3000)
    with Spool.open(settings) as spool:
        assert all(spool.append(make_event()).wait(10) for _ in range(20))
    first = segment_files(spool_dir)
    assert len(first) >= 4
    assert all(p.stat().st_size < 3000 + 2000 for p in first)  # one receipt waited for at a time: one line over at most
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in first)
    with Spool.open(settings) as spool:
        assert spool.append(make_event()).wait(10)
    assert verify_spool(spool_dir).records == 21


def test_readers_see_only_durable_records_in_order(spool: Spool) -> None:
    start = spool.register_sink("reader")
    assert spool.read(start, wait=0.05) == ([], start)
    receipts = [spool.append(make_event(request_id=f"r{i}")) for i in range(10)]
    assert receipts[-1].wait(10)
    records, after = spool.read(start, max_records=4)
    assert [r.event["request_id"] for r in records] == ["r0", "r1", "r2", "r3"]
    rest, end = spool.read(after, max_records=100)
    assert [r.seq for r in rest] == list(range(4, 10)) and end == spool.durable_cursor()


def test_one_spool_per_directory(spool: Spool, spool_dir: Path) -> None:
    with pytest.raises(SpoolConfigError, match="in use by another process"):
        Spool.open(SpoolSettings(spool_dir))


def test_a_spool_keeps_its_chain_id(spool_dir: Path) -> None:
    Spool.open(SpoolSettings(spool_dir, chain_id="gw-a")).close()
    with pytest.raises(SpoolConfigError, match="belongs to chain 'gw-a'"):
        Spool.open(SpoolSettings(spool_dir, chain_id="gw-b"))


@pytest.mark.parametrize("bad", [{"segment_bytes": 0}, {"max_pending": True}, {"retain_seconds": -1},
                                 {"sync_interval_seconds": -0.1}, {"sync_interval_seconds": float("nan")},
                                 {"chain_id": "has space"}])  # fmt: skip
def test_bad_settings_are_clear_errors(tmp_path: Path, bad: dict[str, object]) -> None:
    with pytest.raises(SpoolConfigError):
        SpoolSettings(tmp_path, **bad)  # type: ignore[arg-type]


def test_an_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SpoolConfigError, match="cannot use the audit spool directory"):
        Spool.open(SpoolSettings(blocker / "spool"))


def test_cursors_are_saved_atomically_and_survive(spool: Spool, spool_dir: Path) -> None:
    spool.save_cursor("siem", Cursor(3, 1234))
    assert spool.load_cursor("siem") == Cursor(3, 1234)
    assert [p.name for p in (spool_dir / "cursors").iterdir()] == ["siem.json"]  # no temporary left
    (spool_dir / "cursors" / "siem.json").write_text("{torn")
    assert spool.load_cursor("siem") is None  # unreadable: start over (re-deliver), never skip
    with pytest.raises(ValueError):
        spool.save_cursor("../escape", Cursor(1, 0))
