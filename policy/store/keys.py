"""The store's key ring: where the keys come from, and proof that they are the right ones.

For every key version the store has used, ``store_meta`` holds a canary: a
known value sealed with that version. Opening the store decrypts the canary of
every version the key source offers, so a wrong key file or passphrase stops
the server at start-up with a message saying which, instead of failing on the
first secret it reads. ``key.active`` names the version new values are sealed
with; the store's record decides, not the key file, so every replica seals
with the same version.

During an online rotation another process adds a version and makes it active.
A running server notices when it meets a version it does not hold (in a value
it reads, or as the active version when it writes) and reloads its key source
once: a key file edited in place by ``inferctl admin rotate-key``, or a new
salt for the same passphrase.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import delete, insert, select, update
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from inferflux.policy.errors import StoreConfigError
from inferflux.policy.fileio import remove_temporaries
from inferflux.policy.store.config import StoreSettings
from inferflux.policy.store.crypto import (
    DecryptionError,
    KeyFile,
    KeyRing,
    Sealed,
    UnknownKeyVersion,
    create_key_file,
    derive_key,
    new_key,
    new_salt,
    read_key_file,
    replace_key_file,
)
from inferflux.policy.store.db import lock_for_write
from inferflux.policy.store.models import Base, StoreMeta
from inferflux.policy.store.types import row_aad, secret_aad

log = logging.getLogger("inferflux.policy.store")

DEFAULT_KEY_FILE = "store.key"
ACTIVE = "key.active"
_CANARY_PLAINTEXT = b"inferflux policy store key canary"
# A temporary key file older than this was left by a writer that died; younger ones may be in use.
KEY_TEMPORARY_AGE_SECONDS = 60.0
# How soon a failed reload may be tried again for the same missing version.
_RELOAD_BACKOFF_SECONDS = 1.0
_meta = Base.metadata.tables[StoreMeta.__tablename__]


def _canary_name(version: int) -> str:
    return f"key.{version}.canary"


def _salt_name(version: int) -> str:
    return f"key.{version}.salt"


def _canary_aad(version: int) -> bytes:
    return secret_aad(_meta.name, "value", _canary_name(version))


@dataclass(frozen=True)
class KeyState:
    """What ``store_meta`` says about keys."""

    active: int | None  # None: a store whose keys were never set up
    canaries: Mapping[int, Sealed]
    salts: Mapping[int, bytes]  # only versions derived from a passphrase

    @property
    def versions(self) -> frozenset[int]:
        return frozenset(self.canaries)


def read_key_state(session: Session) -> KeyState:
    rows = session.execute(select(_meta.c.key, _meta.c.value).where(_meta.c.key.like("key.%"))).all()
    active: int | None = None
    canaries: dict[int, Sealed] = {}
    salts: dict[int, bytes] = {}
    for name, value in rows:
        if name == ACTIVE:
            active = int(value)
            continue
        _, version, kind = name.split(".")
        if kind == "canary":
            canaries[int(version)] = Sealed.from_bytes(base64.b64decode(value))
        elif kind == "salt":
            salts[int(version)] = base64.b64decode(value)
    return KeyState(active, canaries, salts)


# -- key sources ------------------------------------------------------------------


class KeyFileSource:
    def __init__(self, path: Path) -> None:
        self.path = path

    def describe(self) -> str:
        return f"the key file {self.path}"

    def keys(self, state: KeyState) -> dict[int, bytes]:
        """Every key the file holds (unverified)."""
        return dict(read_key_file(self.path).keys)


class PassphraseSource:
    """Keys derived from one passphrase, one per salt in the store."""

    def __init__(self, passphrase: str) -> None:
        self._passphrase = passphrase
        self._derived: dict[bytes, bytes] = {}  # salt -> key; scrypt is slow on purpose

    def describe(self) -> str:
        return "the configured passphrase"

    def derive(self, salt: bytes) -> bytes:
        key = self._derived.get(salt)
        if key is None:
            key = self._derived[salt] = derive_key(self._passphrase, salt)
        return key

    def keys(self, state: KeyState) -> dict[int, bytes]:
        """A key for every salt in the store (unverified: a salt may be an earlier passphrase's)."""
        return {version: self.derive(salt) for version, salt in state.salts.items()}


KeySource = KeyFileSource | PassphraseSource


@dataclass(frozen=True)
class NewKey:
    """A key version made by a rotation, not yet recorded in the store."""

    version: int
    key: bytes = field(repr=False)
    salt: bytes | None  # for a passphrase-derived key
    source: KeySource  # where the key comes from from now on


def resolve_source(settings: StoreSettings, data_dir: Path) -> KeySource | None:
    """The configured key source; None if none is configured and no default key file exists yet."""
    if settings.passphrase is not None:
        return PassphraseSource(settings.passphrase.get_secret_value())
    if settings.key_file is not None:
        return KeyFileSource(settings.key_file)
    default = data_dir / DEFAULT_KEY_FILE
    return KeyFileSource(default) if default.exists() else None


def _generate_key_file(path: Path) -> KeyFileSource:
    try:
        create_key_file(path, KeyFile(active=1, keys={1: new_key()}))
    except FileExistsError:  # another process starting at the same moment made it
        return KeyFileSource(path)
    log.warning(
        "Generated a new encryption key for the policy store at %s (mode 0600). It sits beside the data "
        "it protects: anyone who can copy the data directory can decrypt every secret in the store. "
        "Move the file out of the data directory (for example to a secrets mount readable only by the "
        "server's user) and set store.key_file / INFERFLUX_STORE_KEY_FILE to its new path, or switch to a "
        "passphrase with 'inferctl admin rotate-key --new-passphrase'. Keep a backup: without this key "
        "the store's secrets cannot be recovered.",
        path,
    )
    return KeyFileSource(path)


# -- the manager ------------------------------------------------------------------


class KeyManager:
    """Seals and opens the store's secrets, reloading keys when another process rotated them."""

    def __init__(self, sessions: sessionmaker[Session], source: KeySource, store: str) -> None:
        self._sessions = sessions
        self._source = source
        self._store = store
        self._lock = threading.Lock()
        self._ring: KeyRing | None = None
        self._missing: tuple[int, float] | None = None  # (version, monotonic time) of the last failed reload

    @classmethod
    def from_settings(
        cls, sessions: sessionmaker[Session], settings: StoreSettings, data_dir: Path, store: str
    ) -> KeyManager:
        """Load and check the keys; on a store that has none yet, set them up (generating a key file)."""
        source = resolve_source(settings, data_dir)
        key_file = source.path if isinstance(source, KeyFileSource) else data_dir / DEFAULT_KEY_FILE
        # What a writer killed mid-write left; another process may be writing it now (a rotation), not for a minute.
        remove_temporaries(key_file.parent, key_file.name, older_than=KEY_TEMPORARY_AGE_SECONDS)
        with sessions() as session:
            state = read_key_state(session)
        if state.active is None and source is None:
            source = _generate_key_file(data_dir / DEFAULT_KEY_FILE)
        if source is None:
            raise StoreConfigError(
                f"the store at {store} is encrypted, but no key is configured and there is no key file at "
                f"{data_dir / DEFAULT_KEY_FILE}: set store.key_file (INFERFLUX_STORE_KEY_FILE) or "
                "store.passphrase (INFERFLUX_STORE_PASSPHRASE) to the key the store was created with"
            )
        manager = cls(sessions, source, store)
        if state.active is None:
            manager._set_up()
        manager._ring = manager._load(startup=True)
        return manager

    @property
    def ring(self) -> KeyRing:
        if self._ring is None:
            raise RuntimeError("the key manager has not loaded its keys")
        return self._ring

    # -- loading and checking

    def _set_up(self) -> None:
        with self._sessions.begin() as session:
            lock_for_write(session, bump=False)
            if read_key_state(session).active is not None:
                return  # another replica set the store up while this one started
            salt: bytes | None = None
            if isinstance(self._source, PassphraseSource):
                version, salt = 1, new_salt()
                key = self._source.derive(salt)
            else:
                content = read_key_file(self._source.path)
                version, key = content.active, content.keys[content.active]
            write_version(session, version, key, salt)
            _set_meta(session, ACTIVE, str(version))

    def _load(self, *, startup: bool) -> KeyRing:
        with self._sessions() as session:
            state = read_key_state(session)
        if state.active is None:
            raise StoreConfigError(f"the store at {self._store} has no key set up")
        offered = self._source.keys(state)
        verified: dict[int, bytes] = {}
        for version, key in offered.items():
            canary = state.canaries.get(version)
            if canary is None:
                continue  # a version staged in the key file but not yet used by the store
            try:
                KeyRing({version: key}, version).open(canary, _canary_aad(version))
            except DecryptionError:
                if isinstance(self._source, PassphraseSource) and version != state.active:
                    continue  # made with an earlier passphrase; its values were re-encrypted since
                raise StoreConfigError(self._wrong_key_message(version)) from None
            verified[version] = key
        if state.active not in verified:
            raise StoreConfigError(
                f"the store at {self._store} was encrypted with key version {state.active}, "
                f"which {self._source.describe()} does not hold"
                + ("" if startup else " (was the key rotated with a new passphrase? restart with it)")
            )
        return KeyRing(verified, state.active)

    def _wrong_key_message(self, version: int) -> str:
        if isinstance(self._source, PassphraseSource):
            return f"the configured passphrase does not decrypt the store at {self._store} (wrong passphrase)"
        return (
            f"key version {version} in {self._source.describe()} does not decrypt the store at {self._store} "
            "(wrong key file: was the store created with another key?)"
        )

    def reload(self, needed: int) -> KeyRing:
        """The ring again from the source, if it now holds version ``needed``; else UnknownKeyVersion."""
        with self._lock:
            ring = self.ring
            if needed in ring:
                return ring  # another thread reloaded meanwhile
            if self._failed_recently(needed):  # a server lacking a key must not reread it on every request
                raise UnknownKeyVersion(needed, self._missing_message(needed))
            try:
                ring = self._load(startup=False)
            except StoreConfigError as exc:
                log.error("reloading the policy store's keys failed: %s", exc)
                ring = self.ring
            if needed not in ring:
                self._missing = (needed, time.monotonic())
                raise UnknownKeyVersion(needed, self._missing_message(needed))
            self._ring, self._missing = ring, None
            log.info("policy store keys reloaded: versions %s, active %s", sorted(ring.versions), ring.active)
            return ring

    def _failed_recently(self, version: int) -> bool:
        if self._missing is None or self._missing[0] != version:
            return False
        return time.monotonic() - self._missing[1] < _RELOAD_BACKOFF_SECONDS

    def _missing_message(self, version: int) -> str:
        return (
            f"a value in the store at {self._store} is encrypted with key version {version}, which "
            f"{self._source.describe()} does not hold: finish 'inferctl admin rotate-key', or give this "
            "server the current key"
        )

    # -- sealing and opening

    def seal(self, session: Session, row: DeclarativeBase, column: str, plaintext: str) -> Sealed:
        """Seal a secret for ``row.column`` with the store's active key version (read in this transaction)."""
        version = active_version(session)
        ring = self.ring if version in self.ring else self.reload(version)
        return ring.seal(plaintext.encode("utf-8"), row_aad(row, column), version=version)

    def open(self, row: DeclarativeBase, column: str) -> str | None:
        sealed: Sealed | None = getattr(row, column)
        if sealed is None:
            return None
        return self.open_bytes(sealed, row_aad(row, column)).decode("utf-8")

    def open_bytes(self, sealed: Sealed, aad: bytes) -> bytes:
        ring = self.ring if sealed.key_version in self.ring else self.reload(sealed.key_version)
        return ring.open(sealed, aad)

    # -- rotation steps (see policy.store.rotation)

    def new_version(self, new_passphrase: str | None) -> NewKey:
        """Make the next key version; with a key file, write it there first (not yet active).

        A version already staged in the key file beyond every version the store
        knows (a rotation that stopped before activating it, or a key prepared
        ahead and copied to every host) is taken instead of making another.
        """
        with self._sessions() as session:
            state = read_key_state(session)
        newest = max(state.versions | self.ring.versions)
        source = self._source if new_passphrase is None else PassphraseSource(new_passphrase)
        if isinstance(source, PassphraseSource):
            salt = new_salt()
            return NewKey(newest + 1, source.derive(salt), salt, source)
        content = read_key_file(source.path)
        staged = [v for v in content.keys if v > newest]
        if staged:
            return NewKey(max(staged), content.keys[max(staged)], None, source)
        version = max(newest, *content.keys) + 1
        key = new_key()
        replace_key_file(source.path, content.with_key(version, key))
        return NewKey(version, key, None, source)

    def activate(self, new: NewKey) -> None:
        """Record the version's canary (and salt) and make it the one every writer seals with."""
        with self._sessions.begin() as session:
            lock_for_write(session, bump=False)
            if new.version not in read_key_state(session).canaries:
                write_version(session, new.version, new.key, new.salt)
            _set_meta(session, ACTIVE, str(new.version))
        with self._lock:
            self._ring = self.ring.with_key(new.version, new.key)
            self._source = new.source

    def prune(self, keep: int) -> tuple[int, ...]:
        """Forget every version but ``keep``: in the key file, and the store's canaries and salts."""
        with self._sessions() as session:
            state = read_key_state(session)
        pruned: set[int] = {v for v in state.versions if v != keep}
        if isinstance(self._source, KeyFileSource):
            content = read_key_file(self._source.path)
            pruned |= {v for v in content.keys if v != keep}
            if set(content.keys) != {keep}:
                replace_key_file(self._source.path, KeyFile(active=keep, keys={keep: content.keys[keep]}))
        with self._sessions.begin() as session:
            lock_for_write(session, bump=False)
            names = [name for v in pruned for name in (_canary_name(v), _salt_name(v))]
            session.execute(delete(_meta).where(_meta.c.key.in_(names)))
        with self._lock:
            self._ring = self.ring.only([keep], active=keep)
        return tuple(sorted(pruned))


def active_version(session: Session) -> int:
    value = session.execute(select(_meta.c.value).where(_meta.c.key == ACTIVE)).scalar_one()
    return int(value)


def write_version(session: Session, version: int, key: bytes, salt: bytes | None) -> None:
    canary = KeyRing({version: key}, version).seal(_CANARY_PLAINTEXT, _canary_aad(version))
    _set_meta(session, _canary_name(version), base64.b64encode(canary.to_bytes()).decode("ascii"))
    if salt is not None:
        _set_meta(session, _salt_name(version), base64.b64encode(salt).decode("ascii"))


def _set_meta(session: Session, name: str, value: str) -> None:
    updated = session.execute(update(_meta).where(_meta.c.key == name).values(value=value))
    if updated.rowcount == 0:  # type: ignore[attr-defined]
        session.execute(insert(_meta).values(key=name, value=value))
