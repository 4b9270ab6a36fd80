"""The usage rollup on SQLite and PostgreSQL: indexed audit events add up, exactly once; prices; money arithmetic."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from audit_support import make_event

from inferflux.policy.audit.events import AuditEvent
from inferflux.policy.audit.spool import Spool, SpoolSettings
from inferflux.policy.audit.store import AuditStore
from inferflux.policy.errors import NotFound, ValidationFailed
from inferflux.policy.store import PolicyStore, StoreSettings
from inferflux.policy.store.models import UsageRow
from inferflux.policy.usage.cost import Price, cost_micros, format_usd, parse_usd
from inferflux.policy.usage.rollup import DAY, add, bucket_of
from inferflux.policy.usage.store import UsageStore


@pytest.fixture
def stores(store_settings: StoreSettings, data_dir: Path) -> Iterator[tuple[AuditStore, UsageStore, PolicyStore]]:
    with PolicyStore.open(store_settings, data_dir) as policy:
        audit = AuditStore.open(store_settings, data_dir)
        yield audit, UsageStore(audit.engine), policy
        audit.close()


def index(tmp_path: Path, audit: AuditStore, events: list[AuditEvent], chain: str = "gw-a") -> None:
    with Spool.open(SpoolSettings(tmp_path / chain, chain_id=chain)) as spool:
        start = spool.durable_cursor()
        assert all(r.wait(10) for r in [spool.append(e) for e in events])
        records, _ = spool.read(start, max_records=10_000)
    audit.index(records)
    audit.index(records)  # a re-delivery adds nothing


def test_money_is_exact() -> None:
    assert parse_usd("0.15", "p") == 150_000 and parse_usd(2, "p") == 2_000_000
    assert format_usd(150) == "0.000150" and format_usd(2_500_000) == "2.500000"
    for bad in (0.1, "abc", "1.0000001", "-1", True, "NaN", None):
        with pytest.raises(ValidationFailed):
            parse_usd(bad, "p")
    price = Price(prompt=150_000, completion=600_000)  # $0.15 and $0.60 per 1M tokens
    assert cost_micros(1_000_000, 0, price) == 150_000
    assert cost_micros(1, 0, price) == 1  # rounded up per request, never free
    assert cost_micros(10, 20, price) == 14  # (1.5 + 12) micro-dollars, up
    assert cost_micros(10, 20, None) == 0


def test_usage_is_the_sum_of_indexed_events(tmp_path: Path, stores: tuple[AuditStore, UsageStore, PolicyStore]) -> None:
    audit, usage, _ = stores
    usage.set_price("smollm2", Price(1_000_000, 2_000_000))  # $1 / $2 per 1M: 1 and 2 micro-dollars a token
    now = datetime.now(UTC).replace(microsecond=0)
    events = [
        make_event("ten_a", at=now, prompt_tokens=10, completion_tokens=5),
        make_event("ten_a", at=now, prompt_tokens=7, completion_tokens=3, model="other"),
        make_event("ten_b", at=now, prompt_tokens=1, completion_tokens=1),
        make_event("ten_a", "deny", at=now, prompt_tokens=None, completion_tokens=None, status=429,
                   reasons=("rate limit: requests_per_minute (tenant)",)),
        make_event("ten_a", "deny", at=now, prompt_tokens=None, completion_tokens=None, status=429, request_id=None,
                   reasons=("rate limit: requests_per_minute (tenant)",), detail={"aggregated": 4}),
        make_event("ten_a", at=now - timedelta(days=3), prompt_tokens=100, completion_tokens=0),
    ]
    index(tmp_path, audit, events)
    index(tmp_path, audit, [make_event("ten_a", at=now, prompt_tokens=2, completion_tokens=2)], chain="gw-b")

    items, more = usage.query(tenant_id="ten_a", group_by=("tenant",), since=now - timedelta(days=1))
    assert not more and len(items) == 1
    today = items[0]
    assert (today.requests, today.prompt_tokens, today.completion_tokens) == (1 + 1 + 1 + 4 + 1, 19, 10)
    assert today.cost_micros == (10 + 10) + (2 + 4)  # "other" has no price
    assert today.refusals == {"rate limit: requests_per_minute (tenant)": 5}

    by_model, _ = usage.query(tenant_id="ten_a", group_by=("model",), since=now - timedelta(days=1))
    assert {i.group["model"]: i.prompt_tokens for i in by_model if i.prompt_tokens} == {"other": 7, "smollm2": 12}

    everyone, _ = usage.query(tenant_id=None, group_by=("tenant", "key"), since=now - timedelta(days=1))
    assert {(i.group["tenant"], i.group["key"]): i.requests for i in everyone} == {
        ("ten_a", "ten_a-k1"): 8, ("ten_b", "ten_b-k1"): 1}
    old, _ = usage.query(tenant_id="ten_a", until=now - timedelta(days=1))
    assert [i.prompt_tokens for i in old] == [100]

    minutes, _ = usage.query(tenant_id="ten_a", grain="minute", group_by=())
    assert sum(i.requests for i in minutes) == 8  # the three-day-old event has no minute row
    assert usage.prune_minutes(now + timedelta(hours=25)) >= 1
    assert usage.query(tenant_id="ten_a", grain="minute")[0] == []

    page, more = usage.query(tenant_id=None, group_by=("tenant",), limit=1)
    assert more and len(page) == 1


def test_hours_sum_the_minute_rows_of_each_hour(
    tmp_path: Path, stores: tuple[AuditStore, UsageStore, PolicyStore]
) -> None:
    audit, usage, _ = stores
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    # (minutes after `hour`, tenant, model, prompt, completion): two hours, two tenants, two models.
    calls = [(5, "ten_a", "m1", 10, 1), (50, "ten_a", "m1", 20, 2), (59, "ten_a", "m2", 30, 3),
             (65, "ten_a", "m1", 40, 4), (70, "ten_b", "m1", 50, 5), (119, "ten_a", "m2", 60, 6)]  # fmt: skip
    events = [make_event(t, at=hour + timedelta(minutes=m), model=model, prompt_tokens=p, completion_tokens=c)
              for m, t, model, p, c in calls]  # fmt: skip
    events.append(make_event("ten_a", "deny", at=hour + timedelta(minutes=61), prompt_tokens=None,
                             completion_tokens=None, status=429, reasons=("quota",)))  # fmt: skip
    index(tmp_path, audit, events)

    expected: dict[tuple[datetime, str, str], list[int]] = {}
    for m, t, model, p, c in calls:
        row = expected.setdefault((hour + timedelta(hours=m // 60), t, model), [0, 0, 0])
        row[0] += 1
        row[1] += p
        row[2] += c
    refusal_row = expected.setdefault((hour + timedelta(hours=1), "ten_a", "smollm2"), [0, 0, 0])
    refusal_row[0] += 1
    hours, more = usage.query(tenant_id=None, grain="hour", group_by=("tenant", "model"))
    assert not more
    assert {(i.bucket, i.group["tenant"], i.group["model"]): [i.requests, i.prompt_tokens, i.completion_tokens]
            for i in hours} == expected  # fmt: skip
    assert [i.bucket for i in hours] == sorted(i.bucket for i in hours)  # ordered by the hour, in SQL
    assert all(i.bucket.tzinfo is not None and i.bucket.minute == 0 for i in hours)
    refused = [i for i in hours if i.refusals]
    assert [(i.bucket, i.group["model"], i.refusals) for i in refused] == [
        (hour + timedelta(hours=1), "smollm2", {"quota": 1})]
    # One tenant, no grouping: the hours of the day; paged in the database.
    ten_a, _ = usage.query(tenant_id="ten_a", grain="hour", group_by=())
    assert [(i.bucket, i.prompt_tokens) for i in ten_a] == [(hour, 60), (hour + timedelta(hours=1), 100)]
    first, more = usage.query(tenant_id="ten_a", grain="hour", group_by=(), limit=1)
    assert more and first == ten_a[:1]
    # The range is on the minute rows: from the second hour's 10th minute, its 65 is out.
    late, _ = usage.query(tenant_id="ten_a", grain="hour", group_by=(), since=hour + timedelta(minutes=66))
    assert [(i.bucket, i.prompt_tokens) for i in late] == [(hour + timedelta(hours=1), 60)]


def test_a_call_its_client_left_is_counted_apart_from_refusals(
    tmp_path: Path, stores: tuple[AuditStore, UsageStore, PolicyStore]
) -> None:
    audit, usage, _ = stores
    now = datetime.now(UTC).replace(microsecond=0)
    index(tmp_path, audit, [
        make_event("ten_c", at=now),
        make_event("ten_c", "error", at=now, status=499, prompt_tokens=9, completion_tokens=4),  # a stream left
        make_event("ten_c", "deny", at=now, status=499, reasons=("client_timeout",)),  # ended by the server
        make_event("ten_c", "deny", at=now, status=429, prompt_tokens=None, completion_tokens=None,
                   reasons=("rate limit: requests_per_minute (tenant)",)),
    ])  # fmt: skip
    with audit.engine.begin() as connection:  # a row the rollup wrote before 499 had a reason of its own
        add(connection, UsageRow.__table__, {(DAY, bucket_of(now, DAY), "ten_c", "ten_c-k1", "smollm2",
                                              "status 499"): [2, 0, 0, 0]})  # fmt: skip
    [today] = usage.query(tenant_id="ten_c", group_by=("tenant",), since=now - timedelta(days=1))[0]
    assert (today.requests, today.cancelled, today.prompt_tokens) == (1 + 1 + 1 + 1 + 2, 1 + 2, 12 + 9 + 12)
    assert today.refusals == {"client_timeout": 1, "rate limit: requests_per_minute (tenant)": 1}


def test_prices_and_alerts(stores: tuple[AuditStore, UsageStore, PolicyStore]) -> None:
    _, usage, policy = stores
    version = policy.policy_version()
    record, created = usage.set_price("m", Price(1, 2))
    assert created and record.price == Price(1, 2) and policy.policy_version() > version  # replicas reload
    _, created = usage.set_price("m", Price(3, 4))
    assert not created and usage.get_price("m").price == Price(3, 4) and list(usage.prices()) == ["m"]
    usage.delete_price("m")
    with pytest.raises(NotFound):
        usage.get_price("m")
    with pytest.raises(NotFound):
        usage.delete_price("m")
    assert usage.claim_alert("{ten}:t:spend:2026-11", 50)
    assert not usage.claim_alert("{ten}:t:spend:2026-11", 50)
    assert usage.claim_alert("{ten}:t:spend:2026-11", 80)
