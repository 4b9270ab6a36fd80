"""kill -9 of one of two upstream processes while 16 streams run, and its return.

Streams on the killed endpoint must end promptly with ``UpstreamFailed`` (not
hang, not end as if complete); streams on the survivor finish; new requests
succeed on the survivor; once the endpoint is back on its port it takes
requests again. The whole test stays under 20 s.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from fake_upstream import FakeUpstreamProcess
from upstream_rules import LOOPBACK

from inferflux.backends.openai.errors import UpstreamFailed
from inferflux.backends.openai.fleet import Fleet, FleetConfig

# Two child processes, one killed with SIGKILL and started again (the tiers: tests/conftest.py).
pytestmark = pytest.mark.slow

STREAMS = 16
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}


async def test_kill_9_of_one_upstream_while_streams_run() -> None:
    started = time.monotonic()
    a = FakeUpstreamProcess(name="a", token_delay=0.02).start()
    b = FakeUpstreamProcess(name="b", token_delay=0.02).start()
    fleet = Fleet(FleetConfig(
        endpoints=(a.url, b.url), routing="least_outstanding", timeout_seconds=30, idle_timeout_seconds=3,
        connect_timeout_seconds=1, health_interval_seconds=0.2, breaker_failures=3, breaker_reset_seconds=0.5,
        egress=LOOPBACK,
    ))  # fmt: skip
    await fleet.start()
    try:
        placed: list[str] = []
        outcomes: list[tuple[str, str, float]] = []  # (endpoint, "done" | "failed", when)

        async def run() -> None:
            where = "?"
            try:
                async for chunk in fleet.stream("/chat/completions", {**CHAT, "max_tokens": 150}):  # ~3 s a stream
                    if where == "?":
                        where = chunk["system_fingerprint"]
                        placed.append(where)
                outcomes.append((where, "done", time.monotonic()))
            except UpstreamFailed:
                outcomes.append((where, "failed", time.monotonic()))

        streams = [asyncio.ensure_future(run()) for _ in range(STREAMS)]
        deadline = time.monotonic() + 10
        while len(placed) < STREAMS and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert sorted(placed) == ["a"] * (STREAMS // 2) + ["b"] * (STREAMS // 2)

        a.kill()
        killed_at = time.monotonic()
        # Requests that had not started go to the survivor, while the killed one's streams are still failing.
        fresh = await asyncio.gather(*(collect(fleet) for _ in range(8)))
        assert {chunks[0]["system_fingerprint"] for chunks in fresh} == {"b"}

        await asyncio.wait_for(asyncio.gather(*streams), timeout=10)
        on_a = [(outcome, when) for where, outcome, when in outcomes if where == "a"]
        on_b = [outcome for where, outcome, _ in outcomes if where == "b"]
        assert [outcome for outcome, _ in on_a] == ["failed"] * (STREAMS // 2)
        assert max(when for _, when in on_a) - killed_at < 1.5  # promptly: not at a timeout
        assert on_b == ["done"] * (STREAMS // 2)
        (status_a, _) = fleet.statuses()
        assert status_a.circuit == "open" or not status_a.healthy

        a.start()  # the same port
        returned_at = time.monotonic()
        while True:
            chunks = await collect(fleet)
            if chunks[0]["system_fingerprint"] == "a":
                break
            assert time.monotonic() - returned_at < 5, fleet.statuses()
            await asyncio.sleep(0.05)
        (status_a, _) = fleet.statuses()
        assert status_a.healthy and status_a.circuit == "closed"
        assert time.monotonic() - started < 20
    finally:
        await fleet.aclose()
        a.stop()
        b.stop()


async def collect(fleet: Fleet) -> list[dict[str, Any]]:
    return [chunk async for chunk in fleet.stream("/chat/completions", {**CHAT, "max_tokens": 4})]
