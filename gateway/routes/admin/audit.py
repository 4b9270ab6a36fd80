"""Admin REST for the audit trail: queries over the indexed log, and its live tail.

* ``GET /admin/v1/tenants/{tenant_id}/audit``: one tenant's events.
* ``GET /admin/v1/audit``: a tenant admin's own tenant's events; a platform
  admin's of every tenant (platform-level admin actions included), or of the
  one named by ``tenant_id``.
* ``GET /admin/v1/audit/stream``: the same scope as a live Server-Sent Events
  tail (``event: audit``, ``id: <chain>:<seq>``, the record as spooled).

Queries take ``since`` and ``until`` (RFC 3339 with a time zone; ``since <= at
< until``), ``principal``, ``decision`` (allow | deny | error), ``kind``
(api | admin | checkpoint: the chain's signed heads), ``limit`` and ``after``; anything else is refused, since a
misspelt filter would silently widen the answer. They are served from the
``audit_events`` table, which an indexer sink fills from the spool a moment
after each event is durable, so an event just recorded may take a moment to
show here (the live tail has it at once).

Each item is the event with its place in the hash chain (``chain``, ``seq``,
``prev``, ``hash``), so a client can check it against a SIEM's copy.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway.auth import call_store
from inferflux.gateway.authz import principal_of, requires
from inferflux.gateway.openapi import document, query_param
from inferflux.gateway.pipeline.sse import SSEResponse
from inferflux.gateway.routes.admin.common import PREFIX, TENANT_PREFIX, ok, page_args, render_page, tenant_in_scope
from inferflux.gateway.state import state_of
from inferflux.policy.audit.events import DECISIONS, KINDS
from inferflux.policy.audit.store import AuditRecord
from inferflux.policy.audit.tail import Subscription, sse_message
from inferflux.policy.errors import ValidationFailed
from inferflux.policy.rbac import Principal, Scope

# An idle stream sends a comment this often, so proxies keep it open and a
# client that went away is noticed (the write fails) even when nothing happens.
HEARTBEAT_SECONDS = 15.0
_MAX_TEXT = 255
_PAGE_PARAMS = frozenset({"limit", "after"})
_FILTERS = frozenset({"since", "until", "principal", "decision", "kind"})
_SECONDS = re.compile(r"[0-9]{1,6}(\.[0-9]{1,3})?")
_MAX_STREAM_SECONDS = 86400

_DATE_TIME = {"type": "string", "format": "date-time"}
_FILTER_DOCS = (
    query_param("since", _DATE_TIME, "Events at or after this time (RFC 3339, with a time zone)"),
    query_param("until", _DATE_TIME, "Events before this time (RFC 3339, with a time zone)"),
    query_param("principal", {"type": "string", "maxLength": _MAX_TEXT}, "Who made the call: key:<prefix>, oidc:..."),
    query_param("decision", {"type": "string", "enum": list(DECISIONS)}, "The call's outcome"),
    query_param("kind", {"type": "string", "enum": list(KINDS)}, "Tenant API calls, admin actions (refused calls of the admin API too), or signed chain checkpoints"),
)
_TENANT_DOC = query_param(
    "tenant_id", {"type": "string"}, "Platform admins: this tenant's events only; others may name only their own"
)
_MAX_SECONDS_DOC = query_param(
    "max_seconds", {"type": "number", "exclusiveMinimum": 0, "maximum": _MAX_STREAM_SECONDS},
    "End the stream after this many seconds",
)


def _only(request: Request, allowed: frozenset[str]) -> None:
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        raise ValidationFailed(
            f"unknown query parameter(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}",
            param=unknown[0],
        )


def _time(request: Request, name: str) -> datetime | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        # RFC 3339 allows lower-case 't' and 'z'; fromisoformat takes 'Z' since Python 3.11.
        value = datetime.fromisoformat(raw.upper()) if len(raw) <= 40 else None
    except ValueError:
        value = None
    if value is None or value.tzinfo is None or "T" not in raw.upper():
        raise ValidationFailed(
            f"{name} must be an RFC 3339 date-time with a time zone, e.g. 2026-01-31T09:00:00Z", param=name
        )
    return value


def _filters(request: Request) -> dict[str, Any]:
    """The query's filters, checked; the store checks ``decision`` and ``kind`` against its own lists."""
    since, until = _time(request, "since"), _time(request, "until")
    if since is not None and until is not None and until <= since:
        raise ValidationFailed("until must be later than since", param="until")
    out: dict[str, Any] = {"since": since, "until": until}
    for name in ("principal", "decision", "kind"):
        value = request.query_params.get(name)
        if value is not None and not 1 <= len(value) <= _MAX_TEXT:
            raise ValidationFailed(f"{name} must be 1 to {_MAX_TEXT} characters", param=name)
        out[name] = value
    return out


def _scope_tenant(request: Request, principal: Principal) -> str | None:
    """Whose events: a tenant admin's own tenant's (another's: 404); a platform admin's choice, None for all."""
    named = request.query_params.get("tenant_id")
    if named is not None:
        principal.require_tenant(named)
        return named
    return None if principal.is_platform_admin else principal.tenant_id


def _item(record: AuditRecord) -> dict[str, Any]:
    spooled = record.record
    return {
        "object": "audit_event",
        **spooled["event"],
        "chain": spooled["chain"],
        "seq": spooled["seq"],
        "prev": spooled["prev"],
        "hash": spooled["hash"],
    }


async def _query(request: Request, tenant_id: str | None) -> Response:
    limit, after = page_args(request)
    page = await call_store(
        state_of(request).audit_store.query, tenant_id=tenant_id, limit=limit, after=after, **_filters(request)
    )
    return ok(render_page(page, _item))


@document("A tenant's audit events (filters: since, until, principal, decision, kind)", tag="audit", paginated=True,
          query=_FILTER_DOCS)  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def list_tenant_audit(request: Request) -> Response:
    _only(request, _PAGE_PARAMS | _FILTERS)
    _, tenant_id = await tenant_in_scope(request)
    return await _query(request, tenant_id)


@document("Audit events: the caller's tenant's, or for platform admins every tenant's (or tenant_id's)",
          tag="audit", paginated=True, query=(*_FILTER_DOCS, _TENANT_DOC))  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def list_audit(request: Request) -> Response:
    _only(request, _PAGE_PARAMS | _FILTERS | {"tenant_id"})
    return await _query(request, _scope_tenant(request, principal_of(request)))


@document("Live tail of the audit trail as Server-Sent Events, scoped like GET /admin/v1/audit",
          tag="audit", streams=True, query=(_TENANT_DOC, _MAX_SECONDS_DOC))  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def stream_audit(request: Request) -> Response:
    _only(request, frozenset({"tenant_id", "max_seconds"}))
    principal = principal_of(request)
    tenant_id = _scope_tenant(request, principal)
    max_seconds = _max_seconds(request)
    subscription = state_of(request).audit_trail.subscribe(tenant_id)

    async def close() -> None:
        subscription.close()

    return SSEResponse(_events(subscription, max_seconds), on_close=close)  # type: ignore[return-value]


def _max_seconds(request: Request) -> float | None:
    """``max_seconds``: end the stream after this long (for clients that poll in bounded connections)."""
    raw = request.query_params.get("max_seconds")
    if raw is None:
        return None
    if not _SECONDS.fullmatch(raw) or not 0 < float(raw) <= _MAX_STREAM_SECONDS:
        raise ValidationFailed(f"max_seconds must be a number above 0 and at most {_MAX_STREAM_SECONDS}",
                               param="max_seconds")  # fmt: skip
    return float(raw)


async def _events(subscription: Subscription, max_seconds: float | None) -> AsyncIterator[bytes]:
    """The subscription as SSE bytes: a first comment once subscribed, heartbeats while idle."""
    loop = asyncio.get_running_loop()
    deadline = math.inf if max_seconds is None else loop.time() + max_seconds
    # Sent at once: a client knows from it that every event from now on reaches it.
    yield b": subscribed\n\n"
    items = aiter(subscription)
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            # The pending read is never cancelled by a timeout (that would end the
            # subscription's iterator); it is waited on again after the heartbeat.
            left = deadline - loop.time()
            done, _ = await asyncio.wait({pending}, timeout=max(min(HEARTBEAT_SECONDS, left), 0.0))
            if not done:
                if left <= HEARTBEAT_SECONDS:  # this wait was the last (its timer may fire a hair early)
                    return
                yield b": keep-alive\n\n"
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:  # closed: the gateway is stopping
                return
            pending = None
            yield sse_message(item)
    finally:
        subscription.close()
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)


def routes() -> list[BaseRoute]:
    return [
        Route(TENANT_PREFIX + "/audit", list_tenant_audit, methods=["GET"]),
        Route(PREFIX + "/audit", list_audit, methods=["GET"]),
        Route(PREFIX + "/audit/stream", stream_audit, methods=["GET"]),
    ]
