"""Usage queries, the price table and budget alerts, in the policy store's database.

Prices are written in a policy write transaction (``lock_for_write``, bumping
``policy_version``) so every replica's price cache reloads at its next poll;
the rollup rows are written by the audit indexer (``policy.usage.rollup``)
and only read here, except for pruning minute rows older than a day.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from sqlalchemy import Engine, and_, case, delete, func, select
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from inferflux.policy.errors import NotFound, StoreUnavailable, ValidationFailed
from inferflux.policy.store.db import lock_for_write
from inferflux.policy.store.models import BudgetAlert, ModelPrice, UsageRow
from inferflux.policy.usage.buckets import GRAINS, STEP, STORED, bucket_column
from inferflux.policy.usage.cost import Price
from inferflux.policy.usage.rollup import CANCELLED_REASONS, DAY, MINUTE, MINUTE_HOURS

GROUPS: Final = ("tenant", "key", "model")
_COLUMNS: Final = {"tenant": UsageRow.tenant_id, "key": UsageRow.key_id, "model": UsageRow.model}
MAX_PAGE: Final = 1000


@dataclass(frozen=True, slots=True)
class UsageItem:
    """One bucket of one group: ``group`` holds the grouped fields (tenant, key, model) by name."""

    bucket: datetime
    group: dict[str, str]
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost_micros: int
    refusals: dict[str, int] = field(default_factory=dict)  # by reason; a call its client left is not one
    cancelled: int = 0  # calls their client left before the answer was complete (499)


@dataclass(frozen=True, slots=True)
class PriceRecord:
    model: str
    price: Price
    updated_at: datetime


class UsageStore:
    def __init__(self, engine: Engine) -> None:
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @contextmanager
    def _session(self, *, write: bool = False, lock: bool = False) -> Iterator[Session]:
        try:
            if write:
                with self._sessions.begin() as session:
                    if lock:
                        lock_for_write(session, bump=True)
                    yield session
            else:
                with self._sessions() as session:
                    yield session
        except (OperationalError, InterfaceError) as exc:
            raise StoreUnavailable("The policy store is unavailable; retry shortly") from exc

    # -- prices

    def prices(self) -> dict[str, PriceRecord]:
        with self._session() as session:
            return {row.model: _price(row) for row in session.scalars(select(ModelPrice).order_by(ModelPrice.model))}

    def get_price(self, model: str) -> PriceRecord:
        with self._session() as session:
            row = session.get(ModelPrice, model)
            if row is None:
                raise NotFound(f"No price for model '{model}'")
            return _price(row)

    def set_price(self, model: str, price: Price) -> tuple[PriceRecord, bool]:
        """Create or replace ``model``'s price; True if it was created."""
        with self._session(write=True, lock=True) as session:
            row = session.get(ModelPrice, model)
            created = row is None
            if row is None:
                row = ModelPrice(model=model)
                session.add(row)
            row.prompt_micros_per_million = price.prompt
            row.completion_micros_per_million = price.completion
            row.updated_at = datetime.now(UTC)
            session.flush()
            return _price(row), created

    def delete_price(self, model: str) -> None:
        with self._session(write=True, lock=True) as session:
            if session.execute(delete(ModelPrice).where(ModelPrice.model == model)).rowcount == 0:  # type: ignore[attr-defined]
                raise NotFound(f"No price for model '{model}'")

    # -- budget alerts

    def claim_alert(self, counter: str, threshold: int) -> bool:
        """True for the first replica to record ``threshold`` of ``counter`` (a period's counter): it emits the event."""
        try:
            with self._session(write=True) as session:
                if session.get(BudgetAlert, (counter, threshold)) is not None:
                    return False
                session.add(BudgetAlert(counter=counter, threshold=threshold, at=datetime.now(UTC)))
        except IntegrityError:
            return False  # another replica's insert won the race
        return True

    # -- usage

    def query(
        self,
        *,
        tenant_id: str | None,
        grain: str = DAY,
        group_by: tuple[str, ...] = ("tenant",),
        key_id: str | None = None,
        model: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> tuple[list[UsageItem], bool]:
        """Buckets of ``grain`` (``GRAINS``), oldest first, summed per ``group_by``; and whether more follow.

        The stored rows counted are those whose bucket (a day's or a minute's) starts in [since,
        until); an hour sums the minute rows of its hour in that range. ``tenant_id`` None: every
        tenant (the caller decides the scope).
        """
        if grain not in GRAINS:
            raise ValidationFailed(f"group must be one of {', '.join(GRAINS)}", param="grain")
        if any(g not in GROUPS for g in group_by) or len(set(group_by)) != len(group_by):
            raise ValidationFailed(f"by must be distinct fields among {', '.join(GROUPS)}", param="by")
        if not 1 <= limit <= MAX_PAGE or offset < 0:
            raise ValidationFailed(f"limit must be from 1 to {MAX_PAGE}, offset at least 0", param="limit")
        where = [UsageRow.grain == STORED[grain]]
        for column, value in ((UsageRow.tenant_id, tenant_id), (UsageRow.key_id, key_id), (UsageRow.model, model)):
            if value is not None:
                where.append(column == value)
        if since is not None:
            where.append(UsageRow.bucket >= since)
        if until is not None:
            where.append(UsageRow.bucket < until)
        columns = [_COLUMNS[g] for g in group_by]
        bucket = bucket_column(grain)
        cancelled = UsageRow.reason.in_(CANCELLED_REASONS)
        refused = func.sum(case((and_(UsageRow.reason != "", ~cancelled), UsageRow.requests), else_=0))
        query = (
            select(bucket, *columns, func.sum(UsageRow.requests), func.sum(UsageRow.prompt_tokens),
                   func.sum(UsageRow.completion_tokens), func.sum(UsageRow.cost_micros),
                   func.sum(case((cancelled, UsageRow.requests), else_=0)), refused)
            .where(*where).group_by(bucket, *columns).order_by(bucket, *columns)
            .limit(limit + 1).offset(offset)
        )  # fmt: skip
        with self._session() as session:
            rows = session.execute(query).all()
            more = len(rows) > limit
            rows = rows[:limit]
            items = [_item(row, group_by) for row in rows]
            if items and any(row[-1] for row in rows):
                self._add_refusals(session, items, where, columns, group_by, grain)
        return items, more

    def _add_refusals(self, session: Session, items: list[UsageItem], where: list[Any], columns: list[Any],
                      group_by: tuple[str, ...], grain: str) -> None:  # fmt: skip
        found = {(item.bucket, *item.group.values()): item for item in items}
        bucket = bucket_column(grain)
        # The range on the stored column (its index), up to the end of the last bucket.
        query = (
            select(bucket, *columns, UsageRow.reason, func.sum(UsageRow.requests))
            .where(*where, UsageRow.reason != "", UsageRow.reason.not_in(CANCELLED_REASONS),
                   UsageRow.bucket >= items[0].bucket, UsageRow.bucket < items[-1].bucket + STEP[grain])
            .group_by(bucket, *columns, UsageRow.reason)
        )  # fmt: skip
        for row in session.execute(query):
            item = found.get((_aware(row[0]), *row[1:-2]))
            if item is not None:
                item.refusals[row[-2]] = int(row[-1])

    def prune_minutes(self, now: datetime | None = None) -> int:
        """Delete minute rows older than the minute window; returns how many."""
        cutoff = (now or datetime.now(UTC)) - timedelta(hours=MINUTE_HOURS)
        with self._session(write=True) as session:
            result = session.execute(delete(UsageRow).where(UsageRow.grain == MINUTE, UsageRow.bucket < cutoff))
            return int(result.rowcount or 0)  # type: ignore[attr-defined]


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _item(row: Any, group_by: tuple[str, ...]) -> UsageItem:
    n = len(group_by)
    return UsageItem(
        bucket=_aware(row[0]),
        group={g: str(v) for g, v in zip(group_by, row[1 : 1 + n], strict=True)},
        requests=int(row[1 + n]),
        prompt_tokens=int(row[2 + n]),
        completion_tokens=int(row[3 + n]),
        cost_micros=int(row[4 + n]),
        cancelled=int(row[5 + n] or 0),
    )


def _price(row: ModelPrice) -> PriceRecord:
    return PriceRecord(row.model, Price(row.prompt_micros_per_million, row.completion_micros_per_million),
                       _aware(row.updated_at))  # fmt: skip
