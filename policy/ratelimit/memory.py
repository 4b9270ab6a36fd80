"""The in-process backend: counters in this process's memory, for a single replica.

Every operation is synchronous under one lock, with no await inside, so it is
atomic for the event loop and for threads alike. Window counters and
concurrency leases are lost on restart, which costs at most one window;
quota usage (day and month) is not: it is written to ``<state_dir>/ratelimit-quota.json``
every ``persist_interval`` seconds when it changed, and on ``close``, through a
temporary file and an atomic rename, so a crash leaves the previous complete
file and a restart does not hand out a fresh monthly quota.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from inferflux.policy.fileio import remove_temporaries, write_atomically
from inferflux.policy.ratelimit.background import every, stop
from inferflux.policy.ratelimit.checks import (
    CONCURRENCY_RETRY_MS,
    QUOTA_GRACE_SECONDS,
    Check,
    CheckResult,
    Dimension,
    bucket_expiry,
    bucket_of,
    millis,
    window_check,
    window_reset,
)

log = logging.getLogger("inferflux.policy.ratelimit")

STATE_FILE = "ratelimit-quota.json"
FORMAT_VERSION = 1
SWEEP_SECONDS = 60.0


class _Window:
    """One sliding-window counter: usage per bucket, with their sum and the newest used bucket kept.

    A check reads the sum instead of adding the buckets up (a minute of one-second buckets
    is sixty of them on every request of a busy caller); ``window_check`` adds them up
    only for a refusal, to say when the request would fit.
    """

    __slots__ = ("counts", "used", "newest")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}  # bucket index -> usage
        self.used = 0  # sum(counts.values())
        self.newest: int | None = None  # the newest bucket with usage in it

    def drop_before(self, oldest: int) -> None:
        """Forget the buckets that have left the window."""
        counts = self.counts
        if counts and min(counts) < oldest:  # min in C: most requests find none stale
            for stale in [i for i in counts if i < oldest]:
                self.used -= counts.pop(stale)
            if self.newest is not None and self.newest < oldest:
                self.newest = None

    def add(self, index: int, amount: int) -> None:
        """Add ``amount`` (negative: a correction) to bucket ``index``, never below zero."""
        counts = self.counts
        before = counts.get(index, 0)
        after = max(0, before + amount)
        counts[index] = after
        self.used += after - before
        if after > 0 and (self.newest is None or index > self.newest):
            self.newest = index
        elif after == 0 and index == self.newest:
            self.newest = max((i for i, c in counts.items() if c > 0), default=None)


class MemoryBackend:
    """Counters in memory; quota usage persisted under ``state_dir`` (None: not persisted)."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        *,
        persist_interval: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.persist_interval = persist_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        self._window_ends: dict[str, float] = {}  # when each window counter is all stale
        self._leases: dict[str, dict[str, float]] = {}  # counter -> lease id -> expiry
        self._quotas: dict[str, list[float]] = {}  # counter -> [used, expires_at]
        self._dirty = False
        self._swept_at = float("-inf")
        self._task: asyncio.Task[None] | None = None
        self._path = None if state_dir is None else Path(state_dir) / STATE_FILE
        if self._path is not None:
            # One replica per state directory (this backend is single-replica), so any temporary is a dead writer's.
            remove_temporaries(self._path.parent, self._path.name)
            self._load(self._path)

    # -- lifecycle

    async def start(self) -> None:
        """Start writing quota usage every ``persist_interval`` seconds (if there is a state_dir)."""
        if self._path is not None and self._task is None:
            work = every(self.persist_interval, lambda: asyncio.to_thread(self.persist), f"writing {self._path}")
            self._task = asyncio.create_task(work, name="ratelimit-quota-persist")

    async def close(self) -> None:
        """Stop the periodic writes and write the usage one last time."""
        await stop(self._task)
        self._task = None
        try:
            await asyncio.to_thread(self.persist)
        except OSError as exc:
            log.error("cannot write rate-limit quota usage to %s on close: %s", self._path, exc)

    # -- the Backend protocol

    async def reserve(
        self, checks: Sequence[Check], lease_id: str, lease_expires_at: float, now: float
    ) -> tuple[bool, list[CheckResult]]:
        with self._lock:
            self._sweep(now)
            results: list[CheckResult] = []
            commits: list[Callable[[], None]] = []
            for check in checks:
                result, commit = self._evaluate(check, lease_id, lease_expires_at, now)
                results.append(result)
                commits.append(commit)
            admitted = all(r.allowed for r in results)
            if admitted:
                for commit in commits:
                    commit()
            return admitted, results

    async def settle(
        self, checks: Sequence[Check], lease_id: str, reserved_at: float, token_delta: int, now: float,
        spend_delta: int = 0,
    ) -> list[int]:
        budgets: list[int] = []
        with self._lock:
            for check in checks:
                kind = check.dimension.kind
                delta = spend_delta if check.dimension is Dimension.SPEND else token_delta
                if kind == "c":
                    self._leases.get(check.key, {}).pop(lease_id, None)
                elif kind in ("q", "b"):
                    entry = self._quotas.setdefault(check.key, [0, check.expires_at + QUOTA_GRACE_SECONDS])
                    if delta:
                        entry[0] = max(0, int(entry[0]) + delta)
                        self._dirty = True
                    if kind == "b":
                        budgets.append(int(entry[0]))
                elif delta and check.dimension is Dimension.TOKENS:
                    self._correct_window(check, reserved_at, delta, now)
        return budgets

    async def renew(self, leases: Sequence[tuple[str, Sequence[Check]]], expires_at: float, now: float) -> None:
        with self._lock:
            for lease_id, checks in leases:
                for check in checks:
                    held = self._leases.get(check.key)
                    if held is not None and held.get(lease_id, now) > now:
                        held[lease_id] = expires_at

    # -- checks

    def _evaluate(
        self, check: Check, lease_id: str, lease_expires_at: float, now: float
    ) -> tuple[CheckResult, Callable[[], None]]:
        kind = check.dimension.kind
        if kind == "w":
            window = self._windows.get(check.key) or _Window()
            current = bucket_of(now, check.window, check.buckets)
            window.drop_before(current - check.buckets)
            if window.used + check.cost <= check.limit:  # what window_check says, without adding the buckets up
                result = CheckResult(True, window.used, 0, window_reset(window.newest, check, now))
            else:
                result, _ = window_check(window.counts, check, now)

            def charge_window() -> None:
                self._windows.setdefault(check.key, window)  # a counter exists once it has counted something
                window.add(current, check.cost)
                self._window_ends[check.key] = bucket_expiry(current, check.window, check.buckets)

            return result, charge_window

        if kind == "c":
            held = self._leases.get(check.key, {})
            if len(held) + 1 > check.limit:  # only a full counter needs its lapsed leases dropped (else: _sweep)
                for expired in [lid for lid, until in held.items() if until <= now]:
                    del held[expired]
            used = len(held)
            allowed = used + 1 <= check.limit
            result = CheckResult(allowed, used, 0 if allowed else CONCURRENCY_RETRY_MS, 0)

            def take_slot() -> None:
                self._leases.setdefault(check.key, held)[lease_id] = lease_expires_at

            return result, take_slot

        entry = self._quotas.get(check.key)
        used = 0 if entry is None else int(entry[0])
        # A quota admits what fits; a budget admits until it is spent (the crossing request runs).
        allowed = used < check.limit if kind == "b" else used + check.cost <= check.limit
        until_end = millis(check.expires_at - now)
        result = CheckResult(allowed, used, 0 if allowed else until_end, until_end)

        def spend() -> None:
            self._quotas[check.key] = [used + check.cost, check.expires_at + QUOTA_GRACE_SECONDS]
            self._dirty = True

        return result, spend

    def _correct_window(self, check: Check, reserved_at: float, delta: int, now: float) -> None:
        # Correct the bucket the estimate went into while it still counts;
        # once it has left the window only extra usage matters, charged now.
        window = self._windows.setdefault(check.key, _Window())
        charged = bucket_of(reserved_at, check.window, check.buckets)
        current = bucket_of(now, check.window, check.buckets)
        if charged >= current - check.buckets:
            index = charged
        elif delta > 0:
            index = current
        else:
            return
        window.add(index, delta)
        end = bucket_expiry(index, check.window, check.buckets)
        self._window_ends[check.key] = max(self._window_ends.get(check.key, 0.0), end)

    def _sweep(self, now: float) -> None:
        """Forget counters that have gone stale, at most once a minute, so memory stays bounded."""
        if now - self._swept_at < SWEEP_SECONDS:
            return
        self._swept_at = now
        for key in [k for k, end in self._window_ends.items() if end <= now]:
            del self._window_ends[key]
            self._windows.pop(key, None)
        for key, held in list(self._leases.items()):
            for expired in [lid for lid, until in held.items() if until <= now]:
                del held[expired]
            if not held:
                del self._leases[key]
        for key in [k for k, (_, until) in self._quotas.items() if until <= now]:
            del self._quotas[key]
            self._dirty = True

    # -- persistence

    def persist(self) -> None:
        """Write quota usage now if it changed (atomically: a temporary file, fsync, rename)."""
        if self._path is None:
            return
        # One writer at a time: a cancelled periodic write may still be running its thread.
        with self._write_lock:
            with self._lock:
                if not self._dirty:
                    return
                snapshot = {key: list(entry) for key, entry in self._quotas.items()}
                self._dirty = False
            try:
                self._path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                data = json.dumps({"version": FORMAT_VERSION, "quotas": snapshot}, separators=(",", ":"))
                write_atomically(self._path, data.encode("utf-8"))
            except OSError:
                with self._lock:
                    self._dirty = True  # try again next time
                raise

    def _load(self, path: Path) -> None:
        try:
            raw = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
                raise ValueError("unknown format")
            now = self._clock()
            for key, (used, until) in data["quotas"].items():
                if isinstance(key, str) and float(until) > now:
                    self._quotas[key] = [max(0, int(used)), float(until)]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            # Unreadable usage is not a reason to refuse to start; keep the file for inspection.
            aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
            os.replace(path, aside)
            log.error("rate-limit quota usage in %s is unreadable (%s); moved to %s, starting at 0", path, exc, aside)
            self._quotas.clear()
