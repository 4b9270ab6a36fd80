"""Opening a store: key set-up, key checks at start-up, passphrases, settings, the schema gate."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import LargeBinary, select, type_coerce, update

from inferflux.policy.errors import StoreConfigError, StoreUnavailable
from inferflux.policy.store import PolicyStore, StoreSettings, migrate
from inferflux.policy.store.crypto import DecryptionError, KeyFile, create_key_file, new_key, read_key_file
from inferflux.policy.store.models import Credential, OidcProvider


def test_first_start_generates_an_owner_only_key_file_and_warns(
    data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="inferflux.policy.store"):
        PolicyStore.open(StoreSettings(), data_dir).close()
    key_file = data_dir / "store.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((data_dir / "policy.db").stat().st_mode) == 0o600
    assert read_key_file(key_file).active == 1
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert str(key_file) in message
    assert "beside the data" in message and "INFERFLUX_STORE_KEY_FILE" in message

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="inferflux.policy.store"):
        PolicyStore.open(StoreSettings(), data_dir).close()  # found again, no second warning
    assert not caplog.records


def test_store_works_across_restarts(store_settings: StoreSettings, data_dir: Path) -> None:
    with PolicyStore.open(store_settings, data_dir) as store:
        provider = store.create_oidc_provider("idp", "https://idp.example", "aud", client_secret="s3cret")
        _, token = store.create_api_key(store.create_tenant("acme").id, "k", "member")
    with PolicyStore.open(store_settings, data_dir) as store:
        assert store.get_oidc_provider(provider.id).client_secret == "s3cret"
        assert store.find_api_key(token) is not None  # the pepper survived


def test_a_wrong_key_file_fails_at_start_up(store_settings: StoreSettings, data_dir: Path, tmp_path: Path) -> None:
    PolicyStore.open(store_settings, data_dir).close()
    other = tmp_path / "other.key"
    create_key_file(other, KeyFile(active=1, keys={1: new_key()}))
    settings = store_settings.model_copy(update={"key_file": other})
    with pytest.raises(StoreConfigError, match=r"does not decrypt the store at .*wrong key file"):
        PolicyStore.open(settings, data_dir)


def test_a_key_file_without_the_stores_version_fails_at_start_up(
    store_settings: StoreSettings, data_dir: Path, tmp_path: Path
) -> None:
    PolicyStore.open(store_settings, data_dir).close()
    other = tmp_path / "other.key"
    create_key_file(other, KeyFile(active=5, keys={5: new_key()}))
    settings = store_settings.model_copy(update={"key_file": other})
    with pytest.raises(StoreConfigError, match=r"encrypted with key version 1, which the key file .* does not hold"):
        PolicyStore.open(settings, data_dir)


def test_a_missing_key_file_for_an_existing_store_fails_at_start_up(
    store_settings: StoreSettings, data_dir: Path
) -> None:
    PolicyStore.open(store_settings, data_dir).close()
    (data_dir / "store.key").unlink()
    with pytest.raises(StoreConfigError, match=r"is encrypted, but no key is configured"):
        PolicyStore.open(store_settings, data_dir)
    assert not (data_dir / "store.key").exists()  # and no new key was made for it


def test_a_configured_key_file_that_is_missing_is_never_generated(data_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "secrets" / "store.key"
    with pytest.raises(StoreConfigError, match="does not exist"):
        PolicyStore.open(StoreSettings(key_file=missing), data_dir)
    assert not missing.exists()


def test_a_configured_key_file(data_dir: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "elsewhere.key"
    create_key_file(key_file, KeyFile(active=3, keys={3: new_key()}))
    with PolicyStore.open(StoreSettings(key_file=key_file), data_dir) as store:
        credential = store.create_credential(None, "upstream", "token-123")
        assert store.get_credential(None, credential.id).secret == "token-123"
    assert not (data_dir / "store.key").exists()


def test_a_key_file_readable_by_others_is_refused_at_start_up(data_dir: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "store.key"
    create_key_file(key_file, KeyFile(active=1, keys={1: new_key()}))
    key_file.chmod(0o644)
    with pytest.raises(StoreConfigError, match="readable by other users"):
        PolicyStore.open(StoreSettings(key_file=key_file), data_dir)


def test_passphrase(store_settings: StoreSettings, data_dir: Path) -> None:
    settings = StoreSettings(url=store_settings.url, passphrase="correct horse battery staple")
    with PolicyStore.open(settings, data_dir) as store:
        policy = store.create_policy(None, "guardrail", "g", {"x": 1}, sensitive_spec="hidden words")
    assert not (data_dir / "store.key").exists()  # the key is derived, never written
    with PolicyStore.open(settings, data_dir) as store:
        assert store.get_policy(None, policy.id).sensitive_spec == "hidden words"

    with pytest.raises(StoreConfigError, match=r"passphrase does not decrypt .*wrong passphrase"):
        PolicyStore.open(StoreSettings(url=store_settings.url, passphrase="wrong"), data_dir)
    with pytest.raises(StoreConfigError, match="no key is configured"):
        PolicyStore.open(StoreSettings(url=store_settings.url), data_dir)


def test_key_file_and_passphrase_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="not both"):
        StoreSettings(key_file=tmp_path / "k", passphrase="p")


@pytest.mark.parametrize(
    ("url", "message"),
    [("mysql://h/db", "unsupported database"), ("sqlite://", "in-memory"), ("::", "not a database URL")],
)
def test_bad_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        StoreSettings(url=url)


def test_postgresql_url_gets_the_psycopg_driver(tmp_path: Path) -> None:
    url = StoreSettings(url="postgresql://u:pw@db.example/inferflux").database_url(tmp_path)
    assert url.drivername == "postgresql+psycopg" and url.password == "pw"
    assert StoreSettings().database_url(tmp_path).database == str(tmp_path / "policy.db")


def test_without_auto_migrate_an_old_schema_is_refused(data_dir: Path) -> None:
    settings = StoreSettings(auto_migrate=False)
    with pytest.raises(StoreConfigError, match=rf"no schema .* needs revision {migrate.head()}: run 'inferctl db upgrade'"):
        PolicyStore.open(settings, data_dir)
    migrate.upgrade(settings.database_url(data_dir))
    PolicyStore.open(settings, data_dir).close()


def test_sqlite_runs_in_wal_mode_with_foreign_keys(sqlite_store: PolicyStore) -> None:
    with sqlite_store._engine.connect() as connection:  # checking the engine's set-up
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000


def test_an_unreachable_database_is_a_start_up_error(data_dir: Path) -> None:
    settings = StoreSettings(url="postgresql://nobody@127.0.0.1:1/nothing")
    with pytest.raises(StoreConfigError, match="cannot open the store at postgresql"):
        PolicyStore.open(settings, data_dir)


def test_a_database_gone_after_start_is_a_503(tmp_path: Path) -> None:
    store = PolicyStore.open(StoreSettings(), tmp_path / "data")
    store.close()
    (tmp_path / "data" / "policy.db").unlink()
    (tmp_path / "data").chmod(0o500)  # SQLite cannot create it again
    try:
        with pytest.raises(StoreUnavailable):
            store.list_tenants()
    finally:
        (tmp_path / "data").chmod(0o700)


# -- the associated data, end to end ------------------------------------------------------


def test_a_secret_copied_to_another_row_or_column_does_not_decrypt(store: PolicyStore) -> None:
    first = store.create_oidc_provider("one", "https://one.example", "aud", client_secret="first-secret")
    second = store.create_oidc_provider("two", "https://two.example", "aud", client_secret="second-secret")
    credential = store.create_credential(None, "c", "credential-secret")
    providers, credentials = OidcProvider.__table__, Credential.__table__
    # An attacker with write access to the database (or a buggy migration) moves a ciphertext.
    with store._engine.begin() as connection:
        stolen = connection.execute(select(providers.c.client_secret).where(providers.c.id == first.id)).scalar_one()
        connection.execute(update(providers).where(providers.c.id == second.id).values(client_secret=stolen))
        connection.execute(update(credentials).where(credentials.c.id == credential.id).values(secret=stolen))
    assert store.get_oidc_provider(first.id).client_secret == "first-secret"
    with pytest.raises(DecryptionError, match="moved from another row or column"):
        store.get_oidc_provider(second.id)
    with pytest.raises(DecryptionError, match="moved from another row or column"):
        store.get_credential(None, credential.id)


def test_a_flipped_byte_in_the_database_does_not_decrypt(store: PolicyStore) -> None:
    credential = store.create_credential(None, "c", "credential-secret")
    table = Credential.__table__
    with store._engine.begin() as connection:
        raw = type_coerce(table.c.secret, LargeBinary)  # the stored bytes, not a Sealed
        blob = bytearray(connection.execute(select(raw).where(table.c.id == credential.id)).scalar_one())
        blob[-3] ^= 0x80
        connection.execute(update(table).where(table.c.id == credential.id).values({raw: bytes(blob)}))
    with pytest.raises(DecryptionError):
        store.get_credential(None, credential.id)
