"""Delivery: per-sink cursors that survive restarts, retry with back-off, pruning only what all sinks have."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from audit_support import FAST, POLL, append_events, wait_for

from inferflux.policy.audit.cli import verify_files
from inferflux.policy.audit.delivery import Backoff, Delivery
from inferflux.policy.audit.errors import SinkError
from inferflux.policy.audit.sinks.file import FileSink
from inferflux.policy.audit.spool import Spool, SpooledRecord, SpoolSettings, segment_files


class FlakySink:
    """A sink in memory that fails while ``down`` is set: the receiver side of an outage."""

    def __init__(self, name: str = "flaky") -> None:
        self.name = name
        self.down = threading.Event()
        self.received: list[SpooledRecord] = []
        self.attempts = 0

    def send(self, records: Sequence[SpooledRecord]) -> None:
        self.attempts += 1
        if self.down.is_set():
            raise SinkError("receiver down")
        self.received.extend(records)

    def close(self) -> None:
        pass


def test_file_sink_gets_every_line_verbatim(spool: Spool, tmp_path: Path) -> None:
    sink = FileSink(tmp_path / "out" / "audit.jsonl")
    delivery = Delivery(spool, sink, backoff=FAST, poll_seconds=POLL).start()
    ids = append_events(spool, 40)
    assert delivery.wait_caught_up(15)
    delivery.stop()
    lines = sink.path.read_bytes().splitlines()
    assert [json.loads(line)["event"]["id"] for line in lines] == ids
    spooled = [line for p in segment_files(spool.settings.directory) for line in p.read_bytes().splitlines()]
    assert lines == spooled
    assert verify_files([sink.path]).records == 40
    assert sink.path.stat().st_mode & 0o777 == 0o600


def test_file_sink_rotates(spool: Spool, tmp_path: Path) -> None:
    sink = FileSink(tmp_path / "audit.jsonl", max_bytes=4000, backups=50)
    delivery = Delivery(spool, sink, batch_size=3, backoff=FAST, poll_seconds=POLL).start()
    append_events(spool, 30)
    assert delivery.wait_caught_up(15)
    delivery.stop()
    files = sink.rotated_files()
    assert len(files) > 2 and files[-1] == sink.path
    assert verify_files(files).records == 30  # oldest first, the chain runs through every file


def test_cursor_survives_restart_and_delivery_resumes(spool_dir: Path) -> None:
    settings = SpoolSettings(spool_dir, chain_id="gw-test")
    with Spool.open(settings) as spool:
        sink = FlakySink()
        delivery = Delivery(spool, sink, backoff=FAST, poll_seconds=POLL).start()
        first = append_events(spool, 10)
        assert delivery.wait_caught_up(10)
        delivery.stop()
        sink.down.set()
        second = append_events(spool, 10)  # the sink is not even running
    assert [r.event["id"] for r in sink.received] == first
    with Spool.open(settings) as spool:
        restarted = FlakySink()
        restarted.down.set()
        delivery = Delivery(spool, restarted, backoff=FAST, poll_seconds=POLL).start()
        wait_for(lambda: restarted.attempts >= 3, what="retries while the receiver is down")
        assert not delivery.caught_up() and delivery.stats.last_error == "SinkError: receiver down"
        restarted.down.clear()
        assert delivery.wait_caught_up(10)
        delivery.stop()
    assert [r.event["id"] for r in restarted.received] == second  # resumed at its cursor, no gap


def test_sinks_are_independent(spool: Spool) -> None:
    slow, fast = FlakySink("down"), FlakySink("up")
    slow.down.set()
    deliveries = [Delivery(spool, s, backoff=FAST, poll_seconds=POLL).start() for s in (slow, fast)]
    ids = append_events(spool, 20)
    assert deliveries[1].wait_caught_up(10)
    assert [r.event["id"] for r in fast.received] == ids and slow.received == []
    for delivery in deliveries:
        delivery.stop()


def test_segments_are_deleted_only_after_every_sink_delivered_them(spool_dir: Path) -> None:
    with Spool.open(SpoolSettings(spool_dir, segment_bytes=2500)) as spool:
        ahead, behind = FlakySink("ahead"), FlakySink("behind")
        behind.down.set()
        deliveries = [
            Delivery(spool, s, batch_size=2, backoff=FAST, poll_seconds=POLL).start() for s in (ahead, behind)
        ]
        append_events(spool, 40, one_by_one=True)
        assert deliveries[0].wait_caught_up(10)
        assert spool.prune() == 0  # "behind" has delivered nothing: every segment stays
        total = len(segment_files(spool_dir))
        assert total >= 4
        behind.down.clear()
        assert deliveries[1].wait_caught_up(10)
        spool.prune()
        remaining = segment_files(spool_dir)
        assert len(remaining) < total and remaining[-1].stat().st_size > 0
        for delivery in deliveries:
            delivery.stop()
        # A new sink starts at the oldest segment left.
        later = Delivery(spool, FlakySink("late"), backoff=FAST, poll_seconds=POLL)
        assert later.stats.cursor.segment == int(remaining[0].stem)


def test_retention_keeps_delivered_segments_for_a_while(spool_dir: Path) -> None:
    with Spool.open(SpoolSettings(spool_dir, segment_bytes=2500, retain_seconds=3600)) as spool:
        delivery = Delivery(spool, FlakySink(), backoff=FAST, poll_seconds=POLL).start()
        append_events(spool, 30, one_by_one=True)
        assert delivery.wait_caught_up(10)
        delivery.stop()
        count = len(segment_files(spool_dir))
        assert spool.prune() == 0 and len(segment_files(spool_dir)) == count
        assert spool.prune(now=time.time() + 7200) > 0


def test_no_sink_means_nothing_is_pruned(spool: Spool, spool_dir: Path) -> None:
    append_events(spool, 5)
    assert spool.prune() == 0 and len(segment_files(spool_dir)) == 1


def test_backoff_is_exponential_with_full_jitter() -> None:
    backoff = Backoff(initial=0.1, maximum=5.0)
    rng = random.Random(7)
    for attempt, ceiling in [(0, 0.1), (1, 0.2), (3, 0.8), (10, 5.0), (1000, 5.0)]:
        delays = [backoff.delay(attempt, rng) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        assert max(delays) > ceiling * 0.8 and min(delays) < ceiling * 0.2  # spread over the whole range


def test_the_default_backoff_retries_a_returning_sink_within_two_seconds() -> None:
    # However long the outage, the next attempt is at most 2 s away: a sink that comes back
    # gets its backlog within a few seconds (tests/policy/audit/test_audit_http.py times it).
    rng = random.Random(11)
    delays = [Backoff().delay(attempt, rng) for attempt in range(0, 200, 3) for _ in range(50)]
    assert max(delays) <= 2.0 and max(delays) > 1.9


def test_bad_delivery_settings(spool: Spool, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Delivery(spool, FlakySink(), batch_size=0)
    with pytest.raises(ValueError):
        FileSink(tmp_path / "x", max_bytes=0)


def test_linger_gathers_a_trickle_into_few_batches(spool: Spool) -> None:
    # 20 events, one every 10 ms: without a linger each is its own batch (a send,
    # a commit, a cursor write); with 0.5 s they go in one or two.
    sinks = {linger: FlakySink(f"linger-{linger}") for linger in (0.0, 0.5)}
    deliveries = [
        Delivery(spool, sink, backoff=FAST, poll_seconds=POLL, linger_seconds=linger).start()
        for linger, sink in sinks.items()
    ]
    ids = []
    for _ in range(20):
        ids += append_events(spool, 1)
        time.sleep(0.01)
    for delivery in deliveries:
        assert delivery.wait_caught_up(10)
        delivery.stop()
    for sink in sinks.values():
        assert [r.event["id"] for r in sink.received] == ids
    assert sinks[0.5].attempts <= 2 < 10 <= sinks[0.0].attempts


def test_a_stop_during_the_linger_still_delivers(spool: Spool) -> None:
    sink = FlakySink()
    delivery = Delivery(spool, sink, backoff=FAST, poll_seconds=POLL, linger_seconds=30).start()
    ids = append_events(spool, 3)
    time.sleep(0.2)  # the delivery is lingering now
    start = time.monotonic()
    delivery.stop()
    assert time.monotonic() - start < 5
    assert [r.event["id"] for r in sink.received] == ids


@pytest.mark.parametrize("linger", [-1, 61, True, "0.2"])
def test_linger_must_be_a_sensible_number(spool: Spool, linger: object) -> None:
    with pytest.raises(ValueError, match="linger_seconds"):
        Delivery(spool, FlakySink(), linger_seconds=linger)  # type: ignore[arg-type]
