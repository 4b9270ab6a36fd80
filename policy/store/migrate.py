"""Schema migrations, driven from code: there is no alembic.ini to find or ship.

``target`` is a URL (a string or ``sqlalchemy.URL``) or an open ``Engine``;
an engine is used as it is, with its connect arguments (a PostgreSQL
``search_path``, SQLite pragmas).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection, Engine, create_engine, pool
from sqlalchemy.engine import URL

from inferflux.policy.errors import StoreConfigError
from inferflux.policy.store.config import normalize_url

Target = str | URL | Engine


def script_location() -> Path:
    """Alembic's scripts (``env.py``, the revisions), beside this module: read as files, never imported."""
    return Path(__file__).parent / "migrations"


def _config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    config.attributes["connection"] = connection
    return config


@contextmanager
def _connect(target: Target) -> Iterator[Connection]:
    if isinstance(target, Engine):
        with target.begin() as connection:
            yield connection
        return
    url = normalize_url(target) if isinstance(target, str) else target
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.begin() as connection:
            yield connection
    finally:
        engine.dispose()


def head() -> str:
    revision = ScriptDirectory.from_config(_config()).get_current_head()
    if revision is None:
        raise RuntimeError(f"no migrations found in {script_location()}")
    return revision


def upgrade(target: Target, revision: str = "head") -> None:
    with _connect(target) as connection:
        _lock(connection)
        _run(command.upgrade, connection, revision)


def downgrade(target: Target, revision: str) -> None:
    with _connect(target) as connection:
        _lock(connection)
        _run(command.downgrade, connection, revision)


# Any constant will do, as long as every InferFlux uses the same: it names the lock.
_MIGRATION_LOCK = 0x1F7F_0001


def _lock(connection: Connection) -> None:
    """On PostgreSQL, one migrator at a time: replicas starting together must not race to create tables.

    The lock is released when the migration's transaction ends (PostgreSQL's
    DDL is transactional). SQLite has no such lock; it is served by one host.
    """
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")


def current(target: Target) -> str | None:
    """The schema's revision; None for a database no migration has touched."""
    with _connect(target) as connection:
        return MigrationContext.configure(connection).get_current_revision()


def _run(step: Callable[[Config, str], None], connection: Connection, revision: str) -> None:
    try:
        step(_config(connection), revision)
    except CommandError as exc:
        # Typically a revision this release does not know: the database was
        # migrated by a newer InferFlux, or the name is mistyped.
        raise StoreConfigError(f"cannot migrate the store to {revision!r}: {exc}") from None
