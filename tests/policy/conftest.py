"""Policy store fixtures: a store on SQLite in tmp_path, and one on the real PostgreSQL
(``pg_url``, from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inferflux.policy.store import PolicyStore, StoreSettings


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_settings(request: pytest.FixtureRequest) -> StoreSettings:
    """Settings for a fresh store, once on each database."""
    if request.param == "sqlite":
        return StoreSettings()
    return StoreSettings(url=request.getfixturevalue("pg_url"))


@pytest.fixture
def store(store_settings: StoreSettings, data_dir: Path) -> Iterator[PolicyStore]:
    with PolicyStore.open(store_settings, data_dir) as opened:
        yield opened


@pytest.fixture
def sqlite_store(data_dir: Path) -> Iterator[PolicyStore]:
    with PolicyStore.open(StoreSettings(), data_dir) as opened:
        yield opened
