"""Column types and ids for the policy store.

Secret columns, and why the column type does not encrypt
---------------------------------------------------------

Every secret is sealed with AES-256-GCM (``policy.store.crypto``) and the
associated data names where it lives: ``inferflux:v1:<table>:<column>:<row
id>``. A ciphertext copied into another row or column (by an attacker with
write access to the database, or by a buggy migration) then fails its tag
check instead of decrypting as somebody else's secret.

``TypeDecorator.process_bind_param`` sees a value and a dialect, never the row,
so it cannot bind that associated data. The two usual ways round it both hide
too much: mapper events that swap plaintext for ciphertext around a flush (and
back afterwards, and again after every load) leave the attribute holding
different things at different moments and need the key ring through a global
or ``session.info``; a ContextVar carrying "the current row" is worse.

So the work is split where each part has what it needs:

* ``EncryptedText`` owns the storage format. An attribute of this type holds a
  ``Sealed`` value (version, nonce, ciphertext), which the type writes as the
  bytes ``crypto`` defines and parses back on load, rejecting malformed blobs.
  It refuses a ``str``: plaintext cannot reach the database through it, even
  by mistake.
* The repository seals and opens with its key ring and ``secret_aad(row,
  column)``. Primary keys are made by the application (``new_id``), so a row
  knows its id, and thus its associated data, before it is inserted.

Key rotation needs nothing model-specific either: ``secret_columns`` finds every
``EncryptedText`` column of every mapped table, and each ``Sealed`` carries the
key version it was made with.

Timestamps use ``UTCDateTime``: aware UTC datetimes in and out on both SQLite
(which has no time zones) and PostgreSQL (``timestamptz``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime, LargeBinary, inspect
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.types import TypeDecorator, TypeEngine

from inferflux.policy.ids import random_id
from inferflux.policy.store.crypto import Sealed

ID_RANDOM_CHARS = 16  # 80 bits
AAD_PREFIX = "inferflux:v1"


def new_id(kind: str) -> str:
    """``"ten_" + 16 random base32 characters`` for ``kind="ten"``.

    Made by the application rather than the database so that a row's id, and
    with it the associated data of its secrets, is known before the insert.
    """
    return random_id(kind, ID_RANDOM_CHARS)


class EncryptedText(TypeDecorator[Sealed]):
    """A secret: ``Sealed`` in Python, the sealed bytes in the database."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: Sealed | None, dialect: Dialect) -> bytes | None:
        if value is None:
            return None
        if not isinstance(value, Sealed):
            raise TypeError(
                f"an EncryptedText column takes a Sealed value, not {type(value).__name__}: "
                "seal secrets with the store's key ring before they reach the database"
            )
        return value.to_bytes()

    def process_result_value(self, value: bytes | None, dialect: Dialect) -> Sealed | None:
        return None if value is None else Sealed.from_bytes(bytes(value))

    @property
    def python_type(self) -> type[Sealed]:
        return Sealed


class UTCDateTime(TypeDecorator[datetime]):
    """Aware datetimes, stored as UTC; naive ones are refused rather than guessed at."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value.isoformat()} given where an aware one is required")
        value = value.astimezone(UTC)
        # SQLite stores text without an offset; keep every stored value in UTC.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def json_type() -> TypeEngine[Any]:
    """JSON where Python None is SQL NULL (the default would store the JSON text ``null``)."""
    return JSON(none_as_null=True)


# -- secrets on rows -----------------------------------------------------------


def secret_aad(table: str, column: str, row_id: str) -> bytes:
    return f"{AAD_PREFIX}:{table}:{column}:{row_id}".encode()


def row_aad(row: DeclarativeBase, column: str) -> bytes:
    """The associated data for ``row``'s secret ``column``: table, column and primary key."""
    mapper = inspect(row).mapper
    (pk,) = mapper.primary_key_from_instance(row)
    if not isinstance(pk, str) or not pk:
        raise ValueError(f"a {mapper.class_.__name__} needs its id before a secret can be sealed for it")
    return secret_aad(mapper.local_table.name, mapper.columns[column].name, pk)  # type: ignore[attr-defined]


def secret_columns(model: type[DeclarativeBase]) -> tuple[str, ...]:
    """The attribute names of ``model``'s encrypted columns."""
    mapper = inspect(model)
    return tuple(attr.key for attr in mapper.column_attrs if isinstance(attr.columns[0].type, EncryptedText))
