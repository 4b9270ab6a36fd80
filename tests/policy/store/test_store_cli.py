"""``inferctl db ...`` and ``inferctl admin rotate-key`` against a store in a temporary data directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferflux.gateway import cli
from inferflux.policy.store import PolicyStore, StoreSettings, migrate
from inferflux.policy.store.crypto import read_key_file


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("INFERFLUX_CONFIG", "INFERFLUX_STORE_URL", "INFERFLUX_STORE_KEY_FILE", "INFERFLUX_STORE_PASSPHRASE"):
        monkeypatch.delenv(name, raising=False)


def inferctl(*args: str) -> int:
    return cli.main(list(args))


def test_db_upgrade_current_downgrade(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert inferctl("db", "current", "--data-dir", str(data_dir)) == cli.EXIT_OK
    assert f"revision none (empty) (head is {migrate.head()})" in capsys.readouterr().out
    assert inferctl("db", "upgrade", "--data-dir", str(data_dir)) == cli.EXIT_OK
    assert f"revision {migrate.head()} (head)" in capsys.readouterr().out
    assert inferctl("db", "current", "--data-dir", str(data_dir)) == cli.EXIT_OK
    assert f"policy.db: revision {migrate.head()} (head)" in capsys.readouterr().out
    assert inferctl("db", "downgrade", "--revision", "base", "--data-dir", str(data_dir)) == cli.EXIT_OK
    assert "revision none" in capsys.readouterr().out


def test_db_commands_read_the_server_settings(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "inferflux.yaml"
    config.write_text(f"data_dir: {tmp_path / 'from-config'}\nstore:\n  url: {pg_url}\n")
    assert inferctl("db", "upgrade", "--config", str(config)) == cli.EXIT_OK
    assert "postgresql+psycopg://" in capsys.readouterr().out
    monkeypatch.setenv("INFERFLUX_STORE_URL", pg_url)
    assert inferctl("db", "current", "--data-dir", str(tmp_path)) == cli.EXIT_OK
    assert f"revision {migrate.head()} (head)" in capsys.readouterr().out


def test_db_downgrade_needs_a_revision(data_dir: Path) -> None:
    with pytest.raises(SystemExit) as info:
        inferctl("db", "downgrade", "--data-dir", str(data_dir))
    assert info.value.code == cli.EXIT_USAGE


def test_errors_are_one_line(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert inferctl("db", "upgrade", "--revision", "9999", "--data-dir", str(data_dir)) == cli.EXIT_FAILURE
    assert capsys.readouterr().err.startswith("inferctl: error: cannot migrate the store to '9999'")
    monkeypatch.setenv("INFERFLUX_STORE_URL", "postgresql://nobody@127.0.0.1:1/none")
    assert inferctl("db", "current", "--data-dir", str(data_dir)) == cli.EXIT_FAILURE
    assert "inferctl: error: the policy store failed" in capsys.readouterr().err
    monkeypatch.setenv("INFERFLUX_STORE_URL", "mysql://h/db")
    assert inferctl("db", "current", "--data-dir", str(data_dir)) == cli.EXIT_USAGE
    assert "invalid setting 'store.url' (from INFERFLUX_STORE_URL)" in capsys.readouterr().err


def test_rotate_key(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with PolicyStore.open(StoreSettings(), data_dir) as store:
        provider = store.create_oidc_provider("idp", "https://idp.example", "aud", client_secret="idp-secret")

    assert inferctl("admin", "rotate-key", "--data-dir", str(data_dir)) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "key version 2 is active; re-encrypted 2 secret(s) in 2 row(s)" in out
    assert "key version 1 is kept" in out and "the next rotation with --prune removes them" in out
    assert read_key_file(data_dir / "store.key").keys.keys() == {1, 2}

    assert inferctl("admin", "rotate-key", "--prune", "--data-dir", str(data_dir)) == cli.EXIT_OK
    assert "removed key versions 1, 2" in capsys.readouterr().out
    assert read_key_file(data_dir / "store.key").keys.keys() == {3}
    with PolicyStore.open(StoreSettings(), data_dir) as store:
        assert store.get_oidc_provider(provider.id).client_secret == "idp-secret"


def test_rotate_key_to_a_new_passphrase(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("INFERFLUX_STORE_PASSPHRASE", "old passphrase")
    with PolicyStore.open(StoreSettings(passphrase="old passphrase"), data_dir) as store:
        credential = store.create_credential(None, "c", "credential-secret")
    monkeypatch.setenv("INFERFLUX_STORE_NEW_PASSPHRASE", "new passphrase")
    assert inferctl("admin", "rotate-key", "--new-passphrase", "--prune", "--data-dir", str(data_dir)) == cli.EXIT_OK
    assert "restart every server with the new passphrase" in capsys.readouterr().out
    with PolicyStore.open(StoreSettings(passphrase="new passphrase"), data_dir) as store:
        assert store.get_credential(None, credential.id).secret == "credential-secret"

    # The old passphrase no longer opens it, and the command says so in one line.
    assert inferctl("admin", "rotate-key", "--data-dir", str(data_dir)) == cli.EXIT_FAILURE
    assert "wrong passphrase" in capsys.readouterr().err


def test_new_passphrase_without_a_terminal(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("INFERFLUX_STORE_NEW_PASSPHRASE", raising=False)
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert inferctl("admin", "rotate-key", "--new-passphrase", "--data-dir", str(data_dir)) == cli.EXIT_FAILURE
    assert "INFERFLUX_STORE_NEW_PASSPHRASE" in capsys.readouterr().err


def test_store_settings_from_the_environment(tmp_path: Path) -> None:
    from inferflux.gateway.settings import load_settings

    env = {
        "INFERFLUX_DATA_DIR": str(tmp_path),
        "INFERFLUX_STORE_URL": "postgresql://inferflux@db/inferflux",
        "INFERFLUX_STORE_PASSPHRASE": "from the environment",
    }
    settings = load_settings(env=env)
    assert settings.store.url == "postgresql://inferflux@db/inferflux"
    assert settings.store.passphrase is not None
    assert settings.store.passphrase.get_secret_value() == "from the environment"
    assert "from the environment" not in repr(settings)
    key_file = load_settings(env={"INFERFLUX_STORE_KEY_FILE": "~/store.key"}).store.key_file
    assert key_file == Path.home() / "store.key"
