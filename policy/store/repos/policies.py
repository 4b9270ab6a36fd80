"""Policies: rate limits, quotas, guardrails and OPA policies, a tenant's or global (tenant_id None).

``spec`` is plain JSON; what must not be readable in the database goes in
``sensitive_spec``, sealed like every secret.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import or_, select

from inferflux.policy.errors import ValidationFailed
from inferflux.policy.store import validate
from inferflux.policy.store.models import Policy
from inferflux.policy.store.records import Page, PolicyRecord
from inferflux.policy.store.repos.base import UNSET, Repository, Unset, check_owner_exists, get_owned_row, owned_by
from inferflux.policy.store.repos.mapper import RecordMapper
from inferflux.policy.store.types import new_id

POLICY_KINDS = ("rate_limit", "quota", "budget", "guardrail", "opa")

POLICY = RecordMapper(Policy, PolicyRecord, spec=dict)


class PolicyRepository(Repository):
    def create_policy(
        self,
        tenant_id: str | None,
        kind: str,
        name: str,
        spec: Mapping[str, Any],
        *,
        sensitive_spec: str | None = None,
        enabled: bool = True,
    ) -> PolicyRecord:
        if kind not in POLICY_KINDS:
            raise ValidationFailed(f"kind must be one of {', '.join(POLICY_KINDS)}", param="kind")
        now = self._now()
        row = Policy(
            id=new_id("pol"),
            tenant_id=tenant_id,
            kind=kind,
            name=validate.text(name, "name", 200),
            spec=validate.json_object(spec, "spec"),
            enabled=validate.boolean(enabled, "enabled"),
            created_at=now,
            updated_at=now,
        )
        with self._write() as session:
            check_owner_exists(session, tenant_id)
            if sensitive_spec is not None:
                row.sensitive_spec = self._keys.seal(session, row, "sensitive_spec", validate.secret(sensitive_spec))
            session.add(row)
            return self._record(POLICY, row)

    def get_policy(self, tenant_id: str | None, policy_id: str) -> PolicyRecord:
        with self._read() as session:
            return self._record(POLICY, get_owned_row(session, Policy, policy_id, tenant_id, "policy"))

    def list_policies(
        self,
        tenant_id: str | None,
        limit: int = 50,
        after: str | None = None,
        *,
        kind: str | None = None,
        include_global: bool = False,
    ) -> Page[PolicyRecord]:
        """A tenant's policies (or the global ones for None); ``include_global`` adds those to a tenant's."""
        scope = owned_by(Policy, tenant_id)
        if include_global and tenant_id is not None:
            scope = or_(scope, Policy.tenant_id.is_(None))
        query = select(Policy).where(scope)
        if kind is not None:
            query = query.where(Policy.kind == kind)
        with self._read() as session:
            return self._page(session, query, POLICY, limit, after)

    def update_policy(
        self,
        tenant_id: str | None,
        policy_id: str,
        *,
        name: str | Unset = UNSET,
        spec: Mapping[str, Any] | Unset = UNSET,
        sensitive_spec: str | Unset | None = UNSET,
        enabled: bool | Unset = UNSET,
    ) -> PolicyRecord:
        with self._write() as session:
            row = get_owned_row(session, Policy, policy_id, tenant_id, "policy")
            if not isinstance(name, Unset):
                row.name = validate.text(name, "name", 200)
            if not isinstance(spec, Unset):
                row.spec = validate.json_object(spec, "spec")
            if not isinstance(sensitive_spec, Unset):
                row.sensitive_spec = (
                    None
                    if sensitive_spec is None
                    else self._keys.seal(session, row, "sensitive_spec", validate.secret(sensitive_spec))
                )
            if not isinstance(enabled, Unset):
                row.enabled = validate.boolean(enabled, "enabled")
            row.updated_at = self._now()
            return self._record(POLICY, row)

    def delete_policy(self, tenant_id: str | None, policy_id: str) -> None:
        with self._write() as session:
            session.delete(get_owned_row(session, Policy, policy_id, tenant_id, "policy"))
