"""Key rotation: re-encrypt every secret in the store with a new key version, online.

The steps, each safe to interrupt and run again:

1. make the new version: a new key added to the key file (old ones stay), or
   a new salt for the passphrase (or a new passphrase);
2. activate it: record its canary and make it ``key.active``, in a write
   transaction, so every writer from then on seals with it (``policy.store.db``
   explains why no writer can slip an old-version value in after this);
3. re-encrypt, table by table in primary-key order, in small write
   transactions, so that servers keep reading and writing in between;
4. check that no value of another version is left;
5. with ``prune``, drop the old versions from the key file and the store.

Servers still running read the values re-encrypted in step 3 because they
reload their key source when they meet a version they do not hold
(``policy.store.keys``). The one exception is a new passphrase: a server
started with the old one cannot derive the new key, and reads secrets again
only once restarted with the new passphrase.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import inspect, select
from sqlalchemy.orm import Session, sessionmaker

from inferflux.policy.store.db import lock_for_write
from inferflux.policy.store.keys import KeyManager, active_version
from inferflux.policy.store.models import encrypted_models
from inferflux.policy.store.records import RotationReport
from inferflux.policy.store.types import secret_columns

Progress = Callable[[str, int], None]  # (table, rows re-encrypted so far in it)
_MAX_PASSES = 3


def rotate(
    sessions: sessionmaker[Session],
    keys: KeyManager,
    *,
    new_passphrase: str | None = None,
    prune: bool = False,
    batch_size: int = 200,
    on_progress: Progress | None = None,
) -> RotationReport:
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    previous = tuple(sorted(keys.ring.versions))
    new = keys.new_version(new_passphrase)
    keys.activate(new)

    rows = values = 0
    for _ in range(_MAX_PASSES):
        pass_rows, pass_values = reencrypt(sessions, keys, batch_size=batch_size, on_progress=on_progress)
        rows, values = rows + pass_rows, values + pass_values
        if not pass_values:
            break
    else:
        raise RuntimeError(f"values sealed with old key versions keep appearing after {_MAX_PASSES} passes")

    pruned = keys.prune(new.version) if prune else ()
    return RotationReport(
        active_version=new.version,
        previous_versions=tuple(v for v in previous if v != new.version),
        rows=rows,
        values=values,
        pruned_versions=pruned,
    )


def reencrypt(
    sessions: sessionmaker[Session],
    keys: KeyManager,
    *,
    batch_size: int,
    on_progress: Progress | None = None,
) -> tuple[int, int]:
    """Re-seal every secret not sealed with the active version; (rows, values) changed."""
    rows = values = 0
    for model in encrypted_models():
        columns = secret_columns(model)
        mapper = inspect(model)
        (pk,) = mapper.primary_key
        pk_name = mapper.get_property_by_column(pk).key
        table = model.__tablename__
        table_rows = 0
        last: str | None = None
        while True:
            with sessions.begin() as session:
                lock_for_write(session, bump=False)  # a concurrent edit of the same row waits, never gets overwritten
                active = active_version(session)
                query = select(model).order_by(pk).limit(batch_size)
                if last is not None:
                    query = query.where(pk > last)
                batch = session.scalars(query).all()
                for row in batch:
                    stale = [c for c in columns if (s := getattr(row, c)) is not None and s.key_version != active]
                    for column in stale:
                        plaintext = keys.open(row, column)
                        setattr(row, column, keys.seal(session, row, column, plaintext or ""))
                    if stale:
                        table_rows += 1
                        values += len(stale)
            if on_progress is not None:
                on_progress(table, table_rows)
            if len(batch) < batch_size:
                break
            last = getattr(batch[-1], pk_name)
        rows += table_rows
    return rows, values
