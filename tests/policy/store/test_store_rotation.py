"""Key rotation: everything re-encrypted, old versions pruned, running servers kept working."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from sqlalchemy import select

from inferflux.policy.errors import StoreConfigError
from inferflux.policy.store import PolicyStore, StoreSettings
from inferflux.policy.store.crypto import UnknownKeyVersion, read_key_file
from inferflux.policy.store.models import encrypted_models
from inferflux.policy.store.types import secret_columns


def key_versions_in_use(store: PolicyStore) -> set[int]:
    """The key version of every sealed value in the database."""
    versions: set[int] = set()
    with store._sessions() as session:
        for model in encrypted_models():
            for column in secret_columns(model):
                for sealed in session.scalars(select(getattr(model, column))):
                    if sealed is not None:
                        versions.add(sealed.key_version)
    return versions


def fill(store: PolicyStore) -> dict[str, str]:
    """Secrets of every kind; returns what to read back (name -> id)."""
    tenant = store.create_tenant("acme")
    _, token = store.create_api_key(tenant.id, "k", "member")
    provider = store.create_oidc_provider("idp", "https://idp.example", "aud", client_secret="idp-secret")
    policy = store.create_policy(tenant.id, "guardrail", "g", {}, sensitive_spec="guardrail-secret")
    credentials = [store.create_credential(None, f"c{i}", f"credential-secret-{i}").id for i in range(3)]
    return {
        "tenant": tenant.id,
        "token": token,
        "provider": provider.id,
        "policy": policy.id,
        **{f"credential{i}": cid for i, cid in enumerate(credentials)},
    }


def assert_readable(store: PolicyStore, ids: dict[str, str]) -> None:
    assert store.get_oidc_provider(ids["provider"]).client_secret == "idp-secret"
    assert store.get_policy(ids["tenant"], ids["policy"]).sensitive_spec == "guardrail-secret"
    for i in range(3):
        assert store.get_credential(None, ids[f"credential{i}"]).secret == f"credential-secret-{i}"
    assert store.find_api_key(ids["token"]) is not None  # the pepper is unchanged


def test_rotation_re_encrypts_everything_and_prunes(
    store_settings: StoreSettings, data_dir: Path, tmp_path: Path
) -> None:
    with PolicyStore.open(store_settings, data_dir) as store:
        ids = fill(store)
        old_key_file = tmp_path / "old.key"
        shutil.copy2(data_dir / "store.key", old_key_file)
        version = store.policy_version()

        report = store.rotate_key(batch_size=2)
        assert (report.active_version, report.previous_versions, report.pruned_versions) == (2, (1,), ())
        assert report.values == 6 and report.rows == 6  # the pepper, one provider, one policy, three credentials
        assert key_versions_in_use(store) == {2}
        assert read_key_file(data_dir / "store.key").keys.keys() == {1, 2}  # kept until --prune
        assert store.policy_version() == version  # no policy changed
        assert_readable(store, ids)

        report = store.rotate_key(prune=True)
        assert (report.active_version, report.pruned_versions) == (3, (1, 2))
        assert key_versions_in_use(store) == {3}
        content = read_key_file(data_dir / "store.key")
        assert content.keys.keys() == {3} and content.active == 3

    with PolicyStore.open(store_settings, data_dir) as reopened:
        assert_readable(reopened, ids)
    # A store opened with only the old key fails, at start-up.
    old_only = store_settings.model_copy(update={"key_file": old_key_file})
    with pytest.raises(StoreConfigError, match="encrypted with key version 3, which the key file .* does not hold"):
        PolicyStore.open(old_only, data_dir)


def test_a_running_server_keeps_reading_and_writing_during_rotation(
    store_settings: StoreSettings, data_dir: Path
) -> None:
    with PolicyStore.open(store_settings, data_dir) as rotator, PolicyStore.open(store_settings, data_dir) as server:
        ids = fill(rotator)
        written: list[str] = []

        def between_batches(table: str, rows: int) -> None:
            # The server holds only version 1 until it meets version 2 and reloads the key file.
            assert_readable(server, ids)
            written.append(server.create_credential(None, f"during-{len(written)}", f"written-{len(written)}").id)

        report = rotator.rotate_key(batch_size=1, on_progress=between_batches)
        assert report.active_version == 2 and written
        assert key_versions_in_use(rotator) == {2}  # what the server wrote meanwhile too
        assert server._keys.ring.versions == {1, 2}  # it reloaded the key file

        rotator.rotate_key(prune=True)
        assert_readable(server, ids)  # reloads again for version 3
        for i, credential_id in enumerate(written):
            assert server.get_credential(None, credential_id).secret == f"written-{i}"
    with PolicyStore.open(store_settings, data_dir) as reopened:
        assert_readable(reopened, ids)


def test_writes_racing_the_rotation_are_neither_lost_nor_left_on_the_old_key(
    store_settings: StoreSettings, data_dir: Path
) -> None:
    with PolicyStore.open(store_settings, data_dir) as rotator, PolicyStore.open(store_settings, data_dir) as server:
        fill(rotator)
        hot = server.create_credential(None, "hot", "v0")
        stop, written = threading.Event(), [0]

        def keep_writing() -> None:
            while not stop.is_set():
                server.update_credential(None, hot.id, secret=f"v{written[0] + 1}")
                written[0] += 1

        writer = threading.Thread(target=keep_writing)
        writer.start()
        try:
            rotator.rotate_key(batch_size=1)
        finally:
            stop.set()
            writer.join()
        assert written[0] > 0
        assert key_versions_in_use(rotator) == {2}
        assert rotator.get_credential(None, hot.id).secret == f"v{written[0]}"  # the last write won


def test_rotation_with_a_passphrase(store_settings: StoreSettings, data_dir: Path) -> None:
    settings = StoreSettings(url=store_settings.url, passphrase="first passphrase")
    with PolicyStore.open(settings, data_dir) as rotator, PolicyStore.open(settings, data_dir) as server:
        ids = fill(rotator)
        # The same passphrase with a new salt: a server running with it derives the new key itself.
        assert rotator.rotate_key(prune=True).active_version == 2
        assert_readable(server, ids)

        # A new passphrase: servers with the old one cannot derive it, and say so.
        assert rotator.rotate_key(new_passphrase="second passphrase", prune=True).active_version == 3
        assert_readable(rotator, ids)
        with pytest.raises(UnknownKeyVersion, match="key version 3"):
            server.get_oidc_provider(ids["provider"])
    with pytest.raises(StoreConfigError, match="wrong passphrase"):
        PolicyStore.open(settings, data_dir)
    with PolicyStore.open(StoreSettings(url=store_settings.url, passphrase="second passphrase"), data_dir) as store:
        assert_readable(store, ids)


def test_switching_from_the_key_file_to_a_passphrase(sqlite_store: PolicyStore, data_dir: Path) -> None:
    ids = fill(sqlite_store)
    sqlite_store.rotate_key(new_passphrase="from now on", prune=True)
    sqlite_store.close()
    (data_dir / "store.key").unlink()
    with PolicyStore.open(StoreSettings(passphrase="from now on"), data_dir) as store:
        assert_readable(store, ids)


def test_an_interrupted_rotation_is_finished_by_the_next(sqlite_store: PolicyStore, data_dir: Path) -> None:
    ids = fill(sqlite_store)
    # Stopped after writing the new key to the key file, before the store used it.
    staged = sqlite_store._keys.new_version(None)
    assert staged.version == 2 and read_key_file(data_dir / "store.key").keys.keys() == {1, 2}
    with PolicyStore.open(StoreSettings(), data_dir) as restarted:  # a staged key does not disturb a start
        assert_readable(restarted, ids)
    report = sqlite_store.rotate_key()
    assert report.active_version == 2  # the staged key, not a third
    assert read_key_file(data_dir / "store.key").keys.keys() == {1, 2}
    assert key_versions_in_use(sqlite_store) == {2}
