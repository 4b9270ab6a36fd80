"""The policy store's tables (SQLAlchemy 2 typed declarative).

Ids are strings made by the application (``types.new_id``): the prefix says
what an id names in logs and error messages, and a row's secrets are bound to
its id before it is inserted. Secret columns are ``EncryptedText`` and hold
``Sealed`` values; see ``policy.store.types`` for why.

The tables change only through Alembic migrations (``migrations/versions``);
a test compares these models with the migrated schema.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from inferflux.policy.store.crypto import Sealed
from inferflux.policy.store.types import EncryptedText, UTCDateTime, json_type, secret_columns

# Explicit constraint names: Alembic can only alter (and SQLite batch mode can
# only recreate) constraints it can name.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ID = String(32)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class StoreMeta(Base):
    """Store-wide values: the policy version, key canaries and salts, the API key pepper.

    ``value`` holds plain text; ``secret`` holds what must be encrypted (the
    pepper), so key rotation re-encrypts it like any other secret.
    """

    __tablename__ = "store_meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str | None] = mapped_column(Text)
    secret: Mapped[Sealed | None] = mapped_column(EncryptedText)


class Tenant(Base):
    """A tenant; the admin API lists tenants by (created_at, id), which its index serves (``pagination``)."""

    __tablename__ = "tenants"
    __table_args__ = (Index(None, "created_at", "id"),)

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    display_name: Mapped[str | None] = mapped_column(String(200))
    disabled: Mapped[bool]
    allowed_models: Mapped[list[str] | None] = mapped_column(json_type())  # None: every model
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ApiKey(Base):
    """A tenant's API key, listed by (created_at, id) within its tenant: the index in that order also
    serves every other use of ``tenant_id`` (the cascade from a deleted tenant), so it has no index of its own."""

    __tablename__ = "api_keys"
    __table_args__ = (Index(None, "tenant_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ID, ForeignKey("tenants.id", ondelete="CASCADE"))
    prefix: Mapped[str] = mapped_column(String(16), unique=True, index=True)
    key_hash: Mapped[bytes] = mapped_column(LargeBinary(32))  # HMAC-SHA256(pepper, key)
    name: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(32))
    allowed_models: Mapped[list[str] | None] = mapped_column(json_type())  # None: the tenant's
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    replaced_by: Mapped[str | None] = mapped_column(ID)
    created_by: Mapped[str] = mapped_column(String(255))


class OidcProvider(Base):
    """An identity provider: a tenant's own (``tenant_id``), or the platform's (None) with the
    tenants it may map users into (``tenant_ids``, and the platform tenant if ``allow_platform``).

    Names are unique per owner (platform-owned ones among themselves, checked by the store);
    (issuer, audience) pairs across all owners, since tokens are routed by them.
    """

    __tablename__ = "oidc_providers"
    __table_args__ = (UniqueConstraint("tenant_id", "name"), UniqueConstraint("issuer", "audience"))

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str | None] = mapped_column(ID, ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    tenant_ids: Mapped[list[str]] = mapped_column(json_type())
    allow_platform: Mapped[bool]
    name: Mapped[str] = mapped_column(String(63))
    issuer: Mapped[str] = mapped_column(String(2048))
    audience: Mapped[str] = mapped_column(String(2048))
    client_id: Mapped[str | None] = mapped_column(String(255))
    client_secret: Mapped[Sealed | None] = mapped_column(EncryptedText)
    jwks_uri: Mapped[str | None] = mapped_column(String(2048))
    algorithms: Mapped[list[str]] = mapped_column(json_type())
    tenant_claim: Mapped[str] = mapped_column(String(255))
    roles_claim: Mapped[str] = mapped_column(String(255))
    role_map: Mapped[dict[str, str]] = mapped_column(json_type())
    required_claims: Mapped[list[str]] = mapped_column(json_type())
    leeway_seconds: Mapped[int] = mapped_column(Integer)
    enabled: Mapped[bool]
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class RoleBinding(Base):
    """A role in a tenant for an OIDC subject (``kind="subject"``) or group (``"group"``)."""

    __tablename__ = "role_bindings"
    __table_args__ = (UniqueConstraint("tenant_id", "provider_id", "kind", "subject"),)

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ID, ForeignKey("tenants.id", ondelete="CASCADE"))
    provider_id: Mapped[str] = mapped_column(ID, ForeignKey("oidc_providers.id", ondelete="CASCADE"), index=True)
    subject: Mapped[str] = mapped_column(String(512))
    kind: Mapped[str] = mapped_column(String(16))
    role: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class ServedModelRow(Base):
    """A model registered through the admin API, loaded again at every start."""

    __tablename__ = "served_models"

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    path: Mapped[str] = mapped_column(Text)
    backend: Mapped[str] = mapped_column(String(64))
    dtype: Mapped[str] = mapped_column(String(16))
    aliases: Mapped[list[str]] = mapped_column(json_type())
    is_default: Mapped[bool]
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    # A model of a remote backend: its upstream section (endpoints, upstream model, credential name); path "".
    upstream: Mapped[dict[str, Any] | None] = mapped_column(json_type())
    # How a local model answers /v1/embeddings (pooling, normalize, matryoshka); NULL: the defaults.
    embedding: Mapped[dict[str, Any] | None] = mapped_column(json_type())
    # Batch-invariant kernels (ModelSpec.deterministic): the same logits alone or batched.
    deterministic: Mapped[bool] = mapped_column(default=False, server_default=false())
    # The load passes asked for (ModelSpec.passes: quantise, gemm_from); NULL: the backend's defaults.
    passes: Mapped[dict[str, Any] | None] = mapped_column(json_type())


class Policy(Base):
    """A rate limit, quota, guardrail or OPA policy, global (no tenant) or a tenant's.

    ``spec`` is plain JSON; what must not be readable in the database (an
    upstream token inside a guardrail, say) goes in ``sensitive_spec``.
    """

    __tablename__ = "policies"

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str | None] = mapped_column(ID, ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]] = mapped_column(json_type())
    sensitive_spec: Mapped[Sealed | None] = mapped_column(EncryptedText)
    enabled: Mapped[bool]
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class Credential(Base):
    """A secret the gateway presents elsewhere: an upstream API key, a SIEM sink token.

    Named, since a model's upstream refers to one by name: unique per owner, a tenant's by
    the constraint, the platform's (tenant_id NULL, which never collides in a constraint)
    by a partial unique index.
    """

    __tablename__ = "credentials"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name"),
        Index("uq_credentials_platform_name", "name", unique=True, postgresql_where=text("tenant_id IS NULL"),
              sqlite_where=text("tenant_id IS NULL")),  # fmt: skip
    )

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str | None] = mapped_column(ID, ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    secret: Mapped[Sealed] = mapped_column(EncryptedText)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class AdminEvent(Base):
    """What an administrator did. Kept when its tenant is deleted, hence no foreign key."""

    __tablename__ = "admin_events"
    __table_args__ = (Index(None, "tenant_id", "at"),)

    id: Mapped[str] = mapped_column(ID, primary_key=True)
    tenant_id: Mapped[str | None] = mapped_column(ID)
    at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    principal: Mapped[str] = mapped_column(String(255))
    action: Mapped[str] = mapped_column(String(64))
    target_kind: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str | None] = mapped_column(String(64))
    detail: Mapped[dict[str, Any] | None] = mapped_column(json_type())


class AuditEventRow(Base):
    """One audit event as indexed from the spool (``policy.audit.store``): what the admin queries read.

    ``record`` is the whole spooled record (chain, seq, hashes, event), so a
    page of results can be re-verified; the other columns are copies of its
    fields for the indexes. No foreign key: the trail outlives its tenant.
    """

    __tablename__ = "audit_events"
    __table_args__ = (
        UniqueConstraint("chain_id", "seq"),
        Index(None, "tenant_id", "at"),
        Index(None, "tenant_id", "principal", "at"),
        Index(None, "tenant_id", "decision", "at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the event id
    chain_id: Mapped[str] = mapped_column(String(64))
    seq: Mapped[int] = mapped_column(BigInteger)
    at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    kind: Mapped[str] = mapped_column(String(16))
    tenant_id: Mapped[str | None] = mapped_column(String(64))
    principal: Mapped[str | None] = mapped_column(String(255))
    decision: Mapped[str] = mapped_column(String(16))
    route: Mapped[str | None] = mapped_column(String(255))
    model: Mapped[str | None] = mapped_column(String(255))
    status: Mapped[int | None] = mapped_column(Integer)
    record: Mapped[dict[str, Any]] = mapped_column(json_type())


def encrypted_models() -> list[type[Base]]:
    """Every model with a secret column, found from the mappings rather than listed by hand,
    so that key rotation cannot miss a table added later."""
    models = (mapper.class_ for mapper in Base.registry.mappers)
    return sorted((m for m in models if secret_columns(m)), key=lambda m: m.__tablename__)


class AuditCheckpointRow(Base):
    """A signed head of one replica's audit chain (``policy.audit.checkpoint``), kept outside its spool.

    ``inferctl audit verify --spool DIR --checkpoints`` compares the spool's tail with the latest
    row of its chain, so deleting the last records of a spool shows. No foreign key, like the events.
    """

    __tablename__ = "audit_checkpoints"
    __table_args__ = (UniqueConstraint("chain_id", "seq"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    chain_id: Mapped[str] = mapped_column(String(64))
    seq: Mapped[int] = mapped_column(BigInteger)  # the last record covered
    hash: Mapped[str] = mapped_column(String(64))
    at: Mapped[datetime] = mapped_column(UTCDateTime)
    signature: Mapped[str] = mapped_column(String(64))


class ModelPrice(Base):
    """What a model's tokens cost (``policy.usage.cost``): micro-dollars per million prompt and completion tokens.

    Keyed by the served model's name, not a foreign key: models come and go from
    the configuration file as well as the registry, and a price set before a
    model is loaded is kept for when it is.
    """

    __tablename__ = "model_prices"

    model: Mapped[str] = mapped_column(String(255), primary_key=True)
    prompt_micros_per_million: Mapped[int] = mapped_column(BigInteger)
    completion_micros_per_million: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class UsageRow(Base):
    """Usage rolled up from the audit trail (``policy.usage.rollup``), in the indexer's transaction.

    One row per grain (``day``, or ``minute`` for the last day), bucket, tenant,
    key, model and refusal reason ('' for a request that was answered); each
    indexed event adds to its rows, so the rows are the sum of the indexed events.
    No foreign key, like the events: usage outlives its tenant.
    """

    __tablename__ = "usage_rollup"
    __table_args__ = (Index(None, "tenant_id", "grain", "bucket"), Index(None, "grain", "bucket"))

    grain: Mapped[str] = mapped_column(String(8), primary_key=True)
    bucket: Mapped[datetime] = mapped_column(UTCDateTime, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    model: Mapped[str] = mapped_column(String(255), primary_key=True)
    reason: Mapped[str] = mapped_column(String(64), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    cost_micros: Mapped[int] = mapped_column(BigInteger)


class BudgetAlert(Base):
    """A budget threshold (50, 80, 100 %) crossed in one period: the row makes its audit event once across replicas."""

    __tablename__ = "budget_alerts"

    counter: Mapped[str] = mapped_column(String(255), primary_key=True)  # the limiter's counter, period included
    threshold: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime)
