"""Waiting for the audit index: the store is fed by a spool sink, a moment after each event is durable."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def eventually(fetch: Callable[[], T], done: Callable[[T], bool], *, timeout: float = 15.0, what: str = "") -> T:
    """``fetch()`` again and again until ``done`` accepts its answer; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what or fetch!r}; last answer: {value!r}"[:2000])
        time.sleep(0.02)


def indexed_events(app: Any, tenant_id: str | None = None) -> list[dict[str, Any]]:
    """Every event in ``app``'s audit index (``tenant_id`` None: all), oldest first."""
    events: list[dict[str, Any]] = []
    after = None
    while True:
        page = app.state.audit_store.query(tenant_id=tenant_id, limit=200, after=after)
        events += [record.record["event"] for record in page.items]
        after = page.next_cursor
        if after is None:
            return events


def wait_indexed(
    app: Any, done: Callable[[list[dict[str, Any]]], bool], tenant_id: str | None = None, timeout: float = 15.0
) -> list[dict[str, Any]]:
    """``indexed_events`` once ``done`` accepts them."""
    return eventually(lambda: indexed_events(app, tenant_id), done, timeout=timeout, what="audit index")
