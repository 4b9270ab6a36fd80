"""Engines and write transactions for the policy store.

Writers serialise on one row: every write transaction starts by updating
``store_meta['policy_version']`` (incrementing it, or rewriting it unchanged
for writes that change no policy). On PostgreSQL that is a row lock held to
commit; on SQLite the update takes the database's write lock at once, before
the transaction has read anything, so it never fails on a stale snapshot.

That order is what makes online key rotation safe: switching the active key
version is itself such a write, so a writer either commits before the switch
(and its values are re-encrypted by the rotation pass that follows) or starts
after it and reads the new active version.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Engine, Text, cast, create_engine, event, select, update
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session

from inferflux.policy.store.config import StoreSettings
from inferflux.policy.store.models import Base, StoreMeta

POLICY_VERSION = "policy_version"
_meta = Base.metadata.tables[StoreMeta.__tablename__]


def describe_url(url: URL) -> str:
    """The URL for messages and logs: no password."""
    return url.render_as_string(hide_password=True)


def create_store_engine(url: URL, settings: StoreSettings) -> Engine:
    if url.get_backend_name() == "sqlite":
        return _sqlite_engine(url, settings)
    return create_engine(
        url,
        pool_size=settings.pool_size,
        max_overflow=settings.max_overflow,
        pool_timeout=settings.pool_timeout_seconds,
        pool_recycle=settings.pool_recycle_seconds,
        pool_pre_ping=True,  # survive a database restart without a burst of failed requests
    )


def _sqlite_engine(url: URL, settings: StoreSettings) -> Engine:
    if url.database:
        _create_private_file(Path(url.database))
    engine = create_engine(url, pool_timeout=settings.pool_timeout_seconds)
    busy_ms = settings.sqlite_busy_timeout_ms

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_ms)}")
            # WAL: readers (every authenticated request) never wait for a writer.
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    return engine


def _create_private_file(path: Path) -> None:
    """Create the database file owner-only; SQLite gives its -wal and -shm files the same mode."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except FileNotFoundError:  # a missing directory: let SQLite report it on connect
        pass


def lock_for_write(session: Session, *, bump: bool) -> None:
    """The first statement of every write transaction (see the module docstring)."""
    column = _meta.c.value
    new_value = cast(cast(column, BigInteger) + 1, Text) if bump else column
    result = session.execute(update(_meta).where(_meta.c.key == POLICY_VERSION).values(value=new_value))
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise RuntimeError("store_meta has no policy_version row: the schema was not created by its migrations")


def read_policy_version(session: Session) -> int:
    value = session.execute(select(_meta.c.value).where(_meta.c.key == POLICY_VERSION)).scalar_one()
    return int(value)
