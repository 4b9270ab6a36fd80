"""Tests that need a service on loopback (PostgreSQL, Redis, rsyslog, ...).

When the service is down its tests are skipped with the reason, except under
CI (``$CI`` set), where that is a failure: CI starts the services, so a
skip there would hide a broken set-up.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import pytest


def service_unavailable(reason: str, what: str) -> NoReturn:
    """Skip (or, under CI, fail) the test that needs ``what``, saying ``reason``."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI is set, so the {what} tests must run")
    pytest.skip(reason)


@contextmanager
def fresh_schema(server_url: str) -> Iterator[str]:
    """A URL of the PostgreSQL at ``server_url`` whose connections see only a new schema, dropped at the end."""
    from sqlalchemy import create_engine, pool
    from sqlalchemy.engine import make_url

    schema = f"t_{secrets.token_hex(8)}"
    admin = create_engine(server_url, poolclass=pool.NullPool, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    url = make_url(server_url).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()
