"""``PolicyStore``: the policy layer's one door to its database.

Synchronous on purpose: the gateway calls it through a thread pool, and every
method is one short transaction. Methods return frozen records
(``policy.store.records``), never ORM objects, and raise the policy layer's
own errors: ``NotFound``, ``Conflict``, ``ValidationFailed``, and
``StoreUnavailable`` when the database cannot be reached.

Tenant scope: a method on something that belongs to a tenant takes the
tenant's id, and an object of another tenant is answered exactly like a
missing one, so ids cannot be probed across tenants.

Every write that changes policy bumps ``policy_version`` in its own
transaction; replicas poll it to drop cached decisions. Recording that a key
was used and appending an admin event change no policy and do not bump it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, TypeVar

from sqlalchemy import Engine, Select, and_, bindparam, delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from policy.authn.apikeys import DUMMY_HASH, generate_key, hash_key, parse_key, verify_key
from policy.authn.bounds import TenantBounds
from policy.errors import Conflict, NotFound, StoreConfigError, StoreUnavailable, ValidationFailed
from policy.store import migrate, validate
from policy.store.config import StoreSettings
from policy.store.crypto import DecryptionError
from policy.store.db import create_store_engine, describe_url, lock_for_write, read_policy_version
from policy.store.keys import KeyManager
from policy.store.models import (
    AdminEvent,
    ApiKey,
    Base,
    Credential,
    OidcProvider,
    Policy,
    RoleBinding,
    ServedModel,
    StoreMeta,
    Tenant,
)
from policy.store.pagination import paginate
from policy.store.records import (
    AdminEventRecord,
    ApiKeyRecord,
    CredentialRecord,
    OidcProviderRecord,
    Page,
    PolicyRecord,
    RoleBindingRecord,
    RotationReport,
    ServedModelRecord,
    TenantRecord,
)
from policy.store.rotation import Progress, rotate
from policy.store.types import new_id

log = logging.getLogger("inferflux.policy.store")

M = TypeVar("M", bound=Base)
# The models that belong to a tenant (or, with tenant_id None, to the platform).
Owned = TypeVar("Owned", ApiKey, RoleBinding, Policy, Credential, OidcProvider)

PLATFORM_TENANT = "platform"
PLATFORM_ADMIN = "platform-admin"
PEPPER = "api_key_pepper"
PEPPER_BYTES = 32
BINDING_KINDS = ("subject", "group")
POLICY_KINDS = ("rate_limit", "quota", "guardrail", "opa")
DEFAULT_ALGORITHMS = ("RS256", "ES256", "EdDSA")


class _Unset(enum.Enum):
    UNSET = enum.auto()

    def __repr__(self) -> str:
        return "UNSET"


# The default of update methods' fields: "leave as it is" (None may be a value).
UNSET: Final = _Unset.UNSET

# Whose identity providers a call may reach: a tenant's id, None (the platform's), or UNSET (any).
OwnerFilter = str | _Unset | None


def _now() -> datetime:
    return datetime.now(UTC)


@contextmanager
def _unavailable_as_503() -> Iterator[None]:
    try:
        yield
    except (OperationalError, InterfaceError) as exc:
        log.error("policy store error: %s", exc)
        raise StoreUnavailable("The policy store is unavailable; retry shortly") from exc


class PolicyStore:
    """Tenants, API keys, identity providers, role bindings, models and policies."""

    def __init__(
        self, engine: Engine, sessions: sessionmaker[Session], keys: KeyManager, pepper: bytes, where: str
    ) -> None:
        """Use ``PolicyStore.open``; this wires up what it prepared."""
        self._engine = engine
        self._sessions = sessions
        self._keys = keys
        self._pepper = pepper  # the HMAC key of API key hashes; the same for the store's whole life
        self.where = where  # the database, for messages (no password)

    # -- opening and closing

    @classmethod
    def open(cls, settings: StoreSettings, data_dir: str | os.PathLike[str]) -> PolicyStore:
        """Open (creating and migrating as configured) the store; StoreConfigError if it cannot be used.

        Checks the key against the store's canaries here, so a wrong key stops
        the server at start-up rather than at the first secret it reads.
        """
        data_dir = Path(data_dir).expanduser()
        if not data_dir.exists():
            data_dir.mkdir(parents=True, mode=0o700)
        url = settings.database_url(data_dir)
        where = describe_url(url)
        engine = create_store_engine(url, settings)
        try:
            _prepare_schema(engine, where, auto_migrate=settings.auto_migrate)
            sessions = sessionmaker(engine, expire_on_commit=False)
            keys = KeyManager.from_settings(sessions, settings, data_dir, where)
            store = cls(engine, sessions, keys, _load_pepper(sessions, keys, where), where)
        except (OperationalError, InterfaceError) as exc:
            engine.dispose()
            raise StoreConfigError(f"cannot open the store at {where}: {exc.orig or exc}") from None
        except BaseException:
            engine.dispose()
            raise
        return store

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> PolicyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PolicyStore({self.where!r})"

    # -- transactions

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with _unavailable_as_503(), self._sessions() as session:
            yield session

    @contextmanager
    def _write(self, *, bump: bool = True) -> Iterator[Session]:
        """A write transaction, serialised with all others (see ``policy.store.db``)."""
        with _unavailable_as_503(), self._sessions.begin() as session:
            lock_for_write(session, bump=bump)
            yield session

    @contextmanager
    def _append(self) -> Iterator[Session]:
        """A write transaction that touches no policy and no secret, so takes no lock."""
        with _unavailable_as_503(), self._sessions.begin() as session:
            yield session

    @property
    def engine(self) -> Engine:
        """The store's connection pool, for modules that keep their own tables in the same database."""
        return self._engine

    def derive_secret(self, purpose: str) -> bytes:
        """A 32-byte server secret for ``purpose``, the same on every replica of this store.

        Derived from the store's (encrypted, never changing) API key pepper with
        the purpose as domain separation, so no second secret has to be kept.
        """
        return hmac.new(self._pepper, b"inferflux/" + purpose.encode(), hashlib.sha256).digest()

    def policy_version(self) -> int:
        """Bumped by every change of policy; replicas compare it to know when to drop caches."""
        with self._read() as session:
            return read_policy_version(session)

    # -- tenants

    def create_tenant(
        self, name: str, display_name: str | None = None, allowed_models: Sequence[str] | None = None
    ) -> TenantRecord:
        validate.slug(name, "name")
        now = _now()
        row = Tenant(
            id=new_id("ten"),
            name=name,
            display_name=validate.display_name(display_name),
            disabled=False,
            allowed_models=validate.models(allowed_models, "allowed_models"),
            created_at=now,
            updated_at=now,
        )
        with self._write() as session:
            session.add(row)
            _flush(session, f"A tenant named '{name}' already exists")
            return _tenant_record(row)

    def get_tenant(self, tenant_id: str) -> TenantRecord:
        with self._read() as session:
            return _tenant_record(self._tenant(session, tenant_id))

    def get_tenant_by_name(self, name: str) -> TenantRecord:
        with self._read() as session:
            row = session.scalar(select(Tenant).where(Tenant.name == name))
            if row is None:
                raise NotFound(f"No tenant named '{name}'")
            return _tenant_record(row)

    def list_tenants(self, limit: int = 50, after: str | None = None) -> Page[TenantRecord]:
        with self._read() as session:
            return paginate(session, select(Tenant), Tenant.created_at, Tenant.id, limit, after, _tenant_record)

    def count_tenants(self) -> int:
        with self._read() as session:
            return session.scalar(select(func.count()).select_from(Tenant)) or 0

    def update_tenant(
        self,
        tenant_id: str,
        *,
        name: str | _Unset = UNSET,
        display_name: str | _Unset | None = UNSET,
        disabled: bool | _Unset = UNSET,
        allowed_models: Sequence[str] | _Unset | None = UNSET,
    ) -> TenantRecord:
        with self._write() as session:
            row = self._tenant(session, tenant_id)
            if not isinstance(name, _Unset):
                row.name = validate.slug(name, "name")
            if not isinstance(display_name, _Unset):
                row.display_name = validate.display_name(display_name)
            if not isinstance(disabled, _Unset):
                row.disabled = validate.boolean(disabled, "disabled")
            if not isinstance(allowed_models, _Unset):
                row.allowed_models = validate.models(allowed_models, "allowed_models")
            row.updated_at = _now()
            _flush(session, f"A tenant named '{row.name}' already exists")
            return _tenant_record(row)

    def delete_tenant(self, tenant_id: str) -> None:
        """Delete the tenant with its keys, role bindings, identity providers, policies and credentials."""
        with self._write() as session:
            self._tenant(session, tenant_id)
            session.execute(delete(Tenant).where(Tenant.id == tenant_id))  # the database cascades
            # Platform-owned providers name the tenants they map into in a list, which no key cascades.
            for provider in session.scalars(select(OidcProvider).where(OidcProvider.tenant_id.is_(None))):
                if tenant_id in provider.tenant_ids:
                    provider.tenant_ids = [t for t in provider.tenant_ids if t != tenant_id]

    def _tenant(self, session: Session, tenant_id: str) -> Tenant:
        row = session.get(Tenant, tenant_id)
        if row is None:
            raise NotFound(f"No tenant '{tenant_id}'")
        return row

    # -- API keys

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
        if expires_at is not None and validate.aware(expires_at, "expires_at") <= _now():
            raise ValidationFailed("expires_at is in the past", param="expires_at")
        with self._write() as session:
            self._tenant(session, tenant_id)
            row, token = self._new_key(tenant_id, name, role, models, expires_at, created_by)
            session.add(row)
            _flush(session, "An API key with this prefix already exists")
            return _api_key_record(row), token

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
            created_at=_now(),
            expires_at=expires_at,
            created_by=validate.text(created_by, "created_by", 255, empty=True),
        )
        return row, parsed.token

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
        record = _api_key_record(row)
        if tenant_disabled or not record.is_usable(_now()):
            return None
        return record

    def get_api_key(self, tenant_id: str, key_id: str) -> ApiKeyRecord:
        with self._read() as session:
            return _api_key_record(_owned(session, ApiKey, key_id, tenant_id, "API key"))

    def list_api_keys(self, tenant_id: str, limit: int = 50, after: str | None = None) -> Page[ApiKeyRecord]:
        with self._read() as session:
            query = select(ApiKey).where(ApiKey.tenant_id == tenant_id)
            return paginate(session, query, ApiKey.created_at, ApiKey.id, limit, after, _api_key_record)

    def revoke_api_key(self, tenant_id: str, key_id: str) -> ApiKeyRecord:
        """Revoke now; revoking a revoked key changes nothing."""
        with self._write() as session:
            row = _owned(session, ApiKey, key_id, tenant_id, "API key")
            if row.revoked_at is None:
                row.revoked_at = _now()
            return _api_key_record(row)

    def rotate_api_key(
        self,
        tenant_id: str,
        key_id: str,
        grace_seconds: int = 3600,
        *,
        expires_at: datetime | None = None,
        created_by: str = "",
    ) -> tuple[ApiKeyRecord, str]:
        """A new key like the old (name, role, models); the old one expires after ``grace_seconds``.

        The old key's expiry only ever moves earlier. Returns the new key's
        record and the new key itself.
        """
        if isinstance(grace_seconds, bool) or not isinstance(grace_seconds, int) or grace_seconds < 0:
            raise ValidationFailed("grace_seconds must be a whole number of seconds, 0 or more", param="grace_seconds")
        if expires_at is not None and validate.aware(expires_at, "expires_at") <= _now():
            raise ValidationFailed("expires_at is in the past", param="expires_at")
        with self._write() as session:
            old = _owned(session, ApiKey, key_id, tenant_id, "API key")
            now = _now()
            if old.revoked_at is not None:
                raise Conflict(f"The API key '{key_id}' is revoked and cannot be rotated")
            if old.expires_at is not None and old.expires_at <= now:
                raise Conflict(f"The API key '{key_id}' has expired and cannot be rotated")
            if old.replaced_by is not None:
                raise Conflict(f"The API key '{key_id}' was already rotated (replaced by '{old.replaced_by}')")
            models = list(old.allowed_models) if old.allowed_models is not None else None
            new, token = self._new_key(tenant_id, old.name, old.role, models, expires_at, created_by or old.created_by)
            session.add(new)
            grace_end = now + timedelta(seconds=grace_seconds)
            old.expires_at = grace_end if old.expires_at is None else min(old.expires_at, grace_end)
            old.replaced_by = new.id
            _flush(session, "An API key with this prefix already exists")
            return _api_key_record(new), token

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
            return session.scalar(_usable_admin_keys(_now()).limit(1)) is not None

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
                now = _now()
                tenant = Tenant(
                    id=new_id("ten"),
                    name=PLATFORM_TENANT,
                    display_name="Platform",
                    disabled=False,
                    allowed_models=None,
                    created_at=now,
                    updated_at=now,
                )
                session.add(tenant)
                session.flush()  # before the key that refers to it: the models declare no relationships
            row, token = self._new_key(
                tenant.id, "bootstrap", PLATFORM_ADMIN, None, None, "bootstrap", parsed.token if parsed else None
            )
            session.add(row)
            _flush(session, "The bootstrap admin key's prefix is already in use")
        log.info("bootstrapped the platform tenant with a platform-admin key (prefix %s)", row.prefix)
        return None if parsed is not None else token

    # -- OIDC providers: a tenant's own, or the platform's with the tenants it may map users into
    #
    # ``owner``: UNSET for any provider (platform admins), else the owning tenant's id or None
    # for the platform-owned ones; a provider of another owner is answered as a missing one.

    def create_oidc_provider(
        self,
        name: str,
        issuer: str,
        audience: str,
        *,
        tenant_id: str | None = None,
        tenant_ids: Sequence[str] = (),
        allow_platform: bool = False,
        client_id: str | None = None,
        client_secret: str | None = None,
        jwks_uri: str | None = None,
        algorithms: Sequence[str] = DEFAULT_ALGORITHMS,
        tenant_claim: str = "tenant",
        roles_claim: str = "roles",
        role_map: Mapping[str, str] | None = None,
        required_claims: Sequence[str] = (),
        leeway_seconds: int = 30,
        enabled: bool = True,
    ) -> OidcProviderRecord:
        """A provider of ``tenant_id`` (mapping users into it alone), or platform-owned (None)
        mapping users into ``tenant_ids`` and, with ``allow_platform``, the platform tenant."""
        validate.slug(name, "name")
        now = _now()
        row = OidcProvider(
            id=new_id("idp"),
            tenant_id=tenant_id,
            tenant_ids=validate.strings(tenant_ids, "tenant_ids"),
            allow_platform=validate.boolean(allow_platform, "allow_platform"),
            name=name,
            issuer=validate.url(issuer, "issuer"),
            audience=validate.text(audience, "audience", 2048),
            client_id=validate.optional_text(client_id, "client_id", 255),
            jwks_uri=None if jwks_uri is None else validate.url(jwks_uri, "jwks_uri"),
            algorithms=validate.algorithms(algorithms),
            tenant_claim=validate.text(tenant_claim, "tenant_claim", 255),
            roles_claim=validate.text(roles_claim, "roles_claim", 255),
            role_map=validate.role_map(role_map),
            required_claims=validate.strings(required_claims, "required_claims"),
            leeway_seconds=validate.leeway(leeway_seconds),
            enabled=validate.boolean(enabled, "enabled"),
            created_at=now,
            updated_at=now,
        )
        with self._write() as session:
            if tenant_id is not None:
                self._tenant(session, tenant_id)
            self._check_provider(session, row)
            if client_secret is not None:
                row.client_secret = self._keys.seal(session, row, "client_secret", validate.secret(client_secret))
            session.add(row)
            _flush(session, f"An identity provider named '{name}' or with this issuer and audience already exists")
            return self._oidc_record(row)

    def get_oidc_provider(self, provider_id: str, *, owner: OwnerFilter = UNSET) -> OidcProviderRecord:
        with self._read() as session:
            return self._oidc_record(_provider(session, provider_id, owner))

    def list_oidc_providers(
        self, limit: int = 50, after: str | None = None, *, owner: OwnerFilter = UNSET
    ) -> Page[OidcProviderRecord]:
        query = select(OidcProvider)
        if not isinstance(owner, _Unset):
            query = query.where(_owner_is(OidcProvider, owner))
        with self._read() as session:
            return paginate(session, query, OidcProvider.created_at, OidcProvider.id, limit, after, self._oidc_record)

    def list_enabled_oidc_providers(self) -> list[OidcProviderRecord]:
        """Every enabled provider, for the token verifier (a handful; not paginated)."""
        with self._read() as session:
            rows = session.scalars(
                select(OidcProvider).where(OidcProvider.enabled.is_(True)).order_by(OidcProvider.created_at)
            ).all()
            return [self._oidc_record(row) for row in rows]

    def update_oidc_provider(
        self,
        provider_id: str,
        *,
        owner: OwnerFilter = UNSET,
        tenant_ids: Sequence[str] | _Unset = UNSET,
        allow_platform: bool | _Unset = UNSET,
        name: str | _Unset = UNSET,
        issuer: str | _Unset = UNSET,
        audience: str | _Unset = UNSET,
        client_id: str | _Unset | None = UNSET,
        client_secret: str | _Unset | None = UNSET,
        jwks_uri: str | _Unset | None = UNSET,
        algorithms: Sequence[str] | _Unset = UNSET,
        tenant_claim: str | _Unset = UNSET,
        roles_claim: str | _Unset = UNSET,
        role_map: Mapping[str, str] | _Unset = UNSET,
        required_claims: Sequence[str] | _Unset = UNSET,
        leeway_seconds: int | _Unset = UNSET,
        enabled: bool | _Unset = UNSET,
    ) -> OidcProviderRecord:
        """Change a provider; its owner never changes (delete it and register it again)."""
        with self._write() as session:
            row = _provider(session, provider_id, owner)
            if not isinstance(tenant_ids, _Unset):
                row.tenant_ids = validate.strings(tenant_ids, "tenant_ids")
            if not isinstance(allow_platform, _Unset):
                row.allow_platform = validate.boolean(allow_platform, "allow_platform")
            if not isinstance(name, _Unset):
                row.name = validate.slug(name, "name")
            if not isinstance(issuer, _Unset):
                row.issuer = validate.url(issuer, "issuer")
            if not isinstance(audience, _Unset):
                row.audience = validate.text(audience, "audience", 2048)
            if not isinstance(client_id, _Unset):
                row.client_id = validate.optional_text(client_id, "client_id", 255)
            if not isinstance(client_secret, _Unset):
                row.client_secret = (
                    None
                    if client_secret is None
                    else self._keys.seal(session, row, "client_secret", validate.secret(client_secret))
                )
            if not isinstance(jwks_uri, _Unset):
                row.jwks_uri = None if jwks_uri is None else validate.url(jwks_uri, "jwks_uri")
            if not isinstance(algorithms, _Unset):
                row.algorithms = validate.algorithms(algorithms)
            if not isinstance(tenant_claim, _Unset):
                row.tenant_claim = validate.text(tenant_claim, "tenant_claim", 255)
            if not isinstance(roles_claim, _Unset):
                row.roles_claim = validate.text(roles_claim, "roles_claim", 255)
            if not isinstance(role_map, _Unset):
                row.role_map = validate.role_map(role_map)
            if not isinstance(required_claims, _Unset):
                row.required_claims = validate.strings(required_claims, "required_claims")
            if not isinstance(leeway_seconds, _Unset):
                row.leeway_seconds = validate.leeway(leeway_seconds)
            if not isinstance(enabled, _Unset):
                row.enabled = validate.boolean(enabled, "enabled")
            self._check_provider(session, row)
            row.updated_at = _now()
            _flush(session, f"Another identity provider has the name '{row.name}' or this issuer and audience")
            return self._oidc_record(row)

    def delete_oidc_provider(self, provider_id: str, *, owner: OwnerFilter = UNSET) -> None:
        """Delete the provider and every role binding made for it."""
        with self._write() as session:
            _provider(session, provider_id, owner)
            session.execute(delete(OidcProvider).where(OidcProvider.id == provider_id))

    def _check_provider(self, session: Session, row: OidcProvider) -> None:
        """Every rule a provider row must meet, before it is written."""
        _check_provider_owner(session, row)
        _check_provider_tenants(session, row)
        _check_provider_roles(row)
        _check_issuer_audience_size(row)
        _check_issuer_free(session, row.issuer, row.audience, exclude_id=row.id)
        _check_provider_name_free(session, row)

    def _oidc_record(self, row: OidcProvider) -> OidcProviderRecord:
        return OidcProviderRecord(
            id=row.id,
            tenant_id=row.tenant_id,
            tenant_ids=tuple(row.tenant_ids),
            allow_platform=row.allow_platform,
            name=row.name,
            issuer=row.issuer,
            audience=row.audience,
            client_id=row.client_id,
            client_secret=self._keys.open(row, "client_secret"),
            jwks_uri=row.jwks_uri,
            algorithms=tuple(row.algorithms),
            tenant_claim=row.tenant_claim,
            roles_claim=row.roles_claim,
            role_map=dict(row.role_map),
            required_claims=tuple(row.required_claims),
            leeway_seconds=row.leeway_seconds,
            enabled=row.enabled,
            created_at=row.created_at,
            updated_at=row.updated_at,
        )

    # -- role bindings

    def create_role_binding(
        self, tenant_id: str, *, provider_id: str, kind: str, subject: str, role: str
    ) -> RoleBindingRecord:
        if kind not in BINDING_KINDS:
            raise ValidationFailed(f"kind must be one of {', '.join(BINDING_KINDS)}", param="kind")
        validate.text(subject, "subject", 512)
        validate.role(role)
        row = RoleBinding(
            id=new_id("rb"),
            tenant_id=tenant_id,
            provider_id=provider_id,
            kind=kind,
            subject=subject,
            role=role,
            created_at=_now(),
        )
        with self._write() as session:
            tenant = self._tenant(session, tenant_id)
            _check_binding_provider(session, tenant, provider_id, role)
            session.add(row)
            _flush(session, f"The {kind} '{subject}' of this provider already has a role binding in this tenant")
            return _binding_record(row)

    def get_role_binding(self, tenant_id: str, binding_id: str) -> RoleBindingRecord:
        with self._read() as session:
            return _binding_record(_owned(session, RoleBinding, binding_id, tenant_id, "role binding"))

    def list_role_bindings(
        self, tenant_id: str, limit: int = 50, after: str | None = None, *, provider_id: str | None = None
    ) -> Page[RoleBindingRecord]:
        with self._read() as session:
            query = select(RoleBinding).where(RoleBinding.tenant_id == tenant_id)
            if provider_id is not None:
                query = query.where(RoleBinding.provider_id == provider_id)
            return paginate(session, query, RoleBinding.created_at, RoleBinding.id, limit, after, _binding_record)

    def delete_role_binding(self, tenant_id: str, binding_id: str) -> None:
        with self._write() as session:
            session.delete(_owned(session, RoleBinding, binding_id, tenant_id, "role binding"))

    def find_role_bindings(
        self, provider_id: str, tenant_id: str, subject: str, groups: Iterable[str] = ()
    ) -> frozenset[str]:
        """The roles bound in ``tenant_id`` to this provider's ``subject`` or any of its ``groups``."""
        groups = list(groups)
        match = and_(RoleBinding.kind == "subject", RoleBinding.subject == subject)
        if groups:
            match = or_(match, and_(RoleBinding.kind == "group", RoleBinding.subject.in_(groups)))
        with self._read() as session:
            roles = session.scalars(
                select(RoleBinding.role).where(
                    RoleBinding.provider_id == provider_id, RoleBinding.tenant_id == tenant_id, match
                )
            ).all()
        return frozenset(roles)

    # -- served models (platform level)

    def create_served_model(
        self,
        name: str,
        path: str,
        backend: str = "cpu",
        dtype: str = "auto",
        aliases: Sequence[str] = (),
        is_default: bool = False,
    ) -> ServedModelRecord:
        validate.text(name, "name", 200)
        alias_list = validate.strings(aliases, "aliases")
        now = _now()
        row = ServedModel(
            id=new_id("mdl"),
            name=name,
            path=validate.text(path, "path", 4096),
            backend=validate.text(backend, "backend", 64),
            dtype=validate.text(dtype, "dtype", 16),
            aliases=alias_list,
            is_default=validate.boolean(is_default, "is_default"),
            created_at=now,
            updated_at=now,
        )
        with self._write() as session:
            _check_model_names_free(session, [name, *alias_list], exclude_id=None)
            if row.is_default:
                session.execute(update(ServedModel).values(is_default=False))
            session.add(row)
            _flush(session, f"A model named '{name}' is already registered")
            return _model_record(row)

    def get_served_model(self, model_id: str) -> ServedModelRecord:
        with self._read() as session:
            return _model_record(_get(session, ServedModel, model_id, "model"))

    def get_served_model_by_name(self, name: str) -> ServedModelRecord:
        with self._read() as session:
            row = session.scalar(select(ServedModel).where(ServedModel.name == name))
            if row is None:
                raise NotFound(f"No model '{name}'")
            return _model_record(row)

    def list_served_models(self) -> list[ServedModelRecord]:
        """Every registered model, oldest first: the registry is small and read whole at start-up."""
        with self._read() as session:
            rows = session.scalars(select(ServedModel).order_by(ServedModel.created_at, ServedModel.id)).all()
            return [_model_record(row) for row in rows]

    def update_served_model(
        self,
        model_id: str,
        *,
        path: str | _Unset = UNSET,
        backend: str | _Unset = UNSET,
        dtype: str | _Unset = UNSET,
        aliases: Sequence[str] | _Unset = UNSET,
        is_default: bool | _Unset = UNSET,
    ) -> ServedModelRecord:
        with self._write() as session:
            row = _get(session, ServedModel, model_id, "model")
            if not isinstance(path, _Unset):
                row.path = validate.text(path, "path", 4096)
            if not isinstance(backend, _Unset):
                row.backend = validate.text(backend, "backend", 64)
            if not isinstance(dtype, _Unset):
                row.dtype = validate.text(dtype, "dtype", 16)
            if not isinstance(aliases, _Unset):
                row.aliases = validate.strings(aliases, "aliases")
                _check_model_names_free(session, [row.name, *row.aliases], exclude_id=row.id)
            if not isinstance(is_default, _Unset):
                if validate.boolean(is_default, "is_default"):
                    session.execute(update(ServedModel).where(ServedModel.id != row.id).values(is_default=False))
                row.is_default = is_default
            row.updated_at = _now()
            return _model_record(row)

    def set_default_served_model(self, name: str) -> ServedModelRecord:
        """Make ``name`` the one default model (the others lose the mark)."""
        with self._write() as session:
            row = session.scalar(select(ServedModel).where(ServedModel.name == name))
            if row is None:
                raise NotFound(f"No model '{name}'")
            session.execute(update(ServedModel).where(ServedModel.id != row.id).values(is_default=False))
            row.is_default = True
            row.updated_at = _now()
            return _model_record(row)

    def delete_served_model(self, model_id: str) -> None:
        with self._write() as session:
            session.delete(_get(session, ServedModel, model_id, "model"))

    # -- policies (tenant_id None: global)

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
        now = _now()
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
            if tenant_id is not None:
                self._tenant(session, tenant_id)
            if sensitive_spec is not None:
                row.sensitive_spec = self._keys.seal(session, row, "sensitive_spec", validate.secret(sensitive_spec))
            session.add(row)
            return self._policy_record(row)

    def get_policy(self, tenant_id: str | None, policy_id: str) -> PolicyRecord:
        with self._read() as session:
            return self._policy_record(_owned(session, Policy, policy_id, tenant_id, "policy"))

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
        scope = Policy.tenant_id.is_(None) if tenant_id is None else Policy.tenant_id == tenant_id
        if include_global and tenant_id is not None:
            scope = or_(scope, Policy.tenant_id.is_(None))
        query = select(Policy).where(scope)
        if kind is not None:
            query = query.where(Policy.kind == kind)
        with self._read() as session:
            return paginate(session, query, Policy.created_at, Policy.id, limit, after, self._policy_record)

    def update_policy(
        self,
        tenant_id: str | None,
        policy_id: str,
        *,
        name: str | _Unset = UNSET,
        spec: Mapping[str, Any] | _Unset = UNSET,
        sensitive_spec: str | _Unset | None = UNSET,
        enabled: bool | _Unset = UNSET,
    ) -> PolicyRecord:
        with self._write() as session:
            row = _owned(session, Policy, policy_id, tenant_id, "policy")
            if not isinstance(name, _Unset):
                row.name = validate.text(name, "name", 200)
            if not isinstance(spec, _Unset):
                row.spec = validate.json_object(spec, "spec")
            if not isinstance(sensitive_spec, _Unset):
                row.sensitive_spec = (
                    None
                    if sensitive_spec is None
                    else self._keys.seal(session, row, "sensitive_spec", validate.secret(sensitive_spec))
                )
            if not isinstance(enabled, _Unset):
                row.enabled = validate.boolean(enabled, "enabled")
            row.updated_at = _now()
            return self._policy_record(row)

    def delete_policy(self, tenant_id: str | None, policy_id: str) -> None:
        with self._write() as session:
            session.delete(_owned(session, Policy, policy_id, tenant_id, "policy"))

    def _policy_record(self, row: Policy) -> PolicyRecord:
        return PolicyRecord(
            id=row.id,
            tenant_id=row.tenant_id,
            kind=row.kind,
            name=row.name,
            spec=dict(row.spec),
            sensitive_spec=self._keys.open(row, "sensitive_spec"),
            enabled=row.enabled,
            created_at=row.created_at,
            updated_at=row.updated_at,
        )

    # -- credentials (upstream API keys, SIEM sink tokens; tenant_id None: the platform's)

    def create_credential(self, tenant_id: str | None, name: str, secret: str) -> CredentialRecord:
        now = _now()
        name = validate.text(name, "name", 200)
        row = Credential(id=new_id("cred"), tenant_id=tenant_id, name=name, created_at=now, updated_at=now)
        with self._write() as session:
            if tenant_id is not None:
                self._tenant(session, tenant_id)
            row.secret = self._keys.seal(session, row, "secret", validate.secret(secret))
            session.add(row)
            return self._credential_record(row)

    def get_credential(self, tenant_id: str | None, credential_id: str) -> CredentialRecord:
        with self._read() as session:
            return self._credential_record(_owned(session, Credential, credential_id, tenant_id, "credential"))

    def list_credentials(
        self, tenant_id: str | None, limit: int = 50, after: str | None = None
    ) -> Page[CredentialRecord]:
        scope = Credential.tenant_id.is_(None) if tenant_id is None else Credential.tenant_id == tenant_id
        with self._read() as session:
            query = select(Credential).where(scope)
            return paginate(session, query, Credential.created_at, Credential.id, limit, after, self._credential_record)

    def update_credential(
        self, tenant_id: str | None, credential_id: str, *, name: str | _Unset = UNSET, secret: str | _Unset = UNSET
    ) -> CredentialRecord:
        with self._write() as session:
            row = _owned(session, Credential, credential_id, tenant_id, "credential")
            if not isinstance(name, _Unset):
                row.name = validate.text(name, "name", 200)
            if not isinstance(secret, _Unset):
                row.secret = self._keys.seal(session, row, "secret", validate.secret(secret))
            row.updated_at = _now()
            return self._credential_record(row)

    def delete_credential(self, tenant_id: str | None, credential_id: str) -> None:
        with self._write() as session:
            session.delete(_owned(session, Credential, credential_id, tenant_id, "credential"))

    def _credential_record(self, row: Credential) -> CredentialRecord:
        return CredentialRecord(
            id=row.id,
            tenant_id=row.tenant_id,
            name=row.name,
            secret=self._keys.open(row, "secret") or "",
            created_at=row.created_at,
            updated_at=row.updated_at,
        )

    # -- admin events

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
            at=_now(),
            principal=principal[:255],  # an audit record is better cut short than lost
            action=validate.text(action, "action", 64),
            target_kind=validate.text(target_kind, "target_kind", 32),
            target_id=validate.optional_text(target_id, "target_id", 64),
            detail=None if detail is None else validate.json_object(detail, "detail"),
        )
        with self._append() as session:
            session.add(row)
            return _event_record(row)

    def list_admin_events(
        self, tenant_id: str | None, limit: int = 50, after: str | None = None
    ) -> Page[AdminEventRecord]:
        """A tenant's events, oldest first; None: every event, platform-level ones included."""
        query = select(AdminEvent)
        if tenant_id is not None:
            query = query.where(AdminEvent.tenant_id == tenant_id)
        with self._read() as session:
            return paginate(session, query, AdminEvent.at, AdminEvent.id, limit, after, _event_record)

    # -- keys

    def rotate_key(
        self,
        *,
        new_passphrase: str | None = None,
        prune: bool = False,
        batch_size: int = 200,
        on_progress: Progress | None = None,
    ) -> RotationReport:
        """Re-encrypt every secret with a new key version; see ``policy.store.rotation``."""
        with _unavailable_as_503():
            return rotate(
                self._sessions,
                self._keys,
                new_passphrase=new_passphrase,
                prune=prune,
                batch_size=batch_size,
                on_progress=on_progress,
            )


# -- opening --------------------------------------------------------------------------


def _prepare_schema(engine: Engine, where: str, *, auto_migrate: bool) -> None:
    if auto_migrate:
        migrate.upgrade(engine)
        return
    current, head = migrate.current(engine), migrate.head()
    if current != head:
        found = f"revision {current}" if current else "no schema (an empty database)"
        raise StoreConfigError(
            f"the store at {where} has {found}, but this release needs revision {head}: "
            "run 'inferctl db upgrade', or enable store.auto_migrate"
        )


def _load_pepper(sessions: sessionmaker[Session], keys: KeyManager, where: str) -> bytes:
    """The API key pepper: made on a store's first start, encrypted like any secret, never changed."""
    with sessions() as session:
        row = session.get(StoreMeta, PEPPER)
    if row is None:
        with sessions.begin() as session:
            lock_for_write(session, bump=False)
            row = session.get(StoreMeta, PEPPER)
            if row is None:  # not made meanwhile by a replica starting beside this one
                row = StoreMeta(key=PEPPER)
                row.secret = keys.seal(session, row, "secret", secrets.token_bytes(PEPPER_BYTES).hex())
                session.add(row)
    try:
        pepper = bytes.fromhex(keys.open(row, "secret") or "")
    except (DecryptionError, ValueError) as exc:
        raise StoreConfigError(f"the API key pepper of the store at {where} is unreadable: {exc}") from None
    if len(pepper) != PEPPER_BYTES:
        raise StoreConfigError(f"the API key pepper of the store at {where} is missing or damaged")
    return pepper


# -- rows to records --------------------------------------------------------------------


def _tuple(values: Sequence[str] | None) -> tuple[str, ...] | None:
    return None if values is None else tuple(values)


def _tenant_record(row: Tenant) -> TenantRecord:
    return TenantRecord(
        id=row.id,
        name=row.name,
        display_name=row.display_name,
        disabled=row.disabled,
        allowed_models=_tuple(row.allowed_models),
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def _api_key_record(row: ApiKey) -> ApiKeyRecord:
    return ApiKeyRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        prefix=row.prefix,
        name=row.name,
        role=row.role,
        allowed_models=_tuple(row.allowed_models),
        created_at=row.created_at,
        expires_at=row.expires_at,
        revoked_at=row.revoked_at,
        last_used_at=row.last_used_at,
        replaced_by=row.replaced_by,
        created_by=row.created_by,
    )


def _binding_record(row: RoleBinding) -> RoleBindingRecord:
    return RoleBindingRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        provider_id=row.provider_id,
        kind=row.kind,
        subject=row.subject,
        role=row.role,
        created_at=row.created_at,
    )


def _model_record(row: ServedModel) -> ServedModelRecord:
    return ServedModelRecord(
        id=row.id,
        name=row.name,
        path=row.path,
        backend=row.backend,
        dtype=row.dtype,
        aliases=tuple(row.aliases),
        is_default=row.is_default,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def _event_record(row: AdminEvent) -> AdminEventRecord:
    return AdminEventRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        at=row.at,
        principal=row.principal,
        action=row.action,
        target_kind=row.target_kind,
        target_id=row.target_id,
        detail=None if row.detail is None else dict(row.detail),
    )


# -- lookups, pages ---------------------------------------------------------------------------


def _get(session: Session, model: type[M], object_id: str, what: str) -> M:
    row = session.get(model, object_id)
    if row is None:
        raise NotFound(f"No {what} '{object_id}'")
    return row


def _owned(session: Session, model: type[Owned], object_id: str, tenant_id: str | None, what: str) -> Owned:
    """The row if it belongs to ``tenant_id``; another tenant's is reported exactly as a missing one."""
    row = session.get(model, object_id)
    if row is None or row.tenant_id != tenant_id:
        raise NotFound(f"No {what} '{object_id}'")
    return row


def _flush(session: Session, conflict: str) -> None:
    """Flush now, so that a unique constraint answers as a Conflict (also when two writers race)."""
    try:
        session.flush()
    except IntegrityError:
        raise Conflict(conflict) from None


def _usable_admin_keys(now: datetime) -> Select[Any]:
    return select(ApiKey.id).where(
        ApiKey.role == PLATFORM_ADMIN,
        ApiKey.revoked_at.is_(None),
        or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > now),
    )


def _provider(session: Session, provider_id: str, owner: OwnerFilter) -> OidcProvider:
    """The provider, if ``owner`` owns it (UNSET: whoever does); another owner's answers as a missing one."""
    if isinstance(owner, _Unset):
        return _get(session, OidcProvider, provider_id, "identity provider")
    return _owned(session, OidcProvider, provider_id, owner, "identity provider")


def _owner_is(model: type[OidcProvider], owner: str | None) -> Any:
    return model.tenant_id.is_(None) if owner is None else model.tenant_id == owner


def _provider_bounds(row: OidcProvider) -> TenantBounds:
    return TenantBounds(row.tenant_id, frozenset(row.tenant_ids), row.allow_platform)


def _check_provider_owner(session: Session, row: OidcProvider) -> None:
    """The platform tenant's users come only from platform-owned providers that say so (allow_platform)."""
    if row.tenant_id is None:
        return
    owner = session.get(Tenant, row.tenant_id)
    if owner is not None and owner.name == PLATFORM_TENANT:
        raise ValidationFailed(
            "the platform tenant cannot own an identity provider; register a platform-owned one "
            "with allow_platform instead",
            param="tenant_id",
        )


def _check_provider_tenants(session: Session, row: OidcProvider) -> None:
    """A tenant's provider maps into its tenant alone; a platform-owned one into existing, ordinary tenants."""
    if row.tenant_id is not None:
        if row.tenant_ids or row.allow_platform:
            raise ValidationFailed(
                "tenant_ids and allow_platform are for platform-owned providers; a tenant's provider "
                "maps users into its own tenant only",
                param="tenant_ids" if row.tenant_ids else "allow_platform",
            )
        return
    found = {t.id: t.name for t in session.scalars(select(Tenant).where(Tenant.id.in_(row.tenant_ids)))}
    unknown = [t for t in row.tenant_ids if t not in found]
    if unknown:
        raise ValidationFailed(f"unknown tenant(s): {', '.join(unknown)}", param="tenant_ids")
    if PLATFORM_TENANT in found.values():
        raise ValidationFailed("the platform tenant is reached with allow_platform, not tenant_ids", param="tenant_ids")


def _check_provider_roles(row: OidcProvider) -> None:
    if PLATFORM_ADMIN in row.role_map.values() and not _provider_bounds(row).grants_platform_admin:
        raise ValidationFailed(
            "only a platform-owned provider with allow_platform may map a claim to platform-admin", param="role_map"
        )


# What one entry of the unique (issuer, audience) index may hold; PostgreSQL refuses entries over ~2.7 kB.
MAX_ISSUER_AUDIENCE_BYTES = 2048


def _check_issuer_audience_size(row: OidcProvider) -> None:
    if len(row.issuer.encode()) + len(row.audience.encode()) > MAX_ISSUER_AUDIENCE_BYTES:
        raise ValidationFailed(
            f"issuer and audience together must be at most {MAX_ISSUER_AUDIENCE_BYTES} bytes (UTF-8)",
            param="audience",
        )


def _check_issuer_free(session: Session, issuer: str, audience: str, *, exclude_id: str) -> None:
    """Tokens are routed to a provider by (issuer, audience) (``policy.authn.oidc``), and issuers that
    differ only in a trailing slash are one issuer there: two such providers would be ambiguous."""
    query = select(OidcProvider.issuer).where(OidcProvider.audience == audience, OidcProvider.id != exclude_id)
    for other in session.scalars(query):
        if other.rstrip("/") == issuer.rstrip("/"):
            raise Conflict(f"An identity provider with issuer '{other}' and this audience already exists")


def _check_provider_name_free(session: Session, row: OidcProvider) -> None:
    # The database's unique (tenant_id, name) does not cover platform-owned rows: NULLs never collide.
    query = select(OidcProvider.id).where(
        _owner_is(OidcProvider, row.tenant_id), OidcProvider.name == row.name, OidcProvider.id != row.id
    )
    if session.scalar(query.limit(1)) is not None:
        raise Conflict(f"An identity provider named '{row.name}' already exists")


def _check_binding_provider(session: Session, tenant: Tenant, provider_id: str, role: str) -> None:
    """A binding counts only where its provider may sign users in: a provider that may not (another
    tenant's, say) is answered exactly as one that does not exist."""
    if role == PLATFORM_ADMIN and tenant.name != PLATFORM_TENANT:
        raise ValidationFailed("platform-admin can be bound only in the platform tenant", param="role")
    # In the platform tenant, the bounds require allow_platform, which platform-admin needs too.
    provider = session.get(OidcProvider, provider_id)
    if provider is None or not _provider_bounds(provider).admits(tenant.id, is_platform=tenant.name == PLATFORM_TENANT):
        raise ValidationFailed(
            f"unknown identity provider '{provider_id}', or one that may not sign users into this tenant",
            param="provider_id",
        )


def _check_model_names_free(session: Session, names: Sequence[str], *, exclude_id: str | None) -> None:
    wanted = set(names)
    if len(wanted) != len(names):
        raise ValidationFailed("a model's name and aliases must differ from each other", param="aliases")
    query = select(ServedModel)
    if exclude_id is not None:
        query = query.where(ServedModel.id != exclude_id)
    for other in session.scalars(query):
        taken = wanted & {other.name, *other.aliases}
        if taken:
            raise Conflict(f"The model name or alias '{sorted(taken)[0]}' is taken by the model '{other.name}'")
