"""Refusing new work the gateway could not finish properly, before it starts.

``ServiceGate`` (pure ASGI, inside the audit and metrics layers so its
refusals are counted and, where possible, audited) answers 503 before
authentication or any route runs:

* while the server drains (``gateway.drain``): every request but the probes
  and the scrape endpoint, ``server_shutting_down``;
* while the audit spool cannot take events (``AuditHealth``): every ``/v1``
  call and every admin change, ``audit_unavailable`` with Retry-After. A
  stream's status goes out before its event can be written, and an admin
  change is made before its event: both are refused up front rather than
  served or made unrecorded.

It also counts the requests in flight, which the drain waits for.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from inferflux.gateway.context import get_context
from inferflux.gateway.drain import ShuttingDown, drain_of
from inferflux.gateway.errors import render_error
from inferflux.policy.audit.errors import AuditUnavailable
from inferflux.policy.audit.events import admin_event

log = logging.getLogger("inferflux.gateway.gate")

_READS = frozenset({"GET", "HEAD", "OPTIONS"})
RETRY_AFTER_SECONDS = 2
_MESSAGES = {
    "closed": "the audit spool is closed",
    "behind": "the audit spool is behind its disk",
    "failing": "the audit spool's disk is failing",
    "disk_low": "the audit spool's disk is almost full",
}


class AuditHealth:
    """Whether the spool can take the events of new work; logs (and, for disk_low, audits) each change."""

    def __init__(self) -> None:
        self.trail: Any = None  # the AuditTrail, once the app has started
        self._last: str | None = None

    def reason(self) -> str | None:
        """None, or why new work would go unrecorded: closed, behind, failing, disk_low."""
        if self.trail is None:
            return None
        reason: str | None = self.trail.spool.health()
        if reason != self._last:
            self._changed(reason)
        return reason

    def free_bytes(self) -> float:
        return float(self.trail.spool.free_bytes()) if self.trail is not None else float("nan")

    def refusal(self) -> AuditUnavailable | None:
        reason = self.reason()
        if reason is None:
            return None
        return AuditUnavailable(
            f"New requests are refused: {_MESSAGES.get(reason, reason)}, so they could not be audited; retry shortly",
            headers={"retry-after": str(RETRY_AFTER_SECONDS)},
        )

    def _changed(self, reason: str | None) -> None:
        previous, self._last = self._last, reason
        if reason is None:
            log.warning("audit spool healthy again (was %s); accepting new requests", previous)
            return
        spool = self.trail.spool
        log.error("audit spool %s: refusing new requests (free: %d bytes, minimum: %d; audit.min_free_bytes)",
                  reason, spool.free_bytes(), spool.settings.min_free_bytes)  # fmt: skip
        if reason == "disk_low":  # events still fit: put the alert on the trail itself
            self.trail.record_nowait(admin_event(
                principal="system:gateway", action="audit.disk_low", target_kind="audit_spool",
                target_id=spool.chain_id, decision="error",
                detail={"free_bytes": spool.free_bytes(), "min_free_bytes": spool.settings.min_free_bytes},
            ))  # fmt: skip


def _needs_audit(scope: Scope) -> bool:
    path: str = scope["path"]
    return path.startswith("/v1/") or (path.startswith("/admin/") and scope.get("method") not in _READS)


class ServiceGate:
    def __init__(self, app: ASGIApp, *, exempt: frozenset[str], audit: AuditHealth) -> None:
        self.app = app
        self.exempt = exempt
        self.audit = audit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        drain = drain_of(scope.get("app"))
        refusal = ShuttingDown() if drain is not None and drain.draining else None
        if refusal is None and _needs_audit(scope):
            refusal = self.audit.refusal()
        if refusal is not None:
            await render_error(refusal, get_context(scope).request_id)(scope, receive, send)
            return
        if drain is None:
            await self.app(scope, receive, send)
            return
        drain.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            drain.inflight -= 1
