"""``RefusalAggregator``: the first refusal of a key at once, repeats counted per window, the key space bounded."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from audit_support import make_event

from inferflux.policy.audit.refusals import OVERFLOW, RefusalAggregator
from inferflux.policy.audit.spool import Spool, SpoolSettings, segment_files
from inferflux.policy.audit.trail import AuditTrail


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def refusal(caller: str = "addr:10.0.0.1", route: str = "GET /admin/v1/tenants") -> tuple[tuple[str, str, int, str], object]:
    event = make_event(decision="deny", principal=caller, route=route, status=401, reasons=("invalid_api_key",))
    return (caller, route, 401, "invalid_api_key"), event


def test_first_at_once_repeats_counted_until_the_window_ends() -> None:
    clock = Clock()
    aggregator = RefusalAggregator(10, clock=clock)
    key, event = refusal()
    assert aggregator.admit(key, event) is True
    assert [aggregator.admit(key, refusal()[1]) for _ in range(5)] == [False] * 5
    assert aggregator.due() == []  # the window is still open
    clock.now = 10
    [aggregate] = aggregator.due()
    assert aggregate.detail["aggregated"] == 5 and aggregate.principal == "addr:10.0.0.1"
    assert aggregate.id != event.id and aggregate.prompt_hmac is None and aggregate.status == 401
    assert aggregator.admit(key, refusal()[1]) is True, "a new window starts with a written event"


def test_a_window_without_repeats_writes_nothing_more_and_shutdown_flushes_open_ones() -> None:
    clock = Clock()
    aggregator = RefusalAggregator(10, clock=clock)
    a, b = refusal("addr:a"), refusal("addr:b")
    assert aggregator.admit(*a) and aggregator.admit(*b) and not aggregator.admit(b[0], refusal("addr:b")[1])
    clock.now = 3
    assert aggregator.due() == []
    assert [e.detail["aggregated"] for e in aggregator.due(everything=True)] == [1]
    assert aggregator.open_windows() == 0


def test_the_number_of_open_windows_is_bounded() -> None:
    clock = Clock()
    aggregator = RefusalAggregator(10, max_keys=10, clock=clock)
    written = sum(aggregator.admit(*refusal(f"addr:{i}", f"GET /x/{i}")) for i in range(1000))
    assert written == 11, "ten callers' windows, then one shared overflow window"
    events = aggregator.due(everything=True)
    [overflow] = events
    assert overflow.detail["aggregated"] == 989 and overflow.detail["callers"] == "many"
    assert overflow.principal is None and overflow.route is None
    assert aggregator.open_windows() == 0 and OVERFLOW == "*overflow*"


def test_zero_seconds_writes_every_refusal() -> None:
    aggregator = RefusalAggregator(0)
    assert all(aggregator.admit(*refusal()) for _ in range(3)) and aggregator.due(everything=True) == []


async def test_the_trail_writes_aggregates_when_their_window_ends_and_at_close(tmp_path: Path) -> None:
    spool = Spool.open(SpoolSettings(tmp_path / "spool"))
    trail = AuditTrail(spool, refusals=RefusalAggregator(0.2)).start()
    for _ in range(4):
        await trail.record_refusal(*refusal("addr:a"))
    await asyncio.sleep(0.6)  # the housekeeping thread writes the ended window's count
    for _ in range(3):
        await trail.record_refusal(*refusal("addr:b"))
    trail.close()  # and the open window's at close
    lines = b"".join(p.read_bytes() for p in segment_files(tmp_path / "spool")).splitlines()
    events = [json.loads(line)["event"] for line in lines]
    assert [(e["principal"], (e["detail"] or {}).get("aggregated", 1)) for e in events] == [
        ("addr:a", 1), ("addr:a", 3), ("addr:b", 1), ("addr:b", 2)
    ]
