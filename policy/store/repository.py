"""``PolicyStore``: the policy layer's one door to its database.

Synchronous on purpose: the gateway calls it through a thread pool, and every
method is one short transaction. Methods return frozen records
(``policy.store.records``), never ORM objects, and raise the policy layer's
own errors: ``NotFound``, ``Conflict``, ``ValidationFailed``, and
``StoreUnavailable`` when the database cannot be reached.

Tenant scope: a method on something that belongs to a tenant takes the
tenant's id, and an object of another tenant is answered exactly like a
missing one, so ids cannot be probed across tenants.

Every write that changes policy bumps ``policy_version`` in its own
transaction; replicas poll it to drop cached decisions. Recording that a key
was used and appending an admin event change no policy and do not bump it.

The methods live in one repository class per record type (``policy.store.repos``:
tenants, API keys, identity providers, role bindings, served models, policies,
credentials, admin events), and ``PolicyStore`` inherits them all. Inheritance
rather than a facade that forwards to repository objects: the repositories
share all their state (sessions, key ring, pepper, clock) and hold none of
their own, so objects would only pass it around, and forwarding would write
every one of some fifty signatures twice. Callers keep one object and one
flat API (``store.create_tenant(...)``); no two repositories define the same
name (``tests/policy/store/test_store_repos.py`` checks). What is the store's
as a whole (opening, the pepper, ``policy_version``, key rotation) is here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from inferflux.policy.errors import StoreConfigError
from inferflux.policy.store import migrate
from inferflux.policy.store.config import StoreSettings
from inferflux.policy.store.crypto import DecryptionError
from inferflux.policy.store.db import create_store_engine, describe_url, lock_for_write, read_policy_version
from inferflux.policy.store.keys import KeyManager
from inferflux.policy.store.models import StoreMeta
from inferflux.policy.store.records import RotationReport
from inferflux.policy.store.repos.admin_events import AdminEventRepository
from inferflux.policy.store.repos.api_keys import ApiKeyRepository
from inferflux.policy.store.repos.base import PLATFORM_TENANT, UNSET, unavailable_as_503
from inferflux.policy.store.repos.credentials import CredentialRepository
from inferflux.policy.store.repos.identity_providers import IdentityProviderRepository, OwnerFilter
from inferflux.policy.store.repos.policies import PolicyRepository
from inferflux.policy.store.repos.role_bindings import RoleBindingRepository
from inferflux.policy.store.repos.served_models import ServedModelRepository
from inferflux.policy.store.repos.tenants import TenantRepository
from inferflux.policy.store.rotation import Progress, rotate

__all__ = ["PLATFORM_TENANT", "UNSET", "OwnerFilter", "PolicyStore"]

PEPPER = "api_key_pepper"
PEPPER_BYTES = 32


class PolicyStore(
    TenantRepository,
    ApiKeyRepository,
    IdentityProviderRepository,
    RoleBindingRepository,
    ServedModelRepository,
    PolicyRepository,
    CredentialRepository,
    AdminEventRepository,
):
    """Tenants, API keys, identity providers, role bindings, models, policies, credentials, admin events."""

    def __init__(
        self, engine: Engine, sessions: sessionmaker[Session], keys: KeyManager, pepper: bytes, where: str
    ) -> None:
        """Use ``PolicyStore.open``; this wires up what it prepared."""
        self._engine = engine
        self._sessions = sessions
        self._keys = keys
        self._pepper = pepper
        self.where = where  # the database, for messages (no password)

    # -- opening and closing

    @classmethod
    def open(cls, settings: StoreSettings, data_dir: str | os.PathLike[str]) -> PolicyStore:
        """Open (creating and migrating as configured) the store; StoreConfigError if it cannot be used.

        Checks the key against the store's canaries here, so a wrong key stops
        the server at start-up rather than at the first secret it reads.
        """
        data_dir = Path(data_dir).expanduser()
        if not data_dir.exists():
            data_dir.mkdir(parents=True, mode=0o700)
        url = settings.database_url(data_dir)
        where = describe_url(url)
        engine = create_store_engine(url, settings)
        try:
            _prepare_schema(engine, where, auto_migrate=settings.auto_migrate)
            sessions = sessionmaker(engine, expire_on_commit=False)
            keys = KeyManager.from_settings(sessions, settings, data_dir, where)
            store = cls(engine, sessions, keys, _load_pepper(sessions, keys, where), where)
        except (OperationalError, InterfaceError) as exc:
            engine.dispose()
            raise StoreConfigError(f"cannot open the store at {where}: {exc.orig or exc}") from None
        except BaseException:
            engine.dispose()
            raise
        return store

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> PolicyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PolicyStore({self.where!r})"

    # -- the store as a whole

    @property
    def engine(self) -> Engine:
        """The store's connection pool, for modules that keep their own tables in the same database."""
        return self._engine

    def derive_secret(self, purpose: str) -> bytes:
        """A 32-byte server secret for ``purpose``, the same on every replica of this store.

        Derived from the store's (encrypted, never changing) API key pepper with
        the purpose as domain separation, so no second secret has to be kept.
        """
        return hmac.new(self._pepper, b"inferflux/" + purpose.encode(), hashlib.sha256).digest()

    def policy_version(self) -> int:
        """Bumped by every change of policy; replicas compare it to know when to drop caches."""
        with self._read() as session:
            return read_policy_version(session)

    def rotate_key(
        self,
        *,
        new_passphrase: str | None = None,
        prune: bool = False,
        batch_size: int = 200,
        on_progress: Progress | None = None,
    ) -> RotationReport:
        """Re-encrypt every secret with a new key version; see ``policy.store.rotation``."""
        with unavailable_as_503():
            return rotate(
                self._sessions,
                self._keys,
                new_passphrase=new_passphrase,
                prune=prune,
                batch_size=batch_size,
                on_progress=on_progress,
            )


def _prepare_schema(engine: Engine, where: str, *, auto_migrate: bool) -> None:
    if auto_migrate:
        migrate.upgrade(engine)
        return
    current, head = migrate.current(engine), migrate.head()
    if current != head:
        found = f"revision {current}" if current else "no schema (an empty database)"
        raise StoreConfigError(
            f"the store at {where} has {found}, but this release needs revision {head}: "
            "run 'inferctl db upgrade', or enable store.auto_migrate"
        )


def _load_pepper(sessions: sessionmaker[Session], keys: KeyManager, where: str) -> bytes:
    """The API key pepper: made on a store's first start, encrypted like any secret, never changed."""
    with sessions() as session:
        row = session.get(StoreMeta, PEPPER)
    if row is None:
        with sessions.begin() as session:
            lock_for_write(session, bump=False)
            row = session.get(StoreMeta, PEPPER)
            if row is None:  # not made meanwhile by a replica starting beside this one
                row = StoreMeta(key=PEPPER)
                row.secret = keys.seal(session, row, "secret", secrets.token_bytes(PEPPER_BYTES).hex())
                session.add(row)
    try:
        pepper = bytes.fromhex(keys.open(row, "secret") or "")
    except (DecryptionError, ValueError) as exc:
        raise StoreConfigError(f"the API key pepper of the store at {where} is unreadable: {exc}") from None
    if len(pepper) != PEPPER_BYTES:
        raise StoreConfigError(f"the API key pepper of the store at {where} is missing or damaged")
    return pepper
