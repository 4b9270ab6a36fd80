"""API keys in the store: create, find, expire, revoke, rotate with grace, last use; bootstrap."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from inferflux.policy.authn import apikeys
from inferflux.policy.authn.apikeys import parse_key
from inferflux.policy.errors import Conflict, NotFound, StoreConfigError, ValidationFailed
from inferflux.policy.store import PolicyStore, StoreSettings
from inferflux.policy.store.models import ApiKey


def test_create_and_find(store: PolicyStore) -> None:
    tenant = store.create_tenant("acme", allowed_models=["m1", "m2"])
    record, token = store.create_api_key(tenant.id, "ci", "member", allowed_models=["m1"], created_by="key:boss")
    parsed = parse_key(token)
    assert parsed is not None and parsed.prefix == record.prefix
    assert record.id.startswith("key_") and record.tenant_id == tenant.id
    assert (record.name, record.role, record.allowed_models, record.created_by) == ("ci", "member", ("m1",), "key:boss")
    assert record.expires_at is record.revoked_at is record.last_used_at is record.replaced_by is None
    assert not hasattr(record, "key_hash")

    assert store.find_api_key(token) == record
    assert store.get_api_key(tenant.id, record.id) == record
    assert store.list_api_keys(tenant.id).items == (record,)


def test_only_the_hmac_of_a_key_is_stored(store: PolicyStore) -> None:
    tenant = store.create_tenant("acme")
    record, token = store.create_api_key(tenant.id, "k", "viewer")
    with store._sessions() as session:
        stored = session.scalar(select(ApiKey.key_hash).where(ApiKey.id == record.id))
    assert stored == apikeys.hash_key(store._pepper, token) and len(stored) == 32
    assert store._pepper and len(store._pepper) == 32


@pytest.mark.parametrize(
    "mangle",
    [
        lambda t: t[:-1] + ("A" if t[-1] != "A" else "B"),  # wrong secret
        lambda t: t.replace("ifx_", "ifx_x", 1),  # not our format
        lambda t: "ifx_aaaaaaaaaaaa_" + t.split("_")[2],  # a prefix nobody has
        lambda t: "",
        lambda t: t + " ",
    ],
)
def test_wrong_tokens_find_nothing(store: PolicyStore, mangle: object) -> None:
    tenant = store.create_tenant("acme")
    _, token = store.create_api_key(tenant.id, "k", "member")
    assert store.find_api_key(mangle(token)) is None  # type: ignore[operator]


def test_a_prefix_miss_still_computes_an_hmac(store: PolicyStore, monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[bytes] = []
    real = apikeys.verify_key

    def spy(pepper: bytes, token: str, stored: bytes) -> bool:
        compared.append(stored)
        return real(pepper, token, stored)

    monkeypatch.setattr("inferflux.policy.store.repos.api_keys.verify_key", spy)
    assert store.find_api_key(apikeys.generate_key().token) is None
    assert compared == [apikeys.DUMMY_HASH]


def test_expired_revoked_and_disabled_tenant_keys_find_nothing(store: PolicyStore) -> None:
    tenant = store.create_tenant("acme")
    soon = datetime.now(UTC) + timedelta(seconds=60)
    expiring, expiring_token = store.create_api_key(tenant.id, "short", "member", expires_at=soon)
    assert store.find_api_key(expiring_token) == expiring and expiring.expires_at == soon
    with store._sessions.begin() as session:  # let the clock pass its expiry
        session.get(ApiKey, expiring.id).expires_at = datetime.now(UTC)  # type: ignore[union-attr]
    assert store.find_api_key(expiring_token) is None

    revoked, revoked_token = store.create_api_key(tenant.id, "r", "member")
    first = store.revoke_api_key(tenant.id, revoked.id)
    assert first.revoked_at is not None
    assert store.revoke_api_key(tenant.id, revoked.id) == first  # again: no change
    assert store.find_api_key(revoked_token) is None

    _, token = store.create_api_key(tenant.id, "k", "member")
    store.update_tenant(tenant.id, disabled=True)
    assert store.find_api_key(token) is None
    store.update_tenant(tenant.id, disabled=False)
    assert store.find_api_key(token) is not None


def test_create_validation(store: PolicyStore) -> None:
    tenant = store.create_tenant("acme")
    with pytest.raises(ValidationFailed, match="unknown role"):
        store.create_api_key(tenant.id, "k", "superuser")
    with pytest.raises(ValidationFailed, match="past"):
        store.create_api_key(tenant.id, "k", "member", expires_at=datetime.now(UTC) - timedelta(seconds=1))
    with pytest.raises(ValidationFailed, match="time zone"):
        store.create_api_key(tenant.id, "k", "member", expires_at=datetime.now() + timedelta(days=1))
    with pytest.raises(ValidationFailed, match="name"):
        store.create_api_key(tenant.id, "", "member")
    with pytest.raises(NotFound, match="tenant"):
        store.create_api_key("ten_missing", "k", "member")


def test_rotation_with_grace(store: PolicyStore) -> None:
    tenant = store.create_tenant("acme")
    old, old_token = store.create_api_key(tenant.id, "ci", "tenant-admin", allowed_models=["m"])
    before = datetime.now(UTC)
    new, new_token = store.rotate_api_key(tenant.id, old.id, grace_seconds=600)
    assert new_token != old_token and new.id != old.id
    assert (new.name, new.role, new.allowed_models, new.tenant_id) == ("ci", "tenant-admin", ("m",), tenant.id)
    old_now = store.get_api_key(tenant.id, old.id)
    assert old_now.replaced_by == new.id
    assert old_now.expires_at is not None
    assert before + timedelta(seconds=600) <= old_now.expires_at <= datetime.now(UTC) + timedelta(seconds=600)
    assert store.find_api_key(old_token) is not None  # within its grace
    assert store.find_api_key(new_token) == new

    with pytest.raises(Conflict, match="already rotated"):
        store.rotate_api_key(tenant.id, old.id, grace_seconds=600)
    with pytest.raises(ValidationFailed):
        store.rotate_api_key(tenant.id, new.id, grace_seconds=-1)

    # No grace: the old key stops at once.
    newer, _ = store.rotate_api_key(tenant.id, new.id, grace_seconds=0)
    assert store.find_api_key(new_token) is None
    with pytest.raises(Conflict, match="expired"):
        store.rotate_api_key(tenant.id, new.id, grace_seconds=10)
    store.revoke_api_key(tenant.id, newer.id)
    with pytest.raises(Conflict, match="revoked"):
        store.rotate_api_key(tenant.id, newer.id, grace_seconds=10)


def test_rotation_never_extends_the_old_keys_life(store: PolicyStore) -> None:
    tenant = store.create_tenant("acme")
    expiry = datetime.now(UTC) + timedelta(minutes=5)
    old, _ = store.create_api_key(tenant.id, "k", "member", expires_at=expiry)
    store.rotate_api_key(tenant.id, old.id, grace_seconds=3600)
    assert store.get_api_key(tenant.id, old.id).expires_at == expiry


def test_a_rotated_key_keeps_the_old_keys_expiry(store: PolicyStore) -> None:
    # A key given for 30 days must not come back from a rotation valid for ever.
    tenant = store.create_tenant("acme")
    expiry = datetime.now(UTC) + timedelta(days=30)
    old, _ = store.create_api_key(tenant.id, "contractor", "member", expires_at=expiry)
    new, _ = store.rotate_api_key(tenant.id, old.id, grace_seconds=600)
    assert new.expires_at == expiry == store.get_api_key(tenant.id, new.id).expires_at
    sooner = datetime.now(UTC) + timedelta(days=1)
    newer, _ = store.rotate_api_key(tenant.id, new.id, grace_seconds=0, expires_at=sooner)
    assert newer.expires_at == sooner  # the caller may name another (as a new key could)
    forever, _ = store.create_api_key(tenant.id, "service", "member")
    assert store.rotate_api_key(tenant.id, forever.id)[0].expires_at is None


def test_last_used_is_batched_and_only_moves_forward(store: PolicyStore) -> None:
    tenant = store.create_tenant("acme")
    a, _ = store.create_api_key(tenant.id, "a", "member")
    b, _ = store.create_api_key(tenant.id, "b", "member")
    t1 = datetime.now(UTC)
    t2 = t1 + timedelta(seconds=30)
    store.touch_api_keys({a.id: t2, b.id: t1, "key_unknown000000000": t1})
    assert store.get_api_key(tenant.id, a.id).last_used_at == t2
    assert store.get_api_key(tenant.id, b.id).last_used_at == t1
    store.touch_api_keys({a.id: t1})  # an older report from a slower replica
    assert store.get_api_key(tenant.id, a.id).last_used_at == t2
    store.touch_api_keys({})


def test_list_keys_paginates(store: PolicyStore) -> None:
    tenant = store.create_tenant("acme")
    ids = [store.create_api_key(tenant.id, f"k{i}", "viewer")[0].id for i in range(5)]
    first = store.list_api_keys(tenant.id, limit=4)
    second = store.list_api_keys(tenant.id, limit=4, after=first.next_cursor)
    assert [k.id for k in first.items + second.items] == ids and second.next_cursor is None


# -- bootstrap --------------------------------------------------------------------------


def test_bootstrap_generates_a_key_once(store: PolicyStore) -> None:
    assert store.count_tenants() == 0 and not store.has_platform_admin()
    token = store.ensure_bootstrap_admin(None)
    assert token is not None
    key = store.find_api_key(token)
    assert key is not None and key.role == "platform-admin" and key.created_by == "bootstrap"
    assert store.get_tenant(key.tenant_id).name == "platform"
    assert store.has_platform_admin()
    version = store.policy_version()
    assert store.ensure_bootstrap_admin(None) is None  # idempotent
    assert store.ensure_bootstrap_admin(apikeys.generate_key().token) is None
    assert store.policy_version() == version and store.count_tenants() == 1


def test_bootstrap_with_a_given_key(store: PolicyStore) -> None:
    given = apikeys.generate_key().token
    assert store.ensure_bootstrap_admin(given) is None  # the caller knows it already
    key = store.find_api_key(given)
    assert key is not None and key.role == "platform-admin"


def test_a_revoked_bootstrap_key_does_not_come_back(store: PolicyStore) -> None:
    given = apikeys.generate_key().token
    store.ensure_bootstrap_admin(given)
    key = store.find_api_key(given)
    assert key is not None
    store.revoke_api_key(key.tenant_id, key.id)
    assert not store.has_platform_admin()
    assert store.ensure_bootstrap_admin(given) is None
    assert store.find_api_key(given) is None


def test_bootstrap_reuses_an_existing_platform_tenant(store: PolicyStore) -> None:
    platform = store.create_tenant("platform")
    token = store.ensure_bootstrap_admin(None)
    assert token is not None
    key = store.find_api_key(token)
    assert key is not None and key.tenant_id == platform.id


@pytest.mark.parametrize("bad", ["hunter2", "ifx_short_key", "sk-" + "a" * 48])
def test_bootstrap_rejects_a_key_not_in_our_format(sqlite_store: PolicyStore, bad: str) -> None:
    with pytest.raises(StoreConfigError, match="INFERFLUX_BOOTSTRAP_ADMIN_KEY is not an InferFlux API key"):
        sqlite_store.ensure_bootstrap_admin(bad)
    assert sqlite_store.count_tenants() == 0


def test_replicas_bootstrapping_at_once_make_one_admin(data_dir: Path, store_settings: StoreSettings) -> None:
    replicas = [PolicyStore.open(store_settings, data_dir) for _ in range(4)]
    barrier = threading.Barrier(len(replicas))

    def start(replica: PolicyStore) -> str | None:
        barrier.wait()
        return replica.ensure_bootstrap_admin(None)

    try:
        with ThreadPoolExecutor(len(replicas)) as pool:
            tokens = list(pool.map(start, replicas))
        assert len([t for t in tokens if t is not None]) == 1
        assert replicas[0].count_tenants() == 1
    finally:
        for replica in replicas:
            replica.close()
