"""Nothing secret is readable in the database: not in the SQLite file or its WAL, not in a PostgreSQL dump."""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, pool

from inferflux.policy.store import PolicyStore, StoreSettings
from inferflux.policy.store.models import Base


def fill(store: PolicyStore) -> tuple[list[str], list[str]]:
    """Create one of everything secret; returns (secrets that must not appear, public values that must)."""
    tenant = store.create_tenant("acme-at-rest")
    _, member_token = store.create_api_key(tenant.id, "ci", "member")
    rotated, _ = store.create_api_key(tenant.id, "rotating", "viewer")
    _, rotated_token = store.rotate_api_key(tenant.id, rotated.id, grace_seconds=60)
    admin_token = store.ensure_bootstrap_admin(None)
    assert admin_token is not None
    store.create_oidc_provider(
        "corp", "https://login.example", "aud", client_id="public-client-id", client_secret="OIDC-client-secret-4a7f"
    )
    store.create_credential(tenant.id, "siem", "SIEM-sink-token-9c2e")
    store.create_credential(None, "upstream", "sk-upstream-key-77b1")
    store.create_policy(
        tenant.id, "guardrail", "words", {"public": "plain-policy-spec"}, sensitive_spec="SENSITIVE-guardrail-3d5a"
    )
    tokens = [member_token, rotated_token, admin_token]
    secrets_ = [
        "OIDC-client-secret-4a7f",
        "SIEM-sink-token-9c2e",
        "sk-upstream-key-77b1",
        "SENSITIVE-guardrail-3d5a",
        *tokens,
        *(token.rsplit("_", 1)[1] for token in tokens),  # the secret part of each key alone
        store._pepper.hex(),  # the HMAC pepper is a secret too
    ]
    public = ["acme-at-rest", "public-client-id", "plain-policy-spec", tokens[0].split("_")[1]]
    return secrets_, public


def encodings(secret: str) -> dict[str, bytes]:
    raw = secret.encode()
    return {
        "plain": raw,
        "base64": base64.b64encode(raw).rstrip(b"="),
        "base64url": base64.urlsafe_b64encode(raw).rstrip(b"="),
        "hex": raw.hex().encode(),
        "HEX": raw.hex().upper().encode(),
    }


def assert_absent(secrets_: list[str], haystack: bytes, where: str) -> None:
    for secret in secrets_:
        for name, needle in encodings(secret).items():
            assert needle not in haystack, f"{secret[:12]}... found ({name}) in {where}"
    # The pepper as raw bytes too.
    pepper_hex = secrets_[-1]
    assert bytes.fromhex(pepper_hex) not in haystack, f"the pepper found (raw) in {where}"


def sqlite_bytes(data_dir: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(data_dir.glob("policy.db*")))


def test_sqlite_file_and_wal_hold_no_secret(data_dir: Path) -> None:
    store = PolicyStore.open(StoreSettings(), data_dir)
    secrets_, public = fill(store)
    assert (data_dir / "policy.db-wal").exists()
    before_checkpoint = sqlite_bytes(data_dir)
    with store._engine.connect() as connection:
        connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    after_checkpoint = sqlite_bytes(data_dir)
    store.close()
    for value in public:  # the scan does look at the data
        assert value.encode() in before_checkpoint and value.encode() in after_checkpoint
    assert_absent(secrets_, before_checkpoint, "the SQLite database and its WAL")
    assert_absent(secrets_, after_checkpoint, "the SQLite database after a checkpoint")


def test_postgresql_rows_and_dump_hold_no_secret(pg_url: str, data_dir: Path) -> None:
    store = PolicyStore.open(StoreSettings(url=pg_url), data_dir)
    secrets_, public = fill(store)
    store.close()

    engine = create_engine(StoreSettings(url=pg_url).database_url(data_dir), poolclass=pool.NullPool)
    rows = []
    with engine.connect() as connection:
        assert set(inspect(connection).get_table_names()) >= set(Base.metadata.tables)
        for table in inspect(connection).get_table_names():
            rows += connection.exec_driver_sql(f'SELECT t::text FROM "{table}" t').scalars().all()
        schema = connection.exec_driver_sql("SELECT current_schema()").scalar_one()
    engine.dispose()
    as_text = "\n".join(rows).encode()
    for value in public:
        assert value.encode() in as_text
    assert_absent(secrets_, as_text, "the PostgreSQL rows as text")

    pg_dump = shutil.which("pg_dump")
    if pg_dump is None:
        pytest.skip("pg_dump is not installed; the rows were checked as text")
    url = engine.url
    server = ["-h", url.host or "127.0.0.1", "-p", str(url.port or 5432), "-U", url.username or "postgres"]
    dump = subprocess.run(
        [pg_dump, *server, "--schema", schema, "--no-owner", url.database or "postgres"],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    assert b"acme-at-rest" in dump
    assert_absent(secrets_, dump, "pg_dump")
