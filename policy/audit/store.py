"""The audit log in the policy store: indexed from the spool, queried by the admin API.

The ``audit_events`` table is fed by ``IndexerSink``, a spool sink like any
other, so the request path never writes to the database and a store outage
only delays indexing (the sink's cursor waits in the spool). Indexing is
idempotent on the event id, which at-least-once delivery needs.

Every replica indexes its own spool into the one table, so a query on any
replica answers with the events of all of them, each naming its chain (one per
replica). A chain is written by one spool only: ``check_head`` refuses, at
start, a spool whose chain the store has seen go further, and ``index`` names
the conflict when two spools write one chain from the start (``ChainConflict``).

Queries are keyset-paginated like every list of the store
(``policy.store.pagination``) and always run on an index: time alone uses
``(at)``, a tenant's events ``(tenant_id, at)``, narrowed by principal or
decision ``(tenant_id, principal|decision, at)``. ``Retention`` deletes old events
periodically, in small batches so it never holds a long lock.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, Table, delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from inferflux.policy.audit.checkpoint import Checkpoint
from inferflux.policy.audit.delivery import Worker
from inferflux.policy.audit.events import DECISIONS, KINDS, AuditEvent
from inferflux.policy.audit.errors import ChainConflict, InvalidAuditEvent
from inferflux.policy.audit.spool import SpooledRecord
from inferflux.policy.errors import ValidationFailed
from inferflux.policy.ids import random_id
from inferflux.policy.store.config import StoreSettings
from inferflux.policy.store.db import create_store_engine
from inferflux.policy.store.models import AuditCheckpointRow, AuditEventRow, ModelPrice, UsageRow
from inferflux.policy.store.pagination import paginate
from inferflux.policy.store.records import Page
from inferflux.policy.store.repos.base import unavailable_as_503
from inferflux.policy.usage import rollup
from inferflux.policy.usage.cost import Price

log = logging.getLogger("inferflux.policy.audit")

PURGE_BATCH = 1000
_CHAIN_ADVICE = (
    "give every replica its own audit.chain_id (or leave it unset: '<hostname>-<random>', chosen when the "
    "spool is created)"
)


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One indexed event; ``record`` is the full spooled record (chain, seq, prev, hash, event)."""

    id: str
    chain_id: str
    seq: int
    at: datetime
    kind: str
    tenant_id: str | None
    principal: str | None
    decision: str
    route: str | None
    model: str | None
    status: int | None
    record: dict[str, Any]


class AuditStore:
    """Index, query and expire audit events. Sharing the policy store's database and schema."""

    def __init__(self, engine: Engine, *, owns_engine: bool = False) -> None:
        self._engine = engine
        self._owns_engine = owns_engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def open(cls, settings: StoreSettings, data_dir: str | os.PathLike[str]) -> AuditStore:
        """A connection pool of its own to the policy store's database (opened and migrated by PolicyStore)."""
        engine = create_store_engine(settings.database_url(Path(data_dir).expanduser()), settings)
        return cls(engine, owns_engine=True)

    @property
    def engine(self) -> Engine:
        return self._engine

    def close(self) -> None:
        if self._owns_engine:
            self._engine.dispose()

    @contextmanager
    def _session(self, *, write: bool) -> Iterator[Session]:
        with unavailable_as_503():
            if write:
                with self._sessions.begin() as session:
                    yield session
            else:
                with self._sessions() as session:
                    yield session

    # -- indexing

    def index(self, records: Sequence[SpooledRecord]) -> int:
        """Insert the records not indexed yet (by event id); returns how many were new.

        A record whose event does not read back (a damaged spool line) is
        logged and skipped: ``inferctl audit verify`` is where it shows.
        """
        rows: dict[str, dict[str, Any]] = {}
        for record in records:
            row = _row(record)
            if row is not None:
                rows.setdefault(row["id"], row)
        if not rows:
            return 0
        try:
            # Core statements, not the ORM's: this thread runs beside the engine on the same cores, and
            # the ORM's work per statement (with the upsert built afresh) was a third of a batch's CPU.
            with unavailable_as_503(), self._engine.begin() as connection:
                present = set(connection.scalars(select(_EVENTS.c.id).where(_EVENTS.c.id.in_(list(rows)))))
                new = [row for event_id, row in rows.items() if event_id not in present]
                if new:
                    connection.execute(_EVENTS.insert(), new)
                    # In the same transaction: usage is the sum of the indexed events, exactly.
                    _roll_up(connection, [row["record"]["event"] for row in new])
        except IntegrityError:
            # Not a re-delivery (those are found by id above): another event holds one of these
            # (chain, seq), so another spool writes this chain. Retrying cannot help; say why.
            chains = sorted({row["chain_id"] for row in rows.values()})
            raise ChainConflict(
                f"audit chain {', '.join(chains)}: a seq of this spool is indexed already with another event, so "
                f"two spools write the chain; {_CHAIN_ADVICE}"
            ) from None
        return len(new)

    def check_head(self, chain_id: str, seq: int, digest: str) -> None:
        """Refuse a spool whose chain the store has seen go further than it (``ChainConflict``).

        ``seq`` and ``digest`` are the spool's last record (-1 and the genesis hash
        when it has none). The chain's newest indexed record and its latest signed
        checkpoint must not be past it, and one at its very seq must have its hash;
        otherwise another spool has written this chain (or this spool was lost and
        re-created under a fixed ``audit.chain_id``, or restored from an older copy),
        and the records it is about to write would take seqs the chain has already used.
        An index that lags behind the spool, the usual case, is no conflict.
        """
        query = (select(AuditEventRow.seq, AuditEventRow.record).where(AuditEventRow.chain_id == chain_id)
                 .order_by(AuditEventRow.seq.desc()).limit(1))  # fmt: skip
        with self._session(write=False) as session:
            newest = session.execute(query).first()
        marks = [] if newest is None else [(newest.seq, newest.record.get("hash"), "an indexed record")]
        checkpoint = self.latest_checkpoint(chain_id)
        if checkpoint is not None:
            marks.append((checkpoint.seq, checkpoint.hash, "a signed checkpoint"))
        for known_seq, known_hash, what in marks:
            if known_seq > seq or (known_seq == seq and known_hash != digest):
                raise ChainConflict(
                    f"the policy store has {what} of audit chain {chain_id!r} at seq {known_seq}, but this "
                    f"spool's chain ends at seq {seq}{' with another hash' if known_seq == seq else ''}: another "
                    f"spool writes the chain, or this one was re-created or restored; {_CHAIN_ADVICE}"
                )

    # -- queries

    def query(
        self,
        *,
        tenant_id: str | None,
        since: datetime | None = None,
        until: datetime | None = None,
        principal: str | None = None,
        decision: str | None = None,
        kind: str | None = None,
        limit: int = 50,
        after: str | None = None,
    ) -> Page[AuditRecord]:
        """Events oldest first, ``since <= at < until``; ``tenant_id=None`` means every tenant (platform admins).

        The caller decides the scope: a tenant admin's queries must pass the
        caller's own tenant id.
        """
        query = select(AuditEventRow)
        if tenant_id is not None:
            query = query.where(AuditEventRow.tenant_id == tenant_id)
        if since is not None:
            query = query.where(AuditEventRow.at >= _aware(since, "since"))
        if until is not None:
            query = query.where(AuditEventRow.at < _aware(until, "until"))
        if principal is not None:
            query = query.where(AuditEventRow.principal == principal)
        if decision is not None:
            if decision not in DECISIONS:
                raise ValidationFailed(f"decision must be one of {', '.join(DECISIONS)}", param="decision")
            query = query.where(AuditEventRow.decision == decision)
        if kind is not None:
            if kind not in KINDS:
                raise ValidationFailed(f"kind must be one of {', '.join(KINDS)}", param="kind")
            query = query.where(AuditEventRow.kind == kind)
        with self._session(write=False) as session:
            return paginate(session, query, AuditEventRow.at, AuditEventRow.id, limit, after, _record)

    # -- checkpoints

    def add_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Keep a signed chain head (idempotent on chain and seq)."""
        with self._session(write=True) as session:
            present = session.scalar(select(AuditCheckpointRow.id).where(
                AuditCheckpointRow.chain_id == checkpoint.chain, AuditCheckpointRow.seq == checkpoint.seq))  # fmt: skip
            if present is None:
                session.add(AuditCheckpointRow(id=random_id("acp", 20), chain_id=checkpoint.chain,
                                               seq=checkpoint.seq, hash=checkpoint.hash, at=checkpoint.at,
                                               signature=checkpoint.sig))  # fmt: skip

    def latest_checkpoint(self, chain_id: str) -> Checkpoint | None:
        """The checkpoint of ``chain_id`` covering the most records, or None."""
        query = (select(AuditCheckpointRow).where(AuditCheckpointRow.chain_id == chain_id)
                 .order_by(AuditCheckpointRow.seq.desc()).limit(1))  # fmt: skip
        with self._session(write=False) as session:
            row = session.scalar(query)
        if row is None:
            return None
        return Checkpoint(row.chain_id, row.seq, row.hash, row.at, row.signature)

    # -- retention

    def purge_before(self, cutoff: datetime) -> int:
        """Delete events older than ``cutoff``, a batch per transaction; returns how many."""
        cutoff = _aware(cutoff, "cutoff")
        total = 0
        while True:
            with self._session(write=True) as session:
                ids = session.scalars(
                    select(AuditEventRow.id).where(AuditEventRow.at < cutoff).limit(PURGE_BATCH)
                ).all()
                if ids:
                    session.execute(delete(AuditEventRow).where(AuditEventRow.id.in_(ids)))
            total += len(ids)
            if len(ids) < PURGE_BATCH:
                return total


class IndexerSink:
    """A spool sink that indexes records into the store. Every replica may run one: indexing is idempotent."""

    def __init__(self, store: AuditStore, *, name: str = "store") -> None:
        self.name = name
        self.store = store

    def send(self, records: Sequence[SpooledRecord]) -> None:
        self.store.index(records)

    def close(self) -> None:
        pass


class Retention(Worker):
    """Deletes events older than ``days`` every ``interval_seconds`` on a thread of its own.

    Every replica may run one (deletes are idempotent); a failed run (store
    down) is logged and tried again at the next interval.
    """

    def __init__(self, store: AuditStore, days: float, *, interval_seconds: float = 3600.0) -> None:
        if isinstance(days, bool) or not isinstance(days, int | float) or days <= 0:
            raise ValueError("audit retention days must be a positive number")
        if isinstance(interval_seconds, bool) or not isinstance(interval_seconds, int | float) or interval_seconds <= 0:
            raise ValueError("audit retention interval_seconds must be a positive number")
        super().__init__("audit-retention")
        self.store = store
        self.keep = timedelta(days=days)
        self._interval = float(interval_seconds)
        self._also: list[Callable[[datetime], int]] = []

    def also(self, prune: Callable[[datetime], int]) -> None:
        """Run ``prune(now)`` on each pass too (the usage rollup's minute rows, ``UsageStore.prune_minutes``)."""
        self._also.append(prune)

    def run_once(self, now: datetime | None = None) -> int:
        """Delete what is older than the retention now; returns how many events."""
        now = now or datetime.now(UTC)
        removed = self.store.purge_before(now - self.keep)
        if removed:
            log.info("audit retention: deleted %d events older than %s", removed, self.keep)
        for prune in self._also:
            prune(now)
        return removed

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception as exc:  # the store is down: next interval
                log.error("audit retention failed: %s", exc)
            self._stop.wait(self._interval)


def _roll_up(connection: Connection, events: list[dict[str, Any]]) -> None:
    if not any(event.get("kind") == "api" and event.get("tenant_id") for event in events):
        return
    prices = {model: Price(prompt, completion) for model, prompt, completion in connection.execute(_PRICES)}
    rows = rollup.increments(events, prices.get, datetime.now(UTC))
    rollup.add(connection, _USAGE, rows)


_EVENTS: Table = AuditEventRow.__table__  # type: ignore[assignment]
_USAGE: Table = UsageRow.__table__  # type: ignore[assignment]
_PRICES = select(ModelPrice.model, ModelPrice.prompt_micros_per_million, ModelPrice.completion_micros_per_million)


def _row(spooled: SpooledRecord) -> dict[str, Any] | None:
    record = spooled.record
    try:
        event = AuditEvent.from_json(spooled.event)
        chain, seq = record["chain"], record["seq"]
        if not isinstance(chain, str) or isinstance(seq, bool) or not isinstance(seq, int):
            raise InvalidAuditEvent("no chain or seq")
    except (InvalidAuditEvent, KeyError) as exc:
        log.error("audit indexer: skipped an unreadable spooled record (%s)", exc)
        return None
    return {
        "id": event.id,
        "chain_id": chain,
        "seq": seq,
        "at": event.at,
        "kind": event.kind,
        "tenant_id": event.tenant_id,
        "principal": event.principal,
        "decision": event.decision,
        "route": event.route,
        "model": event.model,
        "status": event.status,
        "record": record,
    }


def _record(row: AuditEventRow) -> AuditRecord:
    return AuditRecord(
        id=row.id,
        chain_id=row.chain_id,
        seq=row.seq,
        at=row.at,
        kind=row.kind,
        tenant_id=row.tenant_id,
        principal=row.principal,
        decision=row.decision,
        route=row.route,
        model=row.model,
        status=row.status,
        record=row.record,
    )


def _aware(value: datetime, param: str) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise ValidationFailed(f"{param} must be a datetime with a time zone", param=param)
    return value
