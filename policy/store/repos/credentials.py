"""Credentials: secrets the gateway presents elsewhere (upstream API keys, SIEM sink tokens).

A tenant's, or the platform's (tenant_id None); the secret is sealed at rest
and opened into the record, which keeps it out of its ``repr``. Names are
slugs, unique per owner (the database's constraint and partial index), since
a model's upstream refers to its credential by name
(``credential_secret_by_name``).
"""

from __future__ import annotations

from sqlalchemy import select

from inferflux.policy.errors import NotFound
from inferflux.policy.store import validate
from inferflux.policy.store.models import Credential
from inferflux.policy.store.records import CredentialRecord, Page
from inferflux.policy.store.repos.base import (
    UNSET,
    Repository,
    Unset,
    check_owner_exists,
    flush_or_conflict,
    get_owned_row,
    owned_by,
)
from inferflux.policy.store.repos.mapper import RecordMapper
from inferflux.policy.store.types import new_id

CREDENTIAL = RecordMapper(Credential, CredentialRecord)


class CredentialRepository(Repository):
    def create_credential(self, tenant_id: str | None, name: str, secret: str) -> CredentialRecord:
        now = self._now()
        name = validate.slug(name, "name")
        row = Credential(id=new_id("cred"), tenant_id=tenant_id, name=name, created_at=now, updated_at=now)
        with self._write() as session:
            check_owner_exists(session, tenant_id)
            row.secret = self._keys.seal(session, row, "secret", validate.credential_secret(secret))
            session.add(row)
            flush_or_conflict(session, f"A credential named '{name}' already exists")
            return self._record(CREDENTIAL, row)

    def get_credential(self, tenant_id: str | None, credential_id: str) -> CredentialRecord:
        with self._read() as session:
            return self._record(CREDENTIAL, get_owned_row(session, Credential, credential_id, tenant_id, "credential"))

    def credential_secret_by_name(self, name: str) -> str:
        """The secret of the platform's credential ``name``: what a model's ``upstream.credential`` names.

        NotFound if there is none (a tenant's credential of that name is not the platform's).
        """
        with self._read() as session:
            row = session.scalar(select(Credential).where(owned_by(Credential, None), Credential.name == name))
            if row is None:
                raise NotFound(f"No credential named '{name}'")
            return self._record(CREDENTIAL, row).secret

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
                row.name = validate.slug(name, "name")
            if not isinstance(secret, Unset):
                row.secret = self._keys.seal(session, row, "secret", validate.credential_secret(secret))
            row.updated_at = self._now()
            flush_or_conflict(session, f"A credential named '{row.name}' already exists")
            return self._record(CREDENTIAL, row)

    def delete_credential(self, tenant_id: str | None, credential_id: str) -> None:
        with self._write() as session:
            session.delete(get_owned_row(session, Credential, credential_id, tenant_id, "credential"))
