"""The audit log in the store, on SQLite and PostgreSQL: indexing from the spool, queries, pages, retention."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from audit_support import FAST, POLL, make_event, wait_for
from sqlalchemy import create_engine, inspect

from inferflux.policy.audit.chain import GENESIS, canonical_json, verify_lines
from inferflux.policy.audit.checkpoint import CheckpointSigner
from inferflux.policy.audit.delivery import Delivery
from inferflux.policy.audit.errors import ChainConflict
from inferflux.policy.audit.events import AuditEvent, admin_event
from inferflux.policy.audit.spool import Cursor, Spool, SpooledRecord, SpoolSettings
from inferflux.policy.audit.store import AuditStore, IndexerSink, Retention
from inferflux.policy.errors import StoreUnavailable, ValidationFailed
from inferflux.policy.store import PolicyStore, StoreSettings

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def audit_store(store_settings: StoreSettings, data_dir: Path) -> Iterator[AuditStore]:
    with PolicyStore.open(store_settings, data_dir):  # creates and migrates the schema
        pass
    opened = AuditStore.open(store_settings, data_dir)
    yield opened
    opened.close()


def index_events(spool: Spool, store: AuditStore, events: list[AuditEvent]) -> list[SpooledRecord]:
    start = spool.durable_cursor()
    assert all(r.wait(10) for r in [spool.append(e) for e in events])
    records, _ = spool.read(start, max_records=10_000)
    store.index(records)
    return records


def all_pages(store: AuditStore, limit: int, **filters: object) -> list[str]:
    ids: list[str] = []
    after = None
    while True:
        page = store.query(limit=limit, after=after, **filters)  # type: ignore[arg-type]
        ids += [r.id for r in page.items]
        assert len(page.items) <= limit
        if page.next_cursor is None:
            return ids
        after = page.next_cursor


def test_queries_by_tenant_time_principal_and_decision(spool: Spool, audit_store: AuditStore) -> None:
    events = [
        make_event(tenant=tenant, decision=decision, at=T0 + timedelta(minutes=i), principal=f"key:{who}")
        for i, (tenant, decision, who) in enumerate([
            ("ten_a", "allow", "alice"), ("ten_a", "deny", "alice"), ("ten_b", "allow", "bob"),
            ("ten_a", "allow", "carol"), ("ten_b", "deny", "bob"), ("ten_a", "error", "alice"),
        ])
    ]  # fmt: skip
    events.append(admin_event(principal="key:root", action="tenant.create", target_kind="tenant", target_id="ten_c",
                              at=T0 + timedelta(minutes=10)))  # fmt: skip
    index_events(spool, audit_store, events)
    ids = [e.id for e in events]

    assert all_pages(audit_store, 2, tenant_id="ten_a") == [ids[0], ids[1], ids[3], ids[5]]
    assert all_pages(audit_store, 50, tenant_id=None) == ids  # platform admins: every tenant and platform events
    assert all_pages(audit_store, 50, tenant_id="ten_a", principal="key:alice") == [ids[0], ids[1], ids[5]]
    assert all_pages(audit_store, 50, tenant_id="ten_b", decision="deny") == [ids[4]]
    assert all_pages(audit_store, 50, tenant_id=None, kind="admin") == [ids[6]]
    window = {"since": T0 + timedelta(minutes=1), "until": T0 + timedelta(minutes=4)}
    assert all_pages(audit_store, 1, tenant_id=None, **window) == ids[1:4]
    assert all_pages(audit_store, 50, tenant_id="ten_c") == []  # the admin action has no tenant of its own

    (row,) = audit_store.query(tenant_id="ten_b", decision="deny").items
    assert row.principal == "key:bob" and row.status == 403 and row.record["event"]["id"] == ids[4]
    # A page of results is still a piece of chain: its records verify on their own.
    page = audit_store.query(tenant_id=None, limit=200).items
    assert verify_lines((r.id, canonical_json(r.record)) for r in page).ok


def test_indexing_is_idempotent(spool: Spool, audit_store: AuditStore) -> None:
    records = index_events(spool, audit_store, [make_event() for _ in range(5)])
    assert audit_store.index(records) == 0
    assert audit_store.index(records[2:] + records[:1]) == 0
    assert len(audit_store.query(tenant_id=None).items) == 5


def test_a_damaged_spooled_record_is_skipped_not_fatal(audit_store: AuditStore) -> None:
    broken = SpooledRecord(b"{}", {"chain": "c", "seq": 1, "event": {"id": "x"}}, Cursor(1, 2))
    assert audit_store.index([broken]) == 0


def test_an_unreachable_store_is_unavailable_and_indexes_nothing(spool: Spool, audit_store: AuditStore) -> None:
    start = spool.durable_cursor()
    assert spool.append(make_event()).wait(10)
    records, _ = spool.read(start)
    nowhere = AuditStore(create_engine("postgresql+psycopg://postgres@127.0.0.1:1/test"), owns_engine=True)
    with pytest.raises(StoreUnavailable):  # the sink retries it; the spool keeps the record meanwhile
        nowhere.index(records)
    nowhere.close()
    assert audit_store.index(records) == 1  # and a store that answers takes it


def test_bad_query_values_are_clear_errors(audit_store: AuditStore) -> None:
    for kwargs in ({"decision": "maybe"}, {"kind": "other"}, {"since": datetime(2026, 1, 1)}, {"limit": 0},
                   {"after": "not-a-cursor"}):  # fmt: skip
        with pytest.raises(ValidationFailed):
            audit_store.query(tenant_id=None, **kwargs)  # type: ignore[arg-type]


def test_retention_deletes_old_events_in_batches(
    spool: Spool, audit_store: AuditStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("inferflux.policy.audit.store.PURGE_BATCH", 3)
    now = datetime.now(UTC)
    old = [make_event(at=now - timedelta(days=40, minutes=i)) for i in range(7)]
    new = [make_event(at=now - timedelta(days=1)) for _ in range(2)]
    index_events(spool, audit_store, old + new)
    retention = Retention(audit_store, days=30)
    assert retention.run_once() == 7  # more than one batch
    assert {r.id for r in audit_store.query(tenant_id=None).items} == {e.id for e in new}
    assert retention.run_once(now=now + timedelta(days=30)) == 2
    for bad in ({"days": 0}, {"days": 1, "interval_seconds": 0}):
        with pytest.raises(ValueError):
            Retention(audit_store, **bad)  # type: ignore[arg-type]


def test_retention_runs_periodically(spool: Spool, audit_store: AuditStore) -> None:
    retention = Retention(audit_store, days=1, interval_seconds=0.05).start()
    try:
        index_events(spool, audit_store, [make_event(at=datetime.now(UTC) - timedelta(days=2))])
        wait_for(lambda: not audit_store.query(tenant_id=None).items, what="the periodic purge")
    finally:
        retention.stop()


def test_the_indexer_is_fed_by_the_spool(spool: Spool, audit_store: AuditStore) -> None:
    delivery = Delivery(spool, IndexerSink(audit_store), backoff=FAST, poll_seconds=POLL).start()
    events = [make_event() for _ in range(12)]
    assert all(r.wait(10) for r in [spool.append(e) for e in events])
    assert delivery.wait_caught_up(15)
    delivery.stop()
    assert all_pages(audit_store, 5, tenant_id="ten_a") == [e.id for e in events]


def test_the_queries_have_indexes(audit_store: AuditStore) -> None:
    indexes = {tuple(ix["column_names"]) for ix in inspect(audit_store.engine).get_indexes("audit_events")}
    assert {("at",), ("tenant_id", "at"), ("tenant_id", "principal", "at"), ("tenant_id", "decision", "at")} <= indexes


def test_two_spools_writing_one_chain_are_named_when_indexed(
    spool: Spool, audit_store: AuditStore, tmp_path: Path
) -> None:
    """Replicas sharing one audit.chain_id (one config file for all) write records with the same
    (chain, seq): the index refuses the second's with the reason, not an opaque integrity error."""
    index_events(spool, audit_store, [make_event() for _ in range(3)])
    with Spool.open(SpoolSettings(tmp_path / "twin", chain_id=spool.chain_id)) as twin:
        with pytest.raises(ChainConflict, match="two spools write the chain.*its own audit.chain_id"):
            index_events(twin, audit_store, [make_event()])
    assert len(audit_store.query(tenant_id=None).items) == 3  # the first spool's, untouched


def test_a_spool_behind_its_chain_in_the_store_is_refused(
    spool: Spool, audit_store: AuditStore, tmp_path: Path
) -> None:
    records = index_events(spool, audit_store, [make_event() for _ in range(3)])
    seq, digest = spool.durable_head()
    audit_store.check_head(spool.chain_id, seq, digest)  # its own chain, fully indexed
    audit_store.check_head(spool.chain_id, seq + 5, "f" * 64)  # a spool ahead of the index: the index lags
    audit_store.check_head("gw-other", -1, GENESIS)  # a new chain
    # A spool re-created (or a twin started later) under the same chain id starts again at seq 0.
    with Spool.open(SpoolSettings(tmp_path / "again", chain_id=spool.chain_id)) as again:
        with pytest.raises(ChainConflict, match=r"indexed record of audit chain 'gw-test' at seq 2.*ends at seq -1"):
            audit_store.check_head(again.chain_id, *again.durable_head())
    with pytest.raises(ChainConflict, match="with another hash"):
        audit_store.check_head(spool.chain_id, seq, records[0].record["hash"])
    # The signed checkpoints count too: they outlive the events that retention deletes.
    signer = CheckpointSigner(b"k" * 32)
    audit_store.add_checkpoint(signer.sign("gw-purged", 40, "a" * 64))
    with pytest.raises(ChainConflict, match="signed checkpoint of audit chain 'gw-purged' at seq 40"):
        audit_store.check_head("gw-purged", 12, "b" * 64)
    audit_store.check_head("gw-purged", 40, "a" * 64)
