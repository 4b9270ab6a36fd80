"""Cached authentication decisions never outlive a change in the store.

The bound a revocation promises (one poll interval, see ``gateway.auth``)
holds only if a decision read from the store *before* a change cannot be
cached *after* the caches were dropped for it. These tests hold a request
between its store read and its cache write while the change lands, so the
race is deterministic.

Also: an identity provider the verifier would refuse alongside the others is
refused when it is registered, not by a 500 and a gateway that no longer starts.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from idp import RSA_KID, LoopbackIdP
from starlette.testclient import TestClient

from inferflux.gateway.app import create_app
from inferflux.gateway.auth import Authenticator
from inferflux.gateway.models.served import ModelManager
from inferflux.gateway.settings import Settings
from inferflux.policy.errors import InvalidApiKey, PermissionDenied
from inferflux.policy.store import PolicyStore, StoreSettings

WAIT = 10.0  # seconds; only reached when something is broken


class HeldStore:
    """The store, except that ``method`` stops after its read until ``release`` is set."""

    def __init__(self, store: PolicyStore, method: str) -> None:
        self._store = store
        self._method = method
        self.read_done = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name != self._method:
            return attr

        def held(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            self.read_done.set()
            if not self.release.wait(WAIT):
                raise RuntimeError("the test never released the held store call")
            return result

        return held


@pytest.fixture
def store(tmp_path: Path) -> Iterator[PolicyStore]:
    with PolicyStore.open(StoreSettings(), tmp_path) as opened:
        yield opened


@pytest.fixture
def idp() -> Iterator[LoopbackIdP]:
    with LoopbackIdP() as server:
        server.add_key("RSA", kid=RSA_KID)
        yield server


@pytest.fixture
async def cleanup() -> AsyncIterator[list[Authenticator]]:
    made: list[Authenticator] = []
    yield made
    for auth in made:
        await auth.verifier.aclose()


async def race(auth: Authenticator, held: HeldStore, credential: str, change: Any) -> Any:
    """Start authenticating ``credential``; after its store read, apply ``change`` and let the poll see it."""
    request = asyncio.create_task(auth.authenticate(f"Bearer {credential}", None))
    assert await asyncio.to_thread(held.read_done.wait, WAIT), "the request never reached the store"
    await asyncio.to_thread(change)
    assert await auth.refresh(), "the poll did not see the change"
    held.release.set()
    try:
        return await request
    except (InvalidApiKey, PermissionDenied) as exc:
        return exc


async def test_a_key_read_before_its_revocation_is_not_cached_after_it(
    store: PolicyStore, cleanup: list[Authenticator]
) -> None:
    tenant = store.create_tenant("acme")
    record, key = store.create_api_key(tenant.id, "app", "member")
    held = HeldStore(store, "find_api_key")
    auth = Authenticator(held, negative_ttl=2.0)  # type: ignore[arg-type]
    cleanup.append(auth)
    await auth.refresh(force=True)

    # The request in flight was decided before the revocation; it may finish as it began...
    principal = await race(auth, held, key, lambda: store.revoke_api_key(tenant.id, record.id))
    assert principal.key_id == record.id
    # ...but the next request must not be answered from a cache filled after the poll.
    with pytest.raises(InvalidApiKey):
        await auth.authenticate(f"Bearer {key}", None)


async def test_a_rejection_read_before_a_tenant_is_enabled_is_not_cached_after_it(
    store: PolicyStore, cleanup: list[Authenticator]
) -> None:
    tenant = store.create_tenant("acme")
    _, key = store.create_api_key(tenant.id, "app", "member")
    store.update_tenant(tenant.id, disabled=True)
    held = HeldStore(store, "find_api_key")
    auth = Authenticator(held, negative_ttl=60.0)  # type: ignore[arg-type]
    cleanup.append(auth)
    await auth.refresh(force=True)

    rejected = await race(auth, held, key, lambda: store.update_tenant(tenant.id, disabled=False))
    assert isinstance(rejected, InvalidApiKey)
    principal = await auth.authenticate(f"Bearer {key}", None)  # not the rejection, cached for a minute
    assert principal.tenant_name == "acme"


async def test_a_role_read_before_its_binding_is_deleted_is_not_cached_after_it(
    store: PolicyStore, idp: LoopbackIdP, cleanup: list[Authenticator]
) -> None:
    tenant = store.create_tenant("acme")
    provider = store.create_oidc_provider("loopback", idp.issuer, "inferflux", tenant_id=tenant.id)
    binding = store.create_role_binding(tenant.id, provider_id=provider.id, kind="subject", subject="ann", role="member")
    held = HeldStore(store, "find_role_bindings")
    auth = Authenticator(held)  # type: ignore[arg-type]
    cleanup.append(auth)
    await auth.refresh(force=True)
    token = idp.mint(idp.claims(sub="ann"), kid=RSA_KID)

    principal = await race(auth, held, token, lambda: store.delete_role_binding(tenant.id, binding.id))
    assert principal.roles == frozenset({"member"})
    with pytest.raises(PermissionDenied) as denied:
        await auth.authenticate(f"Bearer {token}", None)
    assert denied.value.code == "no_role"


def test_a_provider_whose_issuer_differs_only_by_a_slash_is_a_conflict(store: PolicyStore, tmp_path: Path) -> None:
    admin = store.ensure_bootstrap_admin()
    headers = {"authorization": f"Bearer {admin}"}

    def app() -> Any:
        return create_app(Settings(data_dir=tmp_path), ModelManager(expected=[]), store=store, owns_models=False)

    with TestClient(app()) as client:
        body = {"name": "corp", "issuer": "https://login.corp.example", "audience": "inferflux"}
        assert client.post("/admin/v1/oidc-providers", headers=headers, json=body).status_code == 201
        twin = {**body, "name": "corp-again", "issuer": "https://login.corp.example/"}
        response = client.post("/admin/v1/oidc-providers", headers=headers, json=twin)
        assert response.status_code == 409, response.text
        assert response.json()["error"]["code"] == "conflict"
        assert client.get("/admin/v1/whoami", headers=headers).status_code == 200
    # A replica (re)starting over this store still starts: its verifier accepts the providers.
    with TestClient(app()) as client:
        assert client.get("/admin/v1/whoami", headers=headers).status_code == 200
