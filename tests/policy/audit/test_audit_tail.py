"""Live tail: tenant-scoped subscriptions of durable events; a slow subscriber is dropped, never waited for."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from audit_support import make_event

from inferflux.policy.audit.errors import AuditUnavailable, TooManySubscriptions
from inferflux.policy.audit.spool import Spool
from inferflux.policy.audit.tail import Dropped, LiveTail, Subscription


async def take(subscription: Subscription, n: int) -> list[Any]:
    items: list[Any] = []
    async for item in subscription:
        items.append(item)
        if len(items) == n or isinstance(item, Dropped):
            break
    subscription.close()  # what the SSE route does when its client goes away
    return items


async def test_subscribers_see_their_tenant_only(spool: Spool) -> None:
    tail = LiveTail()
    spool.add_listener(tail.publish)
    mine, theirs, platform = tail.subscribe("ten_a"), tail.subscribe("ten_b"), tail.subscribe(None)
    events = [make_event(tenant=t) for t in ("ten_a", "ten_b", "ten_a", "ten_b", "ten_a")]
    receipts = [spool.append(e) for e in events]
    got_a, got_b, got_all = await asyncio.wait_for(
        asyncio.gather(take(mine, 3), take(theirs, 2), take(platform, 5)), 10
    )
    assert [r["event"]["id"] for r in got_a] == [e.id for e in events if e.tenant_id == "ten_a"]
    assert [r["event"]["id"] for r in got_b] == [e.id for e in events if e.tenant_id == "ten_b"]
    assert [r["seq"] for r in got_all] == [0, 1, 2, 3, 4]
    assert all(r.done() for r in receipts)  # only durable events are tailed
    tail.close()


async def test_a_slow_subscriber_is_dropped_with_a_marker(spool: Spool) -> None:
    tail = LiveTail(max_buffer=10)
    spool.add_listener(tail.publish)
    slow, keeping_up = tail.subscribe(None), tail.subscribe(None)
    reader = asyncio.create_task(take(keeping_up, 30))
    for _ in range(3):  # three batches of ten, each waited for: the reader keeps up, the slow one does not
        receipts = [spool.append(make_event()) for _ in range(10)]
        await asyncio.wait_for(asyncio.gather(*(r.durable() for r in receipts)), 10)
        await asyncio.sleep(0.05)
    assert len(await asyncio.wait_for(reader, 10)) == 30
    items = await asyncio.wait_for(take(slow, 100), 10)
    assert isinstance(items[-1], Dropped) and all(isinstance(i, dict) for i in items[:-1])
    assert len(items) - 1 <= 10
    assert items[-1].to_json()["dropped"] is True
    assert tail.subscribers == 0  # the dropped one and the finished reader are both gone
    assert spool.stats.events == 30  # the writer was never held up


async def test_one_tenant_cannot_take_every_subscription() -> None:
    tail = LiveTail(max_subscribers=5, max_per_tenant=2)
    greedy = [tail.subscribe("greedy"), tail.subscribe("greedy")]
    with pytest.raises(TooManySubscriptions) as caught:
        tail.subscribe("greedy")
    assert caught.value.status_code == 429 and caught.value.headers["retry-after"] == "5"
    other = [tail.subscribe("other"), tail.subscribe("other")]  # its own share is untouched
    tail.subscribe(None)  # platform-wide: only the replica's bound applies
    with pytest.raises(AuditUnavailable):
        tail.subscribe("third")  # 5 in all now
    greedy[0].close()
    tail.subscribe("greedy")  # a freed slot of its own can be taken again
    assert tail.subscribers == 5 and len(other) == 2


async def test_closing_ends_subscriptions_and_bounds_their_number() -> None:
    tail = LiveTail(max_subscribers=2)
    first = tail.subscribe("t")
    tail.subscribe("t")
    with pytest.raises(AuditUnavailable):
        tail.subscribe("t")
    waiting = asyncio.create_task(take(first, 1))
    await asyncio.sleep(0.01)
    tail.close()
    assert await asyncio.wait_for(waiting, 5) == []
    assert tail.subscribers == 0
