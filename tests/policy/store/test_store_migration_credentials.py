"""Migration 0006: credential names unique per owner, the platform's (NULL tenant) included, on SQLite
and PostgreSQL; a store already holding two of one name is refused, not silently picked from."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError

from inferflux.policy.errors import StoreConfigError
from inferflux.policy.store import StoreSettings, migrate
from inferflux.policy.store.db import create_store_engine

NOW = datetime(2026, 11, 26, tzinfo=UTC)


@pytest.fixture
def engine(store_settings: StoreSettings, data_dir: Path) -> Iterator[Engine]:
    data_dir.mkdir()
    engine = create_store_engine(store_settings.database_url(data_dir), store_settings)
    migrate.upgrade(engine, "0005")
    with engine.begin() as connection:
        tenants = sa.Table("tenants", sa.MetaData(), autoload_with=connection)
        for tenant_id in ("ten_acme", "ten_globex"):
            connection.execute(tenants.insert().values(id=tenant_id, name=tenant_id[4:], disabled=False,
                                                       created_at=NOW, updated_at=NOW))  # fmt: skip
    yield engine
    engine.dispose()


def add(engine: Engine, credential_id: str, tenant_id: str | None, name: str) -> None:
    with engine.begin() as connection:
        credentials = sa.Table("credentials", sa.MetaData(), autoload_with=connection)
        connection.execute(credentials.insert().values(id=credential_id, tenant_id=tenant_id, name=name,
                                                       secret=b"sealed", created_at=NOW, updated_at=NOW))  # fmt: skip


def test_names_become_unique_per_owner(engine: Engine) -> None:
    add(engine, "cred_1", None, "fleet")
    add(engine, "cred_2", "ten_acme", "fleet")  # one name, three owners: fine before and after
    add(engine, "cred_3", "ten_globex", "fleet")
    migrate.upgrade(engine, "0006")
    assert migrate.current(engine) == "0006"

    with pytest.raises(IntegrityError):
        add(engine, "cred_4", None, "fleet")  # the platform's: NULL tenant ids, caught by the partial index
    with pytest.raises(IntegrityError):
        add(engine, "cred_5", "ten_acme", "fleet")
    add(engine, "cred_6", None, "other")

    migrate.downgrade(engine, "0005")
    add(engine, "cred_7", None, "fleet")  # the old schema took it
    add(engine, "cred_8", "ten_acme", "fleet")


@pytest.mark.parametrize("owner", [None, "ten_acme"])
def test_a_store_with_two_of_one_name_is_refused_and_left_as_it_was(engine: Engine, owner: str | None) -> None:
    add(engine, "cred_1", owner, "fleet")
    add(engine, "cred_2", owner, "fleet")
    add(engine, "cred_3", "ten_globex", "fleet")
    with pytest.raises(StoreConfigError, match=f"'fleet' \\({owner or 'platform'}: 2\\)"):
        migrate.upgrade(engine)
    assert migrate.current(engine) == "0005"
    add(engine, "cred_4", owner, "fleet")  # nothing of 0006 is in place
