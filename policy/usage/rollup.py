"""The usage rollup: indexed audit events become additive increments of ``usage_rollup``.

``increments`` and ``add`` run inside the audit indexer's transaction (``AuditStore.index``),
on exactly the events that transaction inserts: an event indexed twice (at-least-once
delivery) is found by its id and adds nothing, an event whose insert fails adds
nothing, so the rollup is always the sum of the indexed events. Every replica
indexes its own spool and adds its own increments with upserts that add
(``INSERT ... ON CONFLICT DO UPDATE SET n = n + excluded.n``), so replicas never
overwrite each other's counts.

What counts: tenant API calls (``kind`` ``api`` with a tenant), answered or
refused. An answered call adds to the row whose ``reason`` is ''; a call its
client left (status 499 with no reason) to the row ``client_closed`` (``CANCELLED``:
not a refusal, ``policy.usage.store`` counts it apart); a refused or failed one to the
row of its first reason (or ``status <code>``). A refusal
aggregate (``detail.aggregated``, ``policy.audit.refusals``) counts its repeats.
Cost is priced when the event is indexed, at the model's price then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any, Final

from sqlalchemy import Connection, Table
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from inferflux.policy.audit.events import CLIENT_CLOSED_STATUS
from inferflux.policy.usage.cost import Price, cost_micros

DAY: Final = "day"
MINUTE: Final = "minute"
MINUTE_HOURS: Final = 24  # minute rows are kept (and written) for this long
REASON_CHARS: Final = 64
CANCELLED: Final = "client_closed"  # the reason of a call its client left
# Rows of calls the client left: before CANCELLED, the rollup wrote them under their status.
CANCELLED_REASONS: Final = (CANCELLED, f"status {CLIENT_CLOSED_STATUS}")
_COUNTS: Final = ("requests", "prompt_tokens", "completion_tokens", "cost_micros")
_KEY: Final = ("grain", "bucket", "tenant_id", "key_id", "model", "reason")  # a row's identity: Key's fields

Key = tuple[str, datetime, str, str, str, str]  # grain, bucket, tenant, key, model, reason


def bucket_of(at: datetime, grain: str) -> datetime:
    at = at.astimezone(UTC)
    if grain == DAY:
        return at.replace(hour=0, minute=0, second=0, microsecond=0)
    return at.replace(second=0, microsecond=0)


def reason_of(event: Mapping[str, Any]) -> str:
    """'' for an answered call; ``CANCELLED`` for one its client left; else its first reason, or its status.

    A 499 with a reason is the server's doing (``client_timeout``: it ended a client that read
    nothing), so it stays a refusal by that reason."""
    status = event.get("status")
    if event.get("decision") == "allow" and (status is None or status < 400):
        return ""
    reasons = event.get("reasons") or ()
    if status == CLIENT_CLOSED_STATUS and not reasons:
        return CANCELLED
    reason = str(reasons[0]) if reasons else f"status {status}"
    return reason[:REASON_CHARS]


def requests_of(event: Mapping[str, Any]) -> int:
    detail = event.get("detail") or {}
    aggregated = detail.get("aggregated") if isinstance(detail, Mapping) else None
    return aggregated if isinstance(aggregated, int) and not isinstance(aggregated, bool) and aggregated > 0 else 1


def increments(
    events: Iterable[Mapping[str, Any]], price_of: Callable[[str], Price | None], now: datetime
) -> dict[Key, list[int]]:
    """The rows ``events`` (to_json dictionaries) add to: key -> [requests, prompt, completion, cost]."""
    out: dict[Key, list[int]] = {}
    recent = now - timedelta(hours=MINUTE_HOURS)
    for event in events:
        tenant = event.get("tenant_id")
        if event.get("kind") != "api" or not tenant:
            continue
        at = datetime.fromisoformat(str(event["at"]).replace("Z", "+00:00"))
        model = event.get("model") or ""
        prompt, completion = event.get("prompt_tokens") or 0, event.get("completion_tokens") or 0
        counts = (requests_of(event), prompt, completion, cost_micros(prompt, completion, price_of(model)))
        grains = (DAY, MINUTE) if at >= recent else (DAY,)
        for grain in grains:
            key = (grain, bucket_of(at, grain), tenant, event.get("key_id") or "", model, reason_of(event))
            row = out.setdefault(key, [0, 0, 0, 0])
            for i, n in enumerate(counts):
                row[i] += n
    return out


def add(connection: Connection, table: Table, rows: Mapping[Key, list[int]]) -> None:
    """Upsert ``rows``, adding to what is there (PostgreSQL or SQLite)."""
    if not rows:
        return
    values = [{**dict(zip(_KEY, key, strict=True)), **dict(zip(_COUNTS, counts, strict=True))}
              for key, counts in sorted(rows.items())]  # fmt: skip  (sorted: a stable lock order between replicas)
    connection.execute(_upsert(table, connection.dialect.name), values)


@lru_cache(maxsize=8)
def _upsert(table: Table, dialect: str) -> Any:
    """The adding upsert for ``table`` on ``dialect``, built once: building it (the ``excluded``
    columns, the ``SET`` expressions) cost the indexer more than running it, at every batch."""
    insert = postgresql_insert if dialect == "postgresql" else sqlite_insert
    statement = insert(table)
    return statement.on_conflict_do_update(
        index_elements=list(_KEY), set_={c: table.c[c] + statement.excluded[c] for c in _COUNTS}
    )
