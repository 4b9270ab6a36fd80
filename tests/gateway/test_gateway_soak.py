"""Soak: the gateway's memory levels off under storms of streams the clients abandon.

A served gateway (its own process, real model, loopback) takes a warm-up storm
and then several more, each of streams closed before the answer, after its head
or mid-generation. After each storm the process collects garbage and trims its
heap (SIGUSR1, tests/support/soak_server.py) and reports what it holds. Once
warm, that must stay flat: a leak per aborted stream (a request's state kept in
some map, a task or queue left behind, a buffer never freed) grows in every storm.
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest
from soak import probe, start_gateway, storm, wait_idle

from policy.authn.apikeys import generate_key

# A served gateway of its own (default model) through several storms (the tiers: tests/conftest.py).
pytestmark = [pytest.mark.model, pytest.mark.slow]

STREAMS = 36  # per storm
STORMS = 6  # after the warm-up
MiB = 1024 * 1024
# What a leak is measured in. RSS was the measure until stop 40, and CI failed on it five
# times with no leak: a warm gateway's RSS creeps 0.3-1.8 MiB a storm for several storms, on
# some hosts jumps by 7-18 MiB once, and in one CI run (2026-11-27) rose 25 MiB over six storms
# in steps of 5.8, -0.4, 3.5, 9.1 and 7.3 MiB. That is the allocators (arenas growing,
# fragmenting, trimmed or not), not the program. So a leak is read from what the program
# holds, which the allocators' state does not move:
# - Python objects: the blocks Python's object allocator has handed out and not freed
#   (sys.getallocatedblocks). The growth below measured -938 to +1,325 blocks in four runs
#   (Intel Xeon 6/207); a Sequence kept per aborted request gave +6,229 and +6,121.
# - Native memory: malloc's in-use bytes (mallinfo2), which count tensors and C++ buffers but
#   not the free pages the arenas keep: -0.03 to +0.72 MiB in the same runs; a 100 KB buffer
#   kept per aborted request gave +25.2 MiB.
# Each is compared as the median of the last three storms against the median of the first
# three measured ones, so one probe caught mid-churn (worker threads come and go) cannot
# decide, and a leak has three storms (108 streams) to show. RSS keeps a gross bound for
# what neither counts (mmapped memory, thread stacks).
PYTHON_BLOCKS_PER_STREAM = 32
MALLOC_BYTES_PER_STREAM = 32 * 1024
MAX_RSS_GROWTH = 32 * MiB


def growth(values: list[int]) -> float:
    """Median of the last three measurements minus the median of the first three."""
    return statistics.median(values[-3:]) - statistics.median(values[:3])


def test_memory_levels_off_under_storms_of_abandoned_streams(tmp_path: Path) -> None:
    key = generate_key().token
    gateway = start_gateway(tmp_path / "data", key, tmp_path / "gateway.log")
    try:
        reports = []
        answered = 0
        for n in range(STORMS + 1):
            outcomes = asyncio.run(storm(gateway.url, key, STREAMS, max_tokens=8, first=n * STREAMS))
            # Streams the client gave up on before the head ("cut short", a swamped host) are abandoned too.
            answered += outcomes.get("HTTP/1.1 200 OK", 0)
            asyncio.run(wait_idle(gateway.url))
            reports.append(probe(gateway))
    finally:
        gateway.stop()
    assert answered >= STREAMS, f"too few streams were answered to measure anything: {answered}"
    measured = reports[1:]  # the first storm warms up (threads, caches, the allocator's arenas)
    assert all(r["malloc_in_use"] is not None for r in measured), "this C library has no mallinfo2"
    blocks = [r["python_blocks"] for r in measured]
    in_use = [r["malloc_in_use"] for r in measured]
    rss = [r["rss"] for r in measured]
    between = 3 * STREAMS  # streams between the first three storms and the last three
    seen = (f"Python blocks {blocks}; malloc in use (MiB) {[round(b / MiB, 2) for b in in_use]}; "
            f"RSS (MiB) {[round(b / MiB, 1) for b in rss]}")  # fmt: skip
    assert growth(blocks) < PYTHON_BLOCKS_PER_STREAM * between, seen
    assert growth(in_use) < MALLOC_BYTES_PER_STREAM * between, seen
    assert rss[-1] - rss[0] < MAX_RSS_GROWTH, seen
