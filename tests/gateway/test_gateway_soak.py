"""Soak: the gateway's memory levels off under storms of streams the clients abandon.

A served gateway (its own process, real model, loopback) takes a warm-up storm
and then several more, each of streams closed before the answer, after its head
or mid-generation. After each storm the process collects garbage and trims its
heap (SIGUSR1, tests/support/soak_server.py) and reports its RSS. Once warm,
RSS must stay flat: a leak per aborted stream (a request's state kept in some
map, a task or queue left behind) shows as growth in every storm.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from soak import probe, start_gateway, storm, wait_idle

from policy.authn.apikeys import generate_key

# A served gateway of its own (default model) through several storms (the tiers: tests/conftest.py).
pytestmark = [pytest.mark.model, pytest.mark.slow]

STREAMS = 36  # per storm
STORMS = 6  # after the warm-up
MiB = 1024 * 1024
# A warm gateway's RSS still creeps up by 0.3-1.8 MiB a storm for several storms
# (thread stacks come and go, the allocator settles) before it levels off: 10
# storms measured 1100.9, 1101.9, 1103.7, 1104.0, 1104.3, 1106.0, 1106.5, 1106.5,
# 1105.0 MiB (AMD EPYC). On an Intel Xeon it also jumps once by 7-18 MiB between two
# storms and stays there (e.g. 1083.6, 1084.7, 1085.2, 1092.9, 1093.2, measured on the
# code before and after issue 19 alike): an arena growing once, not a leak. The leak
# issue 24 found, ~0.1 MiB per aborted stream, adds ~3.5 MiB in every storm (steps of 3-17
# MiB, median 3.7, when put back). A leak is in every step; a one-off jump is in one and the
# creep stays under 2. So the second-smallest step tells: over 2.5 MiB, every storm but one
# grew as a leak grows; and 32 MiB over the measured storms is a bound for anything grosser.
# (1 MiB, the bound before, sat inside the creep: a clean-clone CI run on 2026-11-26 failed on
# steps of 2.7, 5.5, 0.1, -0.3 and 1.6 MiB, RSS 1194 -> 1204 MiB. The median after it failed on
# an Intel Xeon without BF16, float32 weights, 2026-11-27: steps of 4.0, 6.1, 0.1, 2.75 and 0.1
# MiB, RSS 1295 -> 1308 MiB; two steps of 0.1 MiB are no leak.) About 20 s on two idle cores.
LEAK_STEP = 5 * MiB // 2
MAX_GROWTH = 32 * MiB


def test_rss_levels_off_under_storms_of_abandoned_streams(tmp_path: Path) -> None:
    key = generate_key().token
    gateway = start_gateway(tmp_path / "data", key, tmp_path / "gateway.log")
    try:
        rss = []
        answered = 0
        for n in range(STORMS + 1):
            outcomes = asyncio.run(storm(gateway.url, key, STREAMS, max_tokens=8, first=n * STREAMS))
            # Streams the client gave up on before the head ("cut short", a swamped host) are abandoned too.
            answered += outcomes.get("HTTP/1.1 200 OK", 0)
            asyncio.run(wait_idle(gateway.url))
            rss.append(probe(gateway)["rss"])
        assert answered >= STREAMS, f"too few streams were answered to measure anything: {answered}"
        growth = rss[-1] - rss[1]  # the first storm warms up (threads, caches, the allocator's arenas)
        steps = [b - a for a, b in zip(rss[1:], rss[2:], strict=False)]
        assert growth < MAX_GROWTH and sorted(steps)[1] <= LEAK_STEP, (
            f"RSS after each storm (MiB): {[round(r / MiB, 1) for r in rss]}"
        )
    finally:
        gateway.stop()
