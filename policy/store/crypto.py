"""Encryption at rest: AES-256-GCM under a ring of versioned keys.

A sealed value is laid out as::

    1 byte    format (1)
    4 bytes   key version, big-endian
    12 bytes  nonce (random per encryption)
    n+16      ciphertext and GCM tag

The key version in the clear is what lets a ring of several keys decrypt
values written before a rotation while new values use the active key. The
associated data (the caller's context: table, column and row id) is not
stored; it is supplied again to decrypt, so a ciphertext copied elsewhere
fails its tag check instead of decrypting in the wrong place.

Keys come from one of two sources:

* a key file, JSON ``{"format": 1, "active": N, "keys": {"N": "<base64>"}}``,
  mode 0600 (a file others may read is refused);
* a passphrase, stretched with scrypt (n=2**15, r=8, p=1) and a per-version
  random salt. Salts are not secret and live in the store's meta table; the
  derived keys never do.

Nothing here knows about databases: ``policy.store.keys`` ties the sources to
the store's canaries, and ``policy.store.types`` maps sealed values to
columns.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from inferflux.policy.errors import StoreConfigError
from inferflux.policy.fileio import write_atomically

FORMAT = 1
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
SALT_BYTES = 16
_HEADER_BYTES = 1 + 4 + NONCE_BYTES
KEY_FILE_FORMAT = 1

# scrypt cost: about 32 MiB and 0.1 s per derivation, paid once per key
# version at start-up.
SCRYPT_N = 2**15
SCRYPT_R = 8
SCRYPT_P = 1


class DecryptionError(Exception):
    """A sealed value could not be decrypted; never answered with a guess."""


class MalformedCiphertext(DecryptionError):
    pass


class UnknownKeyVersion(DecryptionError):
    def __init__(self, version: int, message: str | None = None) -> None:
        super().__init__(message or f"no key of version {version} is held to decrypt this value")
        self.version = version


@dataclass(frozen=True, slots=True)
class Sealed:
    """One encrypted value, as stored."""

    key_version: int
    nonce: bytes
    ciphertext: bytes = field(repr=False)

    def to_bytes(self) -> bytes:
        return bytes([FORMAT]) + self.key_version.to_bytes(4, "big") + self.nonce + self.ciphertext

    @classmethod
    def from_bytes(cls, blob: bytes) -> Sealed:
        if len(blob) < _HEADER_BYTES + TAG_BYTES:
            raise MalformedCiphertext(f"an encrypted value of {len(blob)} bytes is too short to be one")
        if blob[0] != FORMAT:
            raise MalformedCiphertext(f"an encrypted value has the unknown format {blob[0]}")
        version = int.from_bytes(blob[1:5], "big")
        return cls(version, blob[5:_HEADER_BYTES], blob[_HEADER_BYTES:])


class KeyRing:
    """Versioned 256-bit keys: decrypt with any of them, encrypt with the active one."""

    __slots__ = ("_keys", "active")

    def __init__(self, keys: Mapping[int, bytes], active: int) -> None:
        for version, key in keys.items():
            _check_key(version, key)
        self._keys = {version: AESGCM(key) for version, key in keys.items()}
        self.active = self._check_active(active)

    def _check_active(self, active: int) -> int:
        if active not in self._keys:
            raise ValueError(f"the active key version {active} is not among the keys {sorted(self._keys)}")
        return active

    def _derived(self, ciphers: dict[int, AESGCM], active: int) -> KeyRing:
        ring = object.__new__(KeyRing)
        ring._keys = ciphers
        ring.active = ring._check_active(active)
        return ring

    def with_key(self, version: int, key: bytes, *, active: int | None = None) -> KeyRing:
        """This ring plus ``version``; ``active`` defaults to the new version."""
        _check_key(version, key)
        return self._derived({**self._keys, version: AESGCM(key)}, version if active is None else active)

    def only(self, versions: Iterable[int], *, active: int) -> KeyRing:
        kept = set(versions)
        return self._derived({v: c for v, c in self._keys.items() if v in kept}, active)

    @property
    def versions(self) -> frozenset[int]:
        return frozenset(self._keys)

    def __contains__(self, version: object) -> bool:
        return version in self._keys

    def __repr__(self) -> str:  # never the keys themselves
        return f"KeyRing(versions={sorted(self._keys)}, active={self.active})"

    def seal(self, plaintext: bytes, aad: bytes, *, version: int | None = None) -> Sealed:
        version = self.active if version is None else version
        cipher = self._keys.get(version)
        if cipher is None:
            raise UnknownKeyVersion(version, f"cannot encrypt with key version {version}, which is not held")
        nonce = os.urandom(NONCE_BYTES)
        return Sealed(version, nonce, cipher.encrypt(nonce, plaintext, aad))

    def open(self, sealed: Sealed, aad: bytes) -> bytes:
        cipher = self._keys.get(sealed.key_version)
        if cipher is None:
            raise UnknownKeyVersion(sealed.key_version)
        try:
            return cipher.decrypt(sealed.nonce, sealed.ciphertext, aad)
        except InvalidTag:
            # Deliberately vague about which: a wrong key, a tampered byte and
            # a value moved to another row all look the same to GCM.
            raise DecryptionError(
                f"an encrypted value does not decrypt with key version {sealed.key_version} "
                "(wrong key, tampered data, or a value moved from another row or column)"
            ) from None


def _check_key(version: int, key: bytes) -> None:
    if not 1 <= version < 2**32:
        raise ValueError(f"key versions run from 1 to 2**32-1, not {version}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"key version {version} is {len(key)} bytes, not {KEY_BYTES}")


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def new_salt() -> bytes:
    return secrets.token_bytes(SALT_BYTES)


def derive_key(passphrase: str, salt: bytes) -> bytes:
    if not passphrase:
        raise StoreConfigError("the store passphrase is empty")
    kdf = Scrypt(salt=salt, length=KEY_BYTES, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P)
    return kdf.derive(passphrase.encode("utf-8"))


# -- key files ----------------------------------------------------------------


@dataclass(frozen=True)
class KeyFile:
    """The content of a key file: every version it holds and the one last made active."""

    active: int
    keys: Mapping[int, bytes] = field(repr=False)

    def __post_init__(self) -> None:
        for version, key in self.keys.items():
            _check_key(version, key)
        if self.active not in self.keys:
            raise ValueError(f"the active version {self.active} is not among the keys {sorted(self.keys)}")

    def with_key(self, version: int, key: bytes) -> KeyFile:
        return KeyFile(active=version, keys={**self.keys, version: key})

    def only(self, versions: Iterable[int]) -> KeyFile:
        kept = set(versions)
        return KeyFile(active=self.active, keys={v: k for v, k in self.keys.items() if v in kept})

    def to_json(self) -> str:
        keys = {str(v): base64.b64encode(k).decode("ascii") for v, k in sorted(self.keys.items())}
        return json.dumps({"format": KEY_FILE_FORMAT, "active": self.active, "keys": keys}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, path: Path) -> KeyFile:
        try:
            data = json.loads(text)
        except ValueError:
            raise StoreConfigError(f"the key file {path} is not JSON") from None
        if not isinstance(data, dict) or data.get("format") != KEY_FILE_FORMAT:
            raise StoreConfigError(f'the key file {path} is not an InferFlux key file (expected "format": 1)')
        raw_keys, active = data.get("keys"), data.get("active")
        if not isinstance(raw_keys, dict) or not raw_keys:
            raise StoreConfigError(f"the key file {path} holds no keys")
        keys: dict[int, bytes] = {}
        for name, encoded in raw_keys.items():
            try:
                version = int(name)
                key = base64.b64decode(encoded, validate=True)
                _check_key(version, key)
            except (ValueError, TypeError, binascii.Error):
                raise StoreConfigError(
                    f"the key file {path} has an invalid entry {name!r}: keys are numbered from 1 "
                    f"and each is {KEY_BYTES} bytes of base64"
                ) from None
            keys[version] = key
        if not isinstance(active, int) or active not in keys:
            raise StoreConfigError(f"the key file {path} names active version {active!r}, which it does not hold")
        return cls(active=active, keys=keys)


def read_key_file(path: Path) -> KeyFile:
    """Read a key file, refusing one that anybody but its owner could read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise StoreConfigError(f"the key file {path} does not exist") from None
    except OSError as exc:
        raise StoreConfigError(f"cannot open the key file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "r", encoding="utf-8") as handle:
        mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
        if mode & 0o077:
            raise StoreConfigError(
                f"the key file {path} is readable by other users (mode {mode:04o}); "
                f"restrict it with 'chmod 600 {path}' and keep it owned by the server's user"
            )
        return KeyFile.from_json(handle.read(), path)


def create_key_file(path: Path, content: KeyFile) -> None:
    """Create ``path`` holding ``content``; FileExistsError if it exists.

    The file is written under a temporary name (O_EXCL, 0600) and linked into
    place, so nobody ever reads a half-written key file and two processes
    creating it at once cannot both win.
    """
    write_atomically(path, content.to_json().encode("utf-8"), exclusive=True)


def replace_key_file(path: Path, content: KeyFile) -> None:
    """Atomically replace ``path``: readers see the old file or the new one, never a mix."""
    write_atomically(path, content.to_json().encode("utf-8"))
