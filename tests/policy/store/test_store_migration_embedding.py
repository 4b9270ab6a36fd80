"""Migration 0008: a served model's ``embedding`` section, on SQLite and PostgreSQL. A model registered
before it keeps its row (the section NULL: the defaults); downgrade drops the column and the rows stay."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine, inspect, text

from inferflux.policy.store import PolicyStore, StoreSettings, migrate
from inferflux.policy.store.db import create_store_engine


@pytest.fixture
def engine(store_settings: StoreSettings, data_dir: Path) -> Iterator[Engine]:
    data_dir.mkdir()
    engine = create_store_engine(store_settings.database_url(data_dir), store_settings)
    migrate.upgrade(engine, "0007")
    yield engine
    engine.dispose()


def columns(engine: Engine) -> set[str]:
    return {column["name"] for column in inspect(engine).get_columns("served_models")}


def test_upgrade_adds_the_section_and_keeps_older_models(engine: Engine, store_settings: StoreSettings,
                                                         data_dir: Path) -> None:  # fmt: skip
    now = datetime.now(UTC)
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO served_models (id, name, path, backend, dtype, aliases, is_default, "
                                "created_at, updated_at) VALUES ('mdl_old', 'old', '/m.gguf', 'cpu', 'auto', '[]', "
                                ":f, :now, :now)"), {"f": False, "now": now})  # fmt: skip
    assert "embedding" not in columns(engine)
    migrate.upgrade(engine, "0008")
    assert "embedding" in columns(engine)
    store = PolicyStore.open(store_settings, data_dir)
    try:
        assert store.get_served_model_by_name("old").embedding is None
        section = {"pooling": "last", "normalize": False, "matryoshka": True}
        store.create_served_model("new", "/n.gguf", embedding=section)
        assert store.get_served_model_by_name("new").embedding == section
    finally:
        store.close()
    migrate.downgrade(engine, "0007")
    assert "embedding" not in columns(engine)
    with engine.connect() as connection:
        assert sorted(connection.execute(text("SELECT name FROM served_models")).scalars()) == ["new", "old"]
