"""Credentials: secrets the gateway presents elsewhere (upstream API keys, SIEM sink tokens).

A tenant's, or the platform's (tenant_id None); the secret is sealed at rest
and opened into the record, which keeps it out of its ``repr``.
"""

from __future__ import annotations

from sqlalchemy import select

from policy.store import validate
from policy.store.models import Credential
from policy.store.records import CredentialRecord, Page
from policy.store.repos.base import UNSET, Repository, Unset, check_owner_exists, get_owned_row, owned_by
from policy.store.repos.mapper import RecordMapper
from policy.store.types import new_id

CREDENTIAL = RecordMapper(Credential, CredentialRecord)


class CredentialRepository(Repository):
    def create_credential(self, tenant_id: str | None, name: str, secret: str) -> CredentialRecord:
        now = self._now()
        name = validate.text(name, "name", 200)
        row = Credential(id=new_id("cred"), tenant_id=tenant_id, name=name, created_at=now, updated_at=now)
        with self._write() as session:
            check_owner_exists(session, tenant_id)
            row.secret = self._keys.seal(session, row, "secret", validate.secret(secret))
            session.add(row)
            return self._record(CREDENTIAL, row)

    def get_credential(self, tenant_id: str | None, credential_id: str) -> CredentialRecord:
        with self._read() as session:
            return self._record(CREDENTIAL, get_owned_row(session, Credential, credential_id, tenant_id, "credential"))

    def list_credentials(
        self, tenant_id: str | None, limit: int = 50, after: str | None = None
    ) -> Page[CredentialRecord]:
        with self._read() as session:
            query = select(Credential).where(owned_by(Credential, tenant_id))
            return self._page(session, query, CREDENTIAL, limit, after)

    def update_credential(
        self, tenant_id: str | None, credential_id: str, *, name: str | Unset = UNSET, secret: str | Unset = UNSET
    ) -> CredentialRecord:
        with self._write() as session:
            row = get_owned_row(session, Credential, credential_id, tenant_id, "credential")
            if not isinstance(name, Unset):
                row.name = validate.text(name, "name", 200)
            if not isinstance(secret, Unset):
                row.secret = self._keys.seal(session, row, "secret", validate.secret(secret))
            row.updated_at = self._now()
            return self._record(CREDENTIAL, row)

    def delete_credential(self, tenant_id: str | None, credential_id: str) -> None:
        with self._write() as session:
            session.delete(get_owned_row(session, Credential, credential_id, tenant_id, "credential"))
