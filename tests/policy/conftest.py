"""Policy store fixtures: a store on SQLite in tmp_path, and one on the real PostgreSQL.

PostgreSQL tests each get a schema of their own (``search_path`` set through
the connection's options) and drop it afterwards, so they can run in parallel
and leave nothing behind. The server is ``$INFERFLUX_TEST_PG_URL`` or
postgres@127.0.0.1:5432/test; if it is down the tests are skipped, except under
CI (``$CI`` set), where that is a failure.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, pool
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from policy.store import PolicyStore, StoreSettings

PG_URL = os.environ.get("INFERFLUX_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def pg_server() -> str:
    """The test PostgreSQL's URL, once it answered."""
    engine = create_engine(PG_URL, poolclass=pool.NullPool, connect_args={"connect_timeout": 5})
    try:
        with engine.connect():
            pass
    except OperationalError as exc:
        reason = f"PostgreSQL at {make_url(PG_URL).render_as_string()} is unreachable ({exc.orig})"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI is set, so the PostgreSQL tests must run")
        pytest.skip(reason)
    finally:
        engine.dispose()
    return PG_URL


@pytest.fixture
def pg_url(pg_server: str) -> Iterator[str]:
    """A URL whose connections see only a fresh schema, dropped after the test."""
    schema = f"t_{secrets.token_hex(8)}"
    admin = create_engine(pg_server, poolclass=pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    url = make_url(pg_server).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_settings(request: pytest.FixtureRequest) -> StoreSettings:
    """Settings for a fresh store, once on each database."""
    if request.param == "sqlite":
        return StoreSettings()
    return StoreSettings(url=request.getfixturevalue("pg_url"))


@pytest.fixture
def store(store_settings: StoreSettings, data_dir: Path) -> Iterator[PolicyStore]:
    with PolicyStore.open(store_settings, data_dir) as opened:
        yield opened


@pytest.fixture
def sqlite_store(data_dir: Path) -> Iterator[PolicyStore]:
    with PolicyStore.open(StoreSettings(), data_dir) as opened:
        yield opened
