"""An in-process app over its own SQLite store, shared by a test module: tenants of each test its own.

``AppWorld`` holds the store, the app, its TestClient and its data directory;
``open_world`` builds one (a module fixture's body) and closes the store after.
``LiveWorld`` (``open_live_world``) is the same app served over a real loopback
socket, for tests with a real client library; ``spool_events`` reads its audit events.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from starlette.testclient import TestClient

from inferflux.policy.store import PolicyStore, StoreSettings
from servers import start_uvicorn, stop_uvicorn

W = TypeVar("W", bound="AppWorld")
L = TypeVar("L", bound="LiveWorld")


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


class AppWorld:
    tenant_prefix = "t"

    def __init__(self, store: PolicyStore, app: Any, client: TestClient, data_dir: Path) -> None:
        self.store, self.app, self.client, self.data_dir = store, app, client, data_dir
        self.n = 0

    def tenant_key(self) -> tuple[Any, str]:
        """A fresh tenant with a member key: policies of one test never touch another's."""
        self.n += 1
        tenant = self.store.create_tenant(f"{self.tenant_prefix}{self.n}")
        return tenant, self.store.create_api_key(tenant.id, "k", "member")[1]

    def settled(self) -> None:
        """Rate-limit settlements (and the audit events after them) run after the response; wait for them."""
        wait_until(lambda: not self.app.state.traffic_tasks)


@contextmanager
def open_world(cls: type[W], make_app: Any, data_dir: Path, **app_options: Any) -> Iterator[W]:
    store = PolicyStore.open(StoreSettings(), data_dir)
    app = make_app(store, data_dir=str(data_dir), **app_options)
    try:
        with TestClient(app) as client:
            yield cls(store, app, client, data_dir)
    finally:
        store.close()


def spool_events(data_dir: Path) -> dict[str, dict[str, Any]]:
    """The audit events in the spool under ``data_dir`` (an app's data directory), by request id."""
    segments = sorted((data_dir / "audit" / "segments").glob("*.jsonl"))
    return {e["event"]["request_id"]: e["event"] for s in segments for line in s.read_text().splitlines()
            if (e := json.loads(line))}  # fmt: skip


class LiveWorld:
    """An app over its own store, served on a loopback socket at ``url``."""

    tenant_prefix = "l"

    def __init__(self, store: PolicyStore, url: str, data_dir: Path, app: Any) -> None:
        self.store, self.url, self.data_dir, self.app = store, url, data_dir, app
        self.n = 0

    def tenant_key(self, **tenant: Any) -> tuple[Any, str]:
        """A fresh tenant (``tenant``: its fields, an allow-list say) with a member key."""
        self.n += 1
        record = self.store.create_tenant(f"{self.tenant_prefix}{self.n}", **tenant)
        return record, self.store.create_api_key(record.id, "k", "member")[1]

    def settled(self) -> None:
        wait_until(lambda: not self.app.state.traffic_tasks)

    def events(self) -> dict[str, dict[str, Any]]:
        return spool_events(self.data_dir)


@contextmanager
def open_live_world(cls: type[L], make_app: Any, data_dir: Path, **app_options: Any) -> Iterator[L]:
    store = PolicyStore.open(StoreSettings(), data_dir)
    app = make_app(store, data_dir=str(data_dir), **app_options)
    server, thread, sock, url = start_uvicorn(app)
    try:
        yield cls(store, url, data_dir, app)
    finally:
        stop_uvicorn(server, thread, sock)
        store.close()
