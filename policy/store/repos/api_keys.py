"""API keys: made, found by the key itself, revoked, rotated, and the platform's first admin key.

A key is shown once, when it is made; the store keeps its prefix (to find it)
and its HMAC under the store's pepper (to check it), never the key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, bindparam, or_, select, update

from inferflux.policy.authn.apikeys import DUMMY_HASH, generate_key, hash_key, parse_key, verify_key
from inferflux.policy.errors import Conflict, StoreConfigError, ValidationFailed
from inferflux.policy.store import validate
from inferflux.policy.store.models import ApiKey, Base, Tenant
from inferflux.policy.store.records import ApiKeyRecord, Page
from inferflux.policy.store.repos.base import (
    PLATFORM_ADMIN,
    PLATFORM_TENANT,
    Repository,
    flush_or_conflict,
    get_owned_row,
    get_tenant_row,
)
from inferflux.policy.store.repos.mapper import RecordMapper, optional
from inferflux.policy.store.repos.tenants import new_tenant
from inferflux.policy.store.types import new_id

log = logging.getLogger("inferflux.policy.store")

API_KEY = RecordMapper(ApiKey, ApiKeyRecord, allowed_models=optional(tuple))


class ApiKeyRepository(Repository):
    def create_api_key(
        self,
        tenant_id: str,
        name: str,
        role: str,
        allowed_models: Sequence[str] | None = None,
        expires_at: datetime | None = None,
        created_by: str = "",
    ) -> tuple[ApiKeyRecord, str]:
        """A new key; returns its record and the key itself, which is never available again."""
        validate.text(name, "name", 200)
        validate.role(role)
        models = validate.models(allowed_models, "allowed_models")
        self._check_expiry(expires_at)
        with self._write() as session:
            get_tenant_row(session, tenant_id)
            row, token = self._new_key(tenant_id, name, role, models, expires_at, created_by)
            session.add(row)
            flush_or_conflict(session, "An API key with this prefix already exists")
            return self._record(API_KEY, row), token

    def find_api_key(self, token: str) -> ApiKeyRecord | None:
        """The key ``token`` proves, if it is valid now: known, unrevoked, unexpired, tenant enabled.

        The hash is compared in constant time, and a prefix that matches no key
        costs the same comparison, so timing tells nothing about which prefixes exist.
        """
        parsed = parse_key(token)
        if parsed is None:
            return None
        with self._read() as session:
            found = session.execute(
                select(ApiKey, Tenant.disabled)
                .join(Tenant, Tenant.id == ApiKey.tenant_id)
                .where(ApiKey.prefix == parsed.prefix)
            ).one_or_none()
        if found is None:
            verify_key(self._pepper, parsed.token, DUMMY_HASH)
            return None
        row, tenant_disabled = found
        if not verify_key(self._pepper, parsed.token, row.key_hash):
            return None
        record = self._record(API_KEY, row)
        if tenant_disabled or not record.is_usable(self._now()):
            return None
        return record

    def get_api_key(self, tenant_id: str, key_id: str) -> ApiKeyRecord:
        with self._read() as session:
            return self._record(API_KEY, get_owned_row(session, ApiKey, key_id, tenant_id, "API key"))

    def list_api_keys(self, tenant_id: str, limit: int = 50, after: str | None = None) -> Page[ApiKeyRecord]:
        with self._read() as session:
            query = select(ApiKey).where(ApiKey.tenant_id == tenant_id)
            return self._page(session, query, API_KEY, limit, after)

    def revoke_api_key(self, tenant_id: str, key_id: str) -> ApiKeyRecord:
        """Revoke now; revoking a revoked key changes nothing."""
        with self._write() as session:
            row = get_owned_row(session, ApiKey, key_id, tenant_id, "API key")
            if row.revoked_at is None:
                row.revoked_at = self._now()
            return self._record(API_KEY, row)

    def rotate_api_key(
        self,
        tenant_id: str,
        key_id: str,
        grace_seconds: int = 3600,
        *,
        expires_at: datetime | None = None,
        created_by: str = "",
    ) -> tuple[ApiKeyRecord, str]:
        """A new key like the old (name, role, models, expiry); the old one expires after ``grace_seconds``.

        A rotation never lengthens a credential's life: the new key keeps the old
        one's expiry unless ``expires_at`` names another, and the old key's expiry
        only ever moves earlier. Returns the new key's record and the new key itself.
        """
        if isinstance(grace_seconds, bool) or not isinstance(grace_seconds, int) or grace_seconds < 0:
            raise ValidationFailed("grace_seconds must be a whole number of seconds, 0 or more", param="grace_seconds")
        self._check_expiry(expires_at)
        with self._write() as session:
            old = get_owned_row(session, ApiKey, key_id, tenant_id, "API key")
            now = self._now()
            if old.revoked_at is not None:
                raise Conflict(f"The API key '{key_id}' is revoked and cannot be rotated")
            if old.expires_at is not None and old.expires_at <= now:
                raise Conflict(f"The API key '{key_id}' has expired and cannot be rotated")
            if old.replaced_by is not None:
                raise Conflict(f"The API key '{key_id}' was already rotated (replaced by '{old.replaced_by}')")
            models = list(old.allowed_models) if old.allowed_models is not None else None
            expiry = expires_at if expires_at is not None else old.expires_at
            new, token = self._new_key(tenant_id, old.name, old.role, models, expiry, created_by or old.created_by)
            session.add(new)
            grace_end = now + timedelta(seconds=grace_seconds)
            old.expires_at = grace_end if old.expires_at is None else min(old.expires_at, grace_end)
            old.replaced_by = new.id
            flush_or_conflict(session, "An API key with this prefix already exists")
            return self._record(API_KEY, new), token

    def touch_api_keys(self, used: Mapping[str, datetime]) -> None:
        """Record when keys were last used (batched by the caller); not a policy change.

        A time only ever moves forward, so replicas flushing out of order agree.
        """
        if not used:
            return
        table = Base.metadata.tables[ApiKey.__tablename__]
        statement = (
            update(table)
            .where(
                table.c.id == bindparam("key_id"),
                or_(table.c.last_used_at.is_(None), table.c.last_used_at < bindparam("used_at")),
            )
            .values(last_used_at=bindparam("used_at"))
        )
        params = [{"key_id": key_id, "used_at": validate.aware(at, "used_at")} for key_id, at in used.items()]
        with self._append() as session:
            session.execute(statement, params)

    def has_platform_admin(self) -> bool:
        """Whether any platform-admin key can still authenticate (unrevoked, unexpired)."""
        with self._read() as session:
            return session.scalar(_usable_admin_keys(self._now()).limit(1)) is not None

    def ensure_bootstrap_admin(self, env_key: str | None = None) -> str | None:
        """On a store that never had a platform admin: a "platform" tenant and an admin key.

        ``env_key`` (``INFERFLUX_BOOTSTRAP_ADMIN_KEY``) must be a key in our
        format; its hash is stored and None is returned. Without it a key is
        generated and returned, once, for the caller to show. Once any
        platform-admin key exists, even a revoked one, this does nothing: a
        revoked bootstrap key must not come back because its variable is still set.
        """
        parsed = None
        if env_key:
            parsed = parse_key(env_key.strip())
            if parsed is None:
                raise StoreConfigError(
                    "INFERFLUX_BOOTSTRAP_ADMIN_KEY is not an InferFlux API key (expected "
                    "ifx_<12 characters a-z, 2-7>_<43 characters 0-9, A-Z, a-z>); unset it to have one generated"
                )
        any_admin = select(ApiKey.id).where(ApiKey.role == PLATFORM_ADMIN).limit(1)
        with self._read() as session:
            if session.scalar(any_admin) is not None:
                return None
        with self._write() as session:
            if session.scalar(any_admin) is not None:
                return None  # another replica bootstrapped first
            tenant = session.scalar(select(Tenant).where(Tenant.name == PLATFORM_TENANT))
            if tenant is None:
                tenant = new_tenant(PLATFORM_TENANT, "Platform", None, self._now())
                session.add(tenant)
                session.flush()  # before the key that refers to it: the models declare no relationships
            row, token = self._new_key(
                tenant.id, "bootstrap", PLATFORM_ADMIN, None, None, "bootstrap", parsed.token if parsed else None
            )
            session.add(row)
            flush_or_conflict(session, "The bootstrap admin key's prefix is already in use")
        log.info("bootstrapped the platform tenant with a platform-admin key (prefix %s)", row.prefix)
        return None if parsed is not None else token

    def _check_expiry(self, expires_at: datetime | None) -> None:
        if expires_at is not None and validate.aware(expires_at, "expires_at") <= self._now():
            raise ValidationFailed("expires_at is in the past", param="expires_at")

    def _new_key(
        self,
        tenant_id: str,
        name: str,
        role: str,
        allowed_models: list[str] | None,
        expires_at: datetime | None,
        created_by: str,
        token: str | None = None,
    ) -> tuple[ApiKey, str]:
        parsed = parse_key(token) if token is not None else generate_key()
        if parsed is None:
            raise ValueError("not an API key")
        row = ApiKey(
            id=new_id("key"),
            tenant_id=tenant_id,
            prefix=parsed.prefix,
            key_hash=hash_key(self._pepper, parsed.token),
            name=name,
            role=role,
            allowed_models=allowed_models,
            created_at=self._now(),
            expires_at=expires_at,
            created_by=validate.text(created_by, "created_by", 255, empty=True),
        )
        return row, parsed.token


def _usable_admin_keys(now: datetime) -> Select[Any]:
    return select(ApiKey.id).where(
        ApiKey.role == PLATFORM_ADMIN,
        ApiKey.revoked_at.is_(None),
        or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now),
    )
