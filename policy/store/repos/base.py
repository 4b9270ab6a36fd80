"""What every repository of the store shares: its state, its transactions, its lookups.

A repository class (one per aggregate, in this package) holds no state of its
own: ``PolicyStore`` (``policy.store.repository``) inherits them all and sets
up what they share, declared on ``Repository`` below. Each method is one short
transaction, taken with ``_read``, ``_write`` or ``_append``, and answers a
database that cannot be reached with ``StoreUnavailable`` (503).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from sqlalchemy import ColumnElement, Engine, Select
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import InstrumentedAttribute, Session, sessionmaker

from inferflux.policy.errors import Conflict, NotFound, StoreUnavailable
from inferflux.policy.store.db import lock_for_write
from inferflux.policy.store.keys import KeyManager
from inferflux.policy.store.models import ApiKey, Base, Credential, OidcProvider, Policy, RoleBinding, Tenant
from inferflux.policy.store.pagination import paginate
from inferflux.policy.store.records import Page
from inferflux.policy.store.repos.mapper import R, RecordMapper

log = logging.getLogger("inferflux.policy.store")

PLATFORM_TENANT = "platform"
PLATFORM_ADMIN = "platform-admin"

M = TypeVar("M", bound=Base)
# The models that belong to a tenant (or, with tenant_id None, to the platform).
Owned = TypeVar("Owned", ApiKey, RoleBinding, Policy, Credential, OidcProvider)


class Unset(enum.Enum):
    UNSET = enum.auto()

    def __repr__(self) -> str:
        return "UNSET"


# The default of update methods' fields: "leave as it is" (None may be a value).
UNSET: Final = Unset.UNSET


@contextmanager
def unavailable_as_503() -> Iterator[None]:
    try:
        yield
    except (OperationalError, InterfaceError) as exc:
        log.error("policy store error: %s", exc)
        raise StoreUnavailable("The policy store is unavailable; retry shortly") from exc


class Repository:
    """The state every repository works with, and the transactions and records made from it."""

    _engine: Engine
    _sessions: sessionmaker[Session]
    _keys: KeyManager  # seals and opens secret columns
    _pepper: bytes  # the HMAC key of API key hashes; the same for the store's whole life

    def _now(self) -> datetime:
        """The store's clock: every time it stores or compares comes from here, so a test can move one store's."""
        return datetime.now(UTC)

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with unavailable_as_503(), self._sessions() as session:
            yield session

    @contextmanager
    def _write(self, *, bump: bool = True) -> Iterator[Session]:
        """A write transaction, serialised with all others (see ``policy.store.db``)."""
        with unavailable_as_503(), self._sessions.begin() as session:
            lock_for_write(session, bump=bump)
            yield session

    @contextmanager
    def _append(self) -> Iterator[Session]:
        """A write transaction that touches no policy and no secret, so takes no lock."""
        with unavailable_as_503(), self._sessions.begin() as session:
            yield session

    def _record(self, mapper: RecordMapper[R], row: Base) -> R:
        return mapper.build(row, self._keys)

    def _page(
        self,
        session: Session,
        query: Select[Any],
        mapper: RecordMapper[R],
        limit: int,
        after: str | None,
        *,
        order: InstrumentedAttribute[datetime] | None = None,
    ) -> Page[R]:
        """One page of ``query``'s rows as records, in ``order`` (default: creation) and id order (``pagination``)."""
        model: Any = mapper.model
        order = model.created_at if order is None else order
        return paginate(session, query, order, model.id, limit, after, lambda row: mapper.build(row, self._keys))


# -- lookups ----------------------------------------------------------------------------


def get_row(session: Session, model: type[M], object_id: str, what: str) -> M:
    row = session.get(model, object_id)
    if row is None:
        raise NotFound(f"No {what} '{object_id}'")
    return row


def get_tenant_row(session: Session, tenant_id: str) -> Tenant:
    return get_row(session, Tenant, tenant_id, "tenant")


def check_owner_exists(session: Session, tenant_id: str | None) -> None:
    """NotFound unless ``tenant_id`` names a tenant; None, the platform, always exists."""
    if tenant_id is not None:
        get_tenant_row(session, tenant_id)


def get_owned_row(session: Session, model: type[Owned], object_id: str, tenant_id: str | None, what: str) -> Owned:
    """The row if it belongs to ``tenant_id``; another tenant's is reported exactly as a missing one."""
    row = session.get(model, object_id)
    if row is None or row.tenant_id != tenant_id:
        raise NotFound(f"No {what} '{object_id}'")
    return row


def owned_by(model: type[Owned], tenant_id: str | None) -> ColumnElement[bool]:
    """A query's condition for the rows of ``tenant_id``; None: the platform's (or global) ones."""
    return model.tenant_id.is_(None) if tenant_id is None else model.tenant_id == tenant_id


def flush_or_conflict(session: Session, conflict: str) -> None:
    """Flush now, so that a unique constraint answers as a Conflict (also when two writers race)."""
    try:
        session.flush()
    except IntegrityError:
        raise Conflict(conflict) from None
