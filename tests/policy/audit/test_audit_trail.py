"""``AuditTrail``: record (durable before it returns), tail as SSE, deliver, report status, close."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from audit_support import FAST, make_event

from policy.audit.cli import verify_files, verify_spool
from policy.audit.errors import AuditUnavailable
from policy.audit.events import admin_event
from policy.audit.sinks.file import FileSink
from policy.audit.spool import Spool, SpoolSettings
from policy.audit.tail import Dropped, sse_message
from policy.audit.trail import AuditTrail


async def test_record_tail_deliver_close(spool_dir: Path, tmp_path: Path) -> None:
    spool = Spool.open(SpoolSettings(spool_dir))
    trail = AuditTrail(spool, [FileSink(tmp_path / "audit.jsonl")], backoff=FAST).start()
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
