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

from inferflux.policy.authn.apikeys import generate_key

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
#   (sys.getallocatedblocks).
# - Native memory: malloc's in-use bytes (mallinfo2), which count tensors and C++ buffers but
#   not the free pages the arenas keep.
# A leak grows in every storm, so each is read as the median of the five storm-to-storm
# increments, against a bound per stream of the storm: one probe caught mid-churn (worker
# threads come and go) or one step cannot decide. A one-off step is a high-water mark, not a
# leak: CI (2026-11-29, with another test worker beside it) saw malloc's in-use bytes go
# +0.03, +4.58, +0.05, +0.10, -0.02 MiB, and failed the measure used until then (the median of
# the last three storms against the first three); its median increments were +71 blocks and
# +0.05 MiB. Keeping 50 small dicts per closed generation gave +3,806 blocks a storm, a 100 KB
# buffer per closed generation +3.5 MiB (Intel Xeon 6/167; both fail). RSS keeps a gross bound
# for what neither counts (mmapped memory, thread stacks).
PYTHON_BLOCKS_PER_STREAM = 32
MALLOC_BYTES_PER_STREAM = 32 * 1024
MAX_RSS_GROWTH = 32 * MiB


def growth(values: list[int]) -> float:
    """The median growth from one storm to the next."""
    return statistics.median(after - before for before, after in zip(values, values[1:]))


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
    between = STREAMS  # streams between one measurement and the next
    seen = (f"Python blocks {blocks}; malloc in use (MiB) {[round(b / MiB, 2) for b in in_use]}; "
            f"RSS (MiB) {[round(b / MiB, 1) for b in rss]}")  # fmt: skip
    assert growth(blocks) < PYTHON_BLOCKS_PER_STREAM * between, seen
    assert growth(in_use) < MALLOC_BYTES_PER_STREAM * between, seen
    assert rss[-1] - rss[0] < MAX_RSS_GROWTH, seen
