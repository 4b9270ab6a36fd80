"""A request presents one credential: two that differ (``Authorization`` and ``x-api-key``, or a header sent
twice) are a 401, on the Anthropic adapter's ``/v1/messages`` as on every other route, over a real socket."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_helpers import error_of
from servers import start_uvicorn, stop_uvicorn

from inferflux.policy.store import PolicyStore, StoreSettings

FORGED = "ifx_aaaaaaaaaaaa_" + "A" * 43
ROUTES = [  # (method, path, body): the adapters', the OpenAI API's and an admin route
    ("POST", "/v1/messages", {"model": "fleet", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/chat/completions", {"model": "fleet", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/responses", {"model": "fleet", "input": "hi", "max_output_tokens": 2}),
    ("POST", "/v1/completions", {"model": "fleet", "prompt": "hi", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", "/admin/v1/whoami", None),
]  # fmt: skip


@dataclass
class Front:
    url: str
    member: str
    admin: str

    def call(self, method: str, path: str, body: Any, headers: list[tuple[str, str]]) -> httpx.Response:
        return httpx.request(method, self.url + path, headers=headers, json=body, timeout=30)


@pytest.fixture(scope="module")
def front(fleet_model: Any, app_for_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    data_dir: Path = tmp_path_factory.mktemp("conflicts")
    store = PolicyStore.open(StoreSettings(), data_dir)
    admin = str(store.ensure_bootstrap_admin())
    member = store.create_api_key(store.create_tenant("t").id, "m", "member")[1]
    server, thread, sock, url = start_uvicorn(app_for_model(fleet_model, store, data_dir=str(data_dir / "app")))
    try:
        yield Front(url, member, admin)
    finally:
        stop_uvicorn(server, thread, sock)
        store.close()


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_two_different_credentials_are_a_401(front: Front, method: str, path: str, body: Any) -> None:
    conflicts = {
        "valid bearer, invalid x-api-key": [("authorization", f"Bearer {front.member}"), ("x-api-key", FORGED)],
        "invalid bearer, valid x-api-key": [("authorization", f"Bearer {FORGED}"), ("x-api-key", front.member)],
        "two valid keys": [("authorization", f"Bearer {front.member}"), ("x-api-key", front.admin)],
        "authorization twice": [("authorization", f"Bearer {front.member}"), ("authorization", f"Bearer {FORGED}")],
        "x-api-key twice": [("x-api-key", front.admin), ("x-api-key", front.member)],
    }
    for name, headers in conflicts.items():
        answer = front.call(method, path, body, headers)
        assert answer.status_code == 401, (name, answer.text)
        assert front.member not in answer.text and front.admin not in answer.text
        if name != "invalid bearer, valid x-api-key":  # that one may fail on its bearer first, as before
            assert "conflicting_credentials" in answer.text, (name, answer.text)
    # One credential, in either header or in both: authenticated (whatever the route then answers).
    for headers in ([("authorization", f"Bearer {front.member}")], [("x-api-key", front.member)],
                    [("authorization", f"Bearer {front.member}"), ("x-api-key", front.member)],
                    [("x-api-key", front.member), ("x-api-key", front.member)]):  # fmt: skip
        answer = front.call(method, path, body, headers)
        assert answer.status_code not in (401, 500), (headers[0][0], answer.text)


def test_the_conflict_is_an_authentication_error_naming_both_headers(front: Front) -> None:
    answer = front.call("GET", "/v1/models", None, [("authorization", f"Bearer {front.member}"), ("x-api-key", FORGED)])
    error = error_of(answer)
    assert error["type"] == "authentication_error" and error["code"] == "conflicting_credentials"
    assert "x-api-key" in error["message"] and answer.headers["www-authenticate"] == "Bearer"
