"""The policy store: tenants, API keys, OIDC providers and role bindings, models, policies.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Written by hand to read as the schema's reference. Columns use plain
SQLAlchemy types, not the application's: ``EncryptedText`` is stored as
LargeBinary and ``UTCDateTime`` as a timezone-aware DateTime, and a migration
must not change meaning when those classes do.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.String(32)


def _timestamp(name: str, *, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


# Long: the first schema, one create_table a table; a revision is frozen once released, so it is not split.
def upgrade() -> None:
    store_meta = op.create_table(
        "store_meta",
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("value", sa.Text(), nullable=True),
        sa.Column("secret", sa.LargeBinary(), nullable=True),  # sealed (AES-GCM)
        sa.PrimaryKeyConstraint("key", name="pk_store_meta"),
    )
    # Every write transaction starts by updating this row (policy.store.db).
    op.bulk_insert(store_meta, [{"key": "policy_version", "value": "0"}])

    op.create_table(
        "tenants",
        sa.Column("id", ID, nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("display_name", sa.String(200), nullable=True),
        sa.Column("disabled", sa.Boolean(), nullable=False),
        sa.Column("allowed_models", sa.JSON(), nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_tenants"),
        sa.UniqueConstraint("name", name="uq_tenants_name"),
    )

    op.create_table(
        "api_keys",
        sa.Column("id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.LargeBinary(32), nullable=False),  # HMAC-SHA256(pepper, key)
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("role", sa.String(32), nullable=False),
        sa.Column("allowed_models", sa.JSON(), nullable=True),
        _timestamp("created_at"),
        _timestamp("expires_at", nullable=True),
        _timestamp("revoked_at", nullable=True),
        _timestamp("last_used_at", nullable=True),
        sa.Column("replaced_by", ID, nullable=True),
        sa.Column("created_by", sa.String(255), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_api_keys_tenant_id_tenants", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_api_keys_prefix", "api_keys", ["prefix"], unique=True)
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])

    op.create_table(
        "oidc_providers",
        sa.Column("id", ID, nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("issuer", sa.String(2048), nullable=False),
        sa.Column("audience", sa.String(2048), nullable=False),
        sa.Column("client_id", sa.String(255), nullable=True),
        sa.Column("client_secret", sa.LargeBinary(), nullable=True),  # sealed
        sa.Column("jwks_uri", sa.String(2048), nullable=True),
        sa.Column("algorithms", sa.JSON(), nullable=False),
        sa.Column("tenant_claim", sa.String(255), nullable=False),
        sa.Column("roles_claim", sa.String(255), nullable=False),
        sa.Column("role_map", sa.JSON(), nullable=False),
        sa.Column("required_claims", sa.JSON(), nullable=False),
        sa.Column("leeway_seconds", sa.Integer(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_oidc_providers"),
        sa.UniqueConstraint("name", name="uq_oidc_providers_name"),
        sa.UniqueConstraint("issuer", name="uq_oidc_providers_issuer"),
    )

    op.create_table(
        "role_bindings",
        sa.Column("id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=False),
        sa.Column("provider_id", ID, nullable=False),
        sa.Column("subject", sa.String(512), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),  # "subject" | "group"
        sa.Column("role", sa.String(32), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_role_bindings"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_role_bindings_tenant_id_tenants", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["provider_id"],
            ["oidc_providers.id"],
            name="fk_role_bindings_provider_id_oidc_providers",
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint(
            "tenant_id", "provider_id", "kind", "subject", name="uq_role_bindings_tenant_id_provider_id_kind_subject"
        ),
    )
    op.create_index("ix_role_bindings_provider_id", "role_bindings", ["provider_id"])

    op.create_table(
        "served_models",
        sa.Column("id", ID, nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("backend", sa.String(64), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("aliases", sa.JSON(), nullable=False),
        sa.Column("is_default", sa.Boolean(), nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_served_models"),
        sa.UniqueConstraint("name", name="uq_served_models_name"),
    )

    op.create_table(
        "policies",
        sa.Column("id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=True),  # NULL: global
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("sensitive_spec", sa.LargeBinary(), nullable=True),  # sealed
        sa.Column("enabled", sa.Boolean(), nullable=False),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_policies"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_policies_tenant_id_tenants", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_policies_tenant_id", "policies", ["tenant_id"])

    op.create_table(
        "credentials",
        sa.Column("id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=True),  # NULL: the platform's own
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("secret", sa.LargeBinary(), nullable=False),  # sealed
        _timestamp("created_at"),
        _timestamp("updated_at"),
        sa.PrimaryKeyConstraint("id", name="pk_credentials"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_credentials_tenant_id_tenants", ondelete="CASCADE"
        ),
    )
    op.create_index("ix_credentials_tenant_id", "credentials", ["tenant_id"])

    # No foreign key: an admin event outlives the tenant it was about.
    op.create_table(
        "admin_events",
        sa.Column("id", ID, nullable=False),
        sa.Column("tenant_id", ID, nullable=True),
        _timestamp("at"),
        sa.Column("principal", sa.String(255), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target_kind", sa.String(32), nullable=False),
        sa.Column("target_id", sa.String(64), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_admin_events"),
    )
    op.create_index("ix_admin_events_at", "admin_events", ["at"])
    op.create_index("ix_admin_events_tenant_id_at", "admin_events", ["tenant_id", "at"])


def downgrade() -> None:
    op.drop_table("admin_events")
    op.drop_table("credentials")
    op.drop_table("policies")
    op.drop_table("served_models")
    op.drop_table("role_bindings")
    op.drop_table("oidc_providers")
    op.drop_table("api_keys")
    op.drop_table("tenants")
    op.drop_table("store_meta")
