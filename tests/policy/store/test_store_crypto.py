"""AES-GCM sealing, key rings, key files, and the column type that stores sealed values."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path

import pytest
from sqlalchemy.dialects import sqlite

from inferflux.policy.errors import StoreConfigError
from inferflux.policy.store.crypto import (
    FORMAT,
    DecryptionError,
    KeyFile,
    KeyRing,
    MalformedCiphertext,
    Sealed,
    UnknownKeyVersion,
    create_key_file,
    derive_key,
    new_key,
    read_key_file,
    replace_key_file,
)
from inferflux.policy.store.types import EncryptedText, new_id, secret_aad

ZERO_KEY = base64.b64encode(bytes(32)).decode()
AAD = secret_aad("oidc_providers", "client_secret", "idp_aaaaaaaaaaaaaaaa")


def test_round_trip_and_blob_layout() -> None:
    ring = KeyRing({7: new_key()}, 7)
    sealed = ring.seal(b"client secret", AAD)
    blob = sealed.to_bytes()
    assert blob[0] == FORMAT
    assert int.from_bytes(blob[1:5], "big") == 7
    assert len(blob) == 1 + 4 + 12 + len(b"client secret") + 16
    assert ring.open(Sealed.from_bytes(blob), AAD) == b"client secret"


def test_nonce_is_fresh_for_every_encryption() -> None:
    ring = KeyRing({1: new_key()}, 1)
    first, second = ring.seal(b"same", AAD), ring.seal(b"same", AAD)
    assert first.nonce != second.nonce
    assert first.ciphertext != second.ciphertext


@pytest.mark.parametrize("index", [5, 17, -1])  # the nonce, the ciphertext, the tag
def test_a_tampered_byte_fails(index: int) -> None:
    ring = KeyRing({1: new_key()}, 1)
    blob = bytearray(ring.seal(b"secret value", AAD).to_bytes())
    blob[index] ^= 0x01
    with pytest.raises(DecryptionError):
        ring.open(Sealed.from_bytes(bytes(blob)), AAD)


def test_other_associated_data_fails() -> None:
    ring = KeyRing({1: new_key()}, 1)
    sealed = ring.seal(b"secret", AAD)
    for other in (
        secret_aad("oidc_providers", "client_secret", "idp_bbbbbbbbbbbbbbbb"),  # another row
        secret_aad("credentials", "secret", "idp_aaaaaaaaaaaaaaaa"),  # another table and column
    ):
        with pytest.raises(DecryptionError, match="moved from another row or column"):
            ring.open(sealed, other)


def test_wrong_key_and_unknown_version() -> None:
    sealed = KeyRing({1: new_key()}, 1).seal(b"secret", AAD)
    with pytest.raises(DecryptionError):
        KeyRing({1: new_key()}, 1).open(sealed, AAD)
    with pytest.raises(UnknownKeyVersion) as info:
        KeyRing({2: new_key()}, 2).open(sealed, AAD)
    assert info.value.version == 1


def test_ring_decrypts_any_version_and_encrypts_with_the_active_one() -> None:
    old, new = new_key(), new_key()
    sealed_old = KeyRing({1: old}, 1).seal(b"a", AAD)
    ring = KeyRing({1: old}, 1).with_key(2, new)
    assert ring.active == 2 and ring.versions == {1, 2}
    assert ring.open(sealed_old, AAD) == b"a"
    assert ring.seal(b"b", AAD).key_version == 2
    assert "key" not in repr(ring).lower().replace("keyring", "")  # no key material in repr
    pruned = ring.only([2], active=2)
    with pytest.raises(UnknownKeyVersion):
        pruned.open(sealed_old, AAD)


def test_malformed_blobs_are_rejected() -> None:
    with pytest.raises(MalformedCiphertext, match="too short"):
        Sealed.from_bytes(b"\x01\x00\x00\x00\x01")
    blob = KeyRing({1: new_key()}, 1).seal(b"x", AAD).to_bytes()
    with pytest.raises(MalformedCiphertext, match="format"):
        Sealed.from_bytes(b"\x09" + blob[1:])


def test_bad_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="32"):
        KeyRing({1: b"short"}, 1)
    with pytest.raises(ValueError, match="active"):
        KeyRing({1: new_key()}, 2)


def test_passphrase_derivation_depends_on_salt_and_passphrase() -> None:
    salt = b"s" * 16
    key = derive_key("correct horse", salt)
    assert len(key) == 32
    assert derive_key("correct horse", salt) == key
    assert derive_key("correct horse", b"t" * 16) != key
    assert derive_key("wrong horse", salt) != key
    with pytest.raises(StoreConfigError, match="empty"):
        derive_key("", salt)


# -- key files ------------------------------------------------------------------


def test_created_key_file_is_owner_only_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "store.key"
    content = KeyFile(active=1, keys={1: new_key()})
    old_umask = os.umask(0o000)  # the file must be 0600 whatever the umask
    try:
        create_key_file(path, content)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_key_file(path) == content
    data = json.loads(path.read_text())
    assert data["format"] == 1 and data["active"] == 1
    assert base64.b64decode(data["keys"]["1"]) == content.keys[1]
    assert [p.name for p in tmp_path.iterdir()] == ["store.key"]  # no temporary file left


def test_create_key_file_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "store.key"
    first = KeyFile(active=1, keys={1: new_key()})
    create_key_file(path, first)
    with pytest.raises(FileExistsError):
        create_key_file(path, KeyFile(active=1, keys={1: new_key()}))
    assert read_key_file(path) == first


def test_replace_key_file_keeps_the_mode(tmp_path: Path) -> None:
    path = tmp_path / "store.key"
    create_key_file(path, KeyFile(active=1, keys={1: new_key()}))
    updated = read_key_file(path).with_key(2, new_key())
    replace_key_file(path, updated)
    assert read_key_file(path) == updated and updated.active == 2
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_key_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "store.key"
    create_key_file(path, KeyFile(active=1, keys={1: new_key()}))
    path.chmod(mode)
    with pytest.raises(StoreConfigError, match=r"readable by other users .*chmod 600"):
        read_key_file(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not JSON"),
        ('{"format": 2, "active": 1, "keys": {}}', "not an InferFlux key file"),
        ('{"format": 1, "active": 1, "keys": {}}', "holds no keys"),
        ('{"format": 1, "active": 1, "keys": {"1": "c2hvcnQ="}}', "invalid entry"),
        ('{"format": 1, "active": 1, "keys": {"x": "%s"}}' % ZERO_KEY, "invalid entry"),
        ('{"format": 1, "active": 2, "keys": {"1": "%s"}}' % ZERO_KEY, "does not hold"),
    ],
)
def test_malformed_key_files(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "store.key"
    path.write_text(content)
    path.chmod(0o600)
    with pytest.raises(StoreConfigError, match=message):
        read_key_file(path)


def test_missing_key_file(tmp_path: Path) -> None:
    with pytest.raises(StoreConfigError, match="does not exist"):
        read_key_file(tmp_path / "nope.key")


# -- the column type ----------------------------------------------------------------


def test_encrypted_text_stores_sealed_values_and_refuses_plaintext() -> None:
    column = EncryptedText()
    dialect = sqlite.dialect()
    sealed = KeyRing({1: new_key()}, 1).seal(b"x", AAD)
    stored = column.process_bind_param(sealed, dialect)
    assert stored == sealed.to_bytes()
    assert column.process_result_value(stored, dialect) == sealed
    assert column.process_bind_param(None, dialect) is None
    with pytest.raises(TypeError, match="plaintext|Sealed"):
        column.process_bind_param("plain text", dialect)  # type: ignore[arg-type]
    with pytest.raises(MalformedCiphertext):
        column.process_result_value(b"garbage", dialect)


def test_ids() -> None:
    ident = new_id("ten")
    assert ident.startswith("ten_") and len(ident) == 4 + 16
    assert set(ident[4:]) <= set("abcdefghijklmnopqrstuvwxyz234567")
    assert new_id("ten") != ident
