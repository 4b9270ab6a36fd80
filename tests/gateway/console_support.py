"""The console tests' shared parts: an app over a seeded store (no model), and signing in through the form."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def console_app(store: Any, data_dir: Path) -> Any:
    from inferflux.gateway.app import create_app
    from inferflux.gateway.models.served import ModelManager
    from inferflux.gateway.settings import Settings

    return create_app(Settings(data_dir=data_dir), ModelManager(expected=[]), store=store, owns_models=False)


def key_of(headers: dict[str, str]) -> str:
    return headers["authorization"].split(" ", 1)[1]


def sign_in(client: TestClient, key: str) -> str:
    """Signs ``client`` in with ``key`` through the form; the session's CSRF token."""
    form = client.get("/console/login")
    token = CSRF.search(form.text).group(1)  # type: ignore[union-attr]
    answer = client.post("/console/login", data={"csrf": token, "api_key": key, "next": "/console/"},
                         follow_redirects=False)  # fmt: skip
    assert answer.status_code == 303, answer.text
    home = client.get("/console/")
    assert home.status_code == 200, home.text
    return CSRF.search(home.text).group(1)  # type: ignore[union-attr]


def sibling(main: TestClient, base_url: str = "http://testserver") -> TestClient:
    """Another browser (its own cookie jar) on ``main``'s started app, in the app's own event loop: clients
    the app creates while serving (the OIDC verifier's) must not outlive a loop of one request."""
    client = TestClient(main.app, base_url=base_url)
    client.portal = main.portal
    return client
