"""Admin events: what an administrator did, appended without taking the writers' lock.

An event changes no policy, so recording one does not bump ``policy_version``;
events are kept when their tenant is deleted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select

from inferflux.policy.store import validate
from inferflux.policy.store.models import AdminEvent
from inferflux.policy.store.records import AdminEventRecord, Page
from inferflux.policy.store.repos.base import Repository
from inferflux.policy.store.repos.mapper import RecordMapper, optional
from inferflux.policy.store.types import new_id

ADMIN_EVENT = RecordMapper(AdminEvent, AdminEventRecord, detail=optional(dict))


class AdminEventRepository(Repository):
    def record_admin_event(
        self,
        *,
        principal: str,
        action: str,
        target_kind: str,
        target_id: str | None = None,
        tenant_id: str | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> AdminEventRecord:
        row = AdminEvent(
            id=new_id("evt"),
            tenant_id=tenant_id,
            at=self._now(),
            principal=principal[:255],  # an audit record is better cut short than lost
            action=validate.text(action, "action", 64),
            target_kind=validate.text(target_kind, "target_kind", 32),
            target_id=validate.optional_text(target_id, "target_id", 64),
            detail=None if detail is None else validate.json_object(detail, "detail"),
        )
        with self._append() as session:
            session.add(row)
            return self._record(ADMIN_EVENT, row)

    def list_admin_events(
        self, tenant_id: str | None, limit: int = 50, after: str | None = None
    ) -> Page[AdminEventRecord]:
        """A tenant's events, oldest first; None: every event, platform-level ones included."""
        query = select(AdminEvent)
        if tenant_id is not None:
            query = query.where(AdminEvent.tenant_id == tenant_id)
        with self._read() as session:
            return self._page(session, query, ADMIN_EVENT, limit, after, order=AdminEvent.at)
