"""``AuditTrail``: record (written, or fsynced with wait_durable, before it returns), tail as SSE, deliver, status, close."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path

import pytest
from audit_support import FAST, make_event

from inferflux.policy.audit.cli import verify_files, verify_spool
from inferflux.policy.audit.errors import AuditUnavailable
from inferflux.policy.audit.events import admin_event
from inferflux.policy.audit.sinks.file import FileSink
from inferflux.policy.audit.spool import Spool, SpoolSettings
from inferflux.policy.audit.tail import Dropped, sse_message
from inferflux.policy.audit.trail import AuditTrail


async def test_record_tail_deliver_close(spool_dir: Path, tmp_path: Path) -> None:
    spool = Spool.open(SpoolSettings(spool_dir))
    trail = AuditTrail(spool, [FileSink(tmp_path / "audit.jsonl")], backoff=FAST, wait_durable=True).start()
    subscription = trail.subscribe("ten_a")
    event = make_event()
    await asyncio.wait_for(trail.record(event), 10)
    assert spool.stats.events == 1 and spool.stats.pending == 0  # durable when record() returned
    await trail.record(admin_event(principal="key:root", action="tenant.create", target_kind="tenant"))
    item = await asyncio.wait_for(anext(aiter(subscription)), 10)
    frame = sse_message(item)
    assert frame.startswith(f"id: {spool.chain_id}:0\nevent: audit\ndata: ".encode()) and frame.endswith(b"\n\n")
    assert json.loads(frame.split(b"data: ", 1)[1])["event"]["id"] == event.id
    assert trail.deliveries[0].wait_caught_up(10)
    status = trail.status()
    assert status["spool"]["events"] == 2 and status["sinks"]["file"]["caught_up"] is True
    trail.close()
    with pytest.raises(AuditUnavailable):
        await trail.record(make_event())
    assert verify_spool(spool_dir).records == 2 and verify_files([tmp_path / "audit.jsonl"]).records == 2


def test_dropped_marker_as_sse() -> None:
    frame = sse_message(Dropped("too slow", 41))
    assert frame == b'event: dropped\ndata: {"dropped":true,"last_seq":41,"reason":"too slow"}\n\n'


def test_sink_names_must_be_distinct(spool: Spool, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="distinct names"):
        AuditTrail(spool, [FileSink(tmp_path / "a"), FileSink(tmp_path / "b")])


async def test_record_returns_once_written_and_waits_for_the_fsync_only_when_asked(
    spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default answers once the line is in the kernel (what survives kill -9); wait_durable also waits for fsync."""
    release = threading.Event()
    real_fsync = os.fsync

    def stuck_fsync(fd: int) -> None:  # a disk that takes its time
        release.wait(10)
        real_fsync(fd)

    spool = Spool.open(SpoolSettings(spool_dir))
    monkeypatch.setattr(os, "fsync", stuck_fsync)
    try:
        written = make_event()
        await asyncio.wait_for(AuditTrail(spool).record(written), 5)  # no fsync has finished
        assert spool.stats.events == 0 and spool.stats.pending == 1
        segment = spool.segment_paths()[-1]
        assert json.loads(segment.read_bytes().splitlines()[-1])["event"]["id"] == written.id
        waiting = asyncio.ensure_future(AuditTrail(spool, wait_durable=True).record(make_event()))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        release.set()
        await asyncio.wait_for(waiting, 10)
        assert spool.stats.events == 2 and spool.stats.pending == 0
    finally:
        release.set()
        spool.close()


async def test_a_failed_write_is_refused_without_waiting(spool: Spool, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(fd: int, data: bytes) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(AuditUnavailable):
        await asyncio.wait_for(AuditTrail(spool).record(make_event()), 5)
