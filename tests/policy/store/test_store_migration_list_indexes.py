"""Migration 0007: the indexes the admin API's large lists page through (tenants by creation, a tenant's
API keys by creation), on SQLite and PostgreSQL; and a deep page that starts its index range scan at the
cursor instead of walking from the first row (``benchmarks/bench_store_scale.py`` measured both at
100,000 tenants: docs/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, inspect

from inferflux.policy.store import PolicyStore, StoreSettings, migrate
from inferflux.policy.store.db import create_store_engine


@pytest.fixture
def engine(store_settings: StoreSettings, data_dir: Path) -> Iterator[Engine]:
    data_dir.mkdir()
    engine = create_store_engine(store_settings.database_url(data_dir), store_settings)
    migrate.upgrade(engine, "0006")
    yield engine
    engine.dispose()


def indexes(engine: Engine, table: str) -> dict[str, list[str]]:
    return {index["name"]: list(index["column_names"]) for index in inspect(engine).get_indexes(table)}


def test_upgrade_adds_the_list_indexes_and_downgrade_restores_the_old_one(engine: Engine) -> None:
    tenants_before, keys_before = indexes(engine, "tenants"), indexes(engine, "api_keys")
    assert keys_before["ix_api_keys_tenant_id"] == ["tenant_id"]
    assert "ix_tenants_created_at_id" not in tenants_before

    migrate.upgrade(engine, "0007")
    assert indexes(engine, "tenants") == {**tenants_before, "ix_tenants_created_at_id": ["created_at", "id"]}
    keys = indexes(engine, "api_keys")
    assert keys["ix_api_keys_tenant_id_created_at_id"] == ["tenant_id", "created_at", "id"]
    assert "ix_api_keys_tenant_id" not in keys  # the new index's first column serves what it served

    migrate.downgrade(engine, "0006")
    assert indexes(engine, "tenants") == tenants_before
    assert indexes(engine, "api_keys") == keys_before


def deep_page_plan(store: PolicyStore, list_page: Callable[[str | None], Any]) -> str:
    """The plan of the statement that fetches the page after a full first page, on the store's database.

    PostgreSQL is told to avoid sequential scans and sorts: on a few rows it rightly prefers them, and
    the question here is whether the query *can* start its index scan at the cursor.
    """
    after = list_page(None).next_cursor
    assert after is not None
    sent: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any, _many: bool) -> None:
        sent.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", capture)
    try:
        assert list_page(after).items
    finally:
        event.remove(store.engine, "before_cursor_execute", capture)
    statement, parameters = next((s, p) for s, p in sent if "ORDER BY" in s)
    with store.engine.begin() as connection:
        if connection.dialect.name == "sqlite":
            rows = connection.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters).all()
            return "\n".join(str(row[-1]) for row in rows)
        connection.exec_driver_sql("SET LOCAL enable_seqscan = off")
        connection.exec_driver_sql("SET LOCAL enable_sort = off")
        return "\n".join(connection.exec_driver_sql("EXPLAIN " + statement, parameters).scalars())


def test_a_deep_page_starts_its_index_range_at_the_cursor(store: PolicyStore) -> None:
    tenant = store.create_tenant("acme")
    for i in range(12):
        store.create_tenant(f"tenant-{i}")
        store.create_api_key(tenant.id, f"key {i}", "member")

    tenants = deep_page_plan(store, lambda after: store.list_tenants(limit=5, after=after))
    keys = deep_page_plan(store, lambda after: store.list_api_keys(tenant.id, limit=5, after=after))

    if store.engine.dialect.name == "sqlite":
        assert "SEARCH tenants USING INDEX ix_tenants_created_at_id (created_at>?)" in tenants, tenants
        assert "USING INDEX ix_api_keys_tenant_id_created_at_id (tenant_id=? AND created_at>?)" in keys, keys
    else:
        assert "Index Scan using ix_tenants_created_at_id on tenants" in tenants, tenants
        assert "Index Cond: (created_at >= " in tenants, tenants
        assert "Index Scan using ix_api_keys_tenant_id_created_at_id on api_keys" in keys, keys
        assert "Index Cond: (((tenant_id)::text = " in keys and "(created_at >= " in keys, keys
