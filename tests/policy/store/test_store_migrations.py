"""Alembic migrations: up, down and up again on both databases, and agreement with the models."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect

from inferflux.policy.errors import StoreConfigError
from inferflux.policy.store import StoreSettings, migrate
from inferflux.policy.store.db import create_store_engine
from inferflux.policy.store.models import Base

TABLES = {
    "store_meta",
    "model_prices",
    "usage_rollup",
    "budget_alerts",
    "tenants",
    "api_keys",
    "oidc_providers",
    "role_bindings",
    "served_models",
    "policies",
    "credentials",
    "admin_events",
    "audit_events",
    "audit_checkpoints",
}


@pytest.fixture
def engine(store_settings: StoreSettings, data_dir: Path) -> Iterator[Engine]:
    data_dir.mkdir()
    engine = create_store_engine(store_settings.database_url(data_dir), store_settings)
    yield engine
    engine.dispose()


def tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def test_upgrade_downgrade_upgrade(engine: Engine) -> None:
    assert migrate.current(engine) is None
    migrate.upgrade(engine)
    assert migrate.current(engine) == migrate.head() == "0011"
    assert tables(engine) == TABLES
    migrate.upgrade(engine)  # at head already: nothing to do
    migrate.downgrade(engine, "base")
    assert migrate.current(engine) is None
    assert tables(engine) == set()
    migrate.upgrade(engine, "head")
    assert tables(engine) == TABLES


def test_models_and_migrations_agree(engine: Engine) -> None:
    migrate.upgrade(engine)
    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def test_an_unknown_revision_is_a_clear_error(engine: Engine) -> None:
    with pytest.raises(StoreConfigError, match="cannot migrate the store to '9999'"):
        migrate.upgrade(engine, "9999")


def test_a_url_works_as_well_as_an_engine(data_dir: Path) -> None:
    data_dir.mkdir()
    url = f"sqlite:///{data_dir / 'by-url.db'}"
    migrate.upgrade(url)
    assert migrate.current(url) == migrate.head()


def test_the_migrations_are_shipped_with_the_package() -> None:
    location = migrate.script_location()
    assert (location / "env.py").is_file() and (location / "script.py.mako").is_file()
    assert (location / "versions" / "0001_initial.py").is_file()
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]["inferflux.policy.store.migrations"]
    assert {"script.py.mako", "versions/*.py"} <= set(package_data)
