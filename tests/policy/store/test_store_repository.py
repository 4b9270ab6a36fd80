"""The store's data-access API on SQLite and PostgreSQL: tenants, isolation, pages, versions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from inferflux.policy.errors import Conflict, NotFound, ValidationFailed
from inferflux.policy.store import PolicyStore
from inferflux.policy.store.records import Page


def test_tenant_lifecycle(store: PolicyStore) -> None:
    tenant = store.create_tenant("acme", display_name="Acme Inc.", allowed_models=["m1", "m2", "m1"])
    assert tenant.id.startswith("ten_") and tenant.name == "acme"
    assert tenant.allowed_models == ("m1", "m2")  # duplicates dropped, order kept
    assert tenant.created_at.tzinfo is UTC and not tenant.disabled
    assert store.get_tenant(tenant.id) == tenant
    assert store.get_tenant_by_name("acme") == tenant

    updated = store.update_tenant(tenant.id, disabled=True, allowed_models=None, display_name=None)
    assert updated.disabled and updated.allowed_models is None and updated.display_name is None
    assert updated.updated_at >= tenant.updated_at and updated.created_at == tenant.created_at
    assert store.update_tenant(tenant.id, name="acme-2").name == "acme-2"

    store.delete_tenant(tenant.id)
    with pytest.raises(NotFound, match=tenant.id):
        store.get_tenant(tenant.id)
    with pytest.raises(NotFound):
        store.get_tenant_by_name("acme-2")
    with pytest.raises(NotFound):
        store.delete_tenant(tenant.id)


def test_tenant_validation_and_conflicts(store: PolicyStore) -> None:
    store.create_tenant("acme")
    with pytest.raises(Conflict, match="'acme' already exists"):
        store.create_tenant("acme")
    other = store.create_tenant("beta")
    with pytest.raises(Conflict):
        store.update_tenant(other.id, name="acme")
    for bad in ("", "Acme", "-acme", "a" * 64, "acme_inc", "ac me"):
        with pytest.raises(ValidationFailed) as info:
            store.create_tenant(bad)
        assert info.value.param == "name" and info.value.status_code == 422
    with pytest.raises(ValidationFailed, match="allowed_models"):
        store.create_tenant("gamma", allowed_models=["ok", ""])
    with pytest.raises(ValidationFailed):
        store.create_tenant("gamma", display_name="x" * 201)
    assert store.count_tenants() == 2


def test_records_are_frozen_snapshots(store: PolicyStore) -> None:
    tenant = store.create_tenant("acme", allowed_models=["m"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        tenant.name = "other"  # type: ignore[misc]
    provider = store.create_oidc_provider("idp", "https://idp.example", "aud", client_secret="very-secret")
    assert "very-secret" not in repr(provider)
    policy = store.create_policy(None, "guardrail", "g", {}, sensitive_spec="hidden")
    assert "hidden" not in repr(policy)
    credential = store.create_credential(None, "c", "cred-secret")
    assert "cred-secret" not in repr(credential)


def test_pagination(store: PolicyStore) -> None:
    created = [store.create_tenant(f"t{i:02d}") for i in range(7)]
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        page = store.list_tenants(limit=3, after=after)
        assert isinstance(page, Page) and len(page.items) <= 3
        seen += [t.id for t in page.items]
        pages += 1
        if page.next_cursor is None:
            break
        after = page.next_cursor
    assert seen == [t.id for t in created] and pages == 3

    # The cursor stays valid when rows are added after it.
    first = store.list_tenants(limit=2)
    store.create_tenant("late")
    rest = store.list_tenants(limit=200, after=first.next_cursor)
    assert [t.name for t in rest.items] == [f"t{i:02d}" for i in range(2, 7)] + ["late"]
    assert rest.next_cursor is None

    for bad in (0, 201, -1):
        with pytest.raises(ValidationFailed) as info:
            store.list_tenants(limit=bad)
        assert info.value.param == "limit"
    for cursor in ("garbage", "eyJ4IjogMX0", "WyIyMDI1LTAxLTAxVDAwOjAwOjAwIiwgMV0"):
        with pytest.raises(ValidationFailed) as info:
            store.list_tenants(after=cursor)
        assert info.value.param == "after"


def test_policy_version_is_bumped_by_every_change_of_policy(store: PolicyStore) -> None:
    def bumps(action: Callable[[], object]) -> int:
        before = store.policy_version()
        action()
        return store.policy_version() - before

    assert store.policy_version() >= 0
    tenant = store.create_tenant("acme")
    assert bumps(lambda: store.update_tenant(tenant.id, disabled=True)) == 1
    key, _ = store.create_api_key(tenant.id, "k", "member")
    assert bumps(lambda: store.revoke_api_key(tenant.id, key.id)) == 1
    provider = store.create_oidc_provider("idp", "https://idp.example", "aud", tenant_ids=[tenant.id])

    def bind() -> object:
        return store.create_role_binding(tenant.id, provider_id=provider.id, kind="group", subject="g", role="viewer")

    assert bumps(bind) == 1
    assert bumps(lambda: store.create_served_model("m", "/models/m.gguf")) == 1
    assert bumps(lambda: store.create_policy(tenant.id, "rate_limit", "r", {"rpm": 5})) == 1
    assert bumps(lambda: store.delete_tenant(tenant.id)) == 1
    # Reads, failed writes, use times and admin events change no policy.
    assert bumps(lambda: store.list_tenants()) == 0
    with pytest.raises(Conflict):
        store.create_oidc_provider("idp", "https://other.example", "aud")
    assert bumps(lambda: store.touch_api_keys({key.id: datetime.now(UTC)})) == 0
    assert bumps(lambda: store.record_admin_event(principal="p", action="a", target_kind="t")) == 0


def test_objects_of_another_tenant_are_not_found(store: PolicyStore) -> None:
    a, b = store.create_tenant("a"), store.create_tenant("b")
    provider = store.create_oidc_provider("idp", "https://idp.example", "aud", tenant_ids=[a.id])
    key, _ = store.create_api_key(a.id, "k", "member")
    binding = store.create_role_binding(a.id, provider_id=provider.id, kind="subject", subject="alice", role="member")
    policy = store.create_policy(a.id, "quota", "q", {"tokens": 10})
    credential = store.create_credential(a.id, "upstream", "tok")

    attempts = [
        lambda: store.get_api_key(b.id, key.id),
        lambda: store.revoke_api_key(b.id, key.id),
        lambda: store.rotate_api_key(b.id, key.id, 60),
        lambda: store.get_role_binding(b.id, binding.id),
        lambda: store.delete_role_binding(b.id, binding.id),
        lambda: store.get_policy(b.id, policy.id),
        lambda: store.get_policy(None, policy.id),  # a tenant's policy is not a global one
        lambda: store.update_policy(b.id, policy.id, enabled=False),
        lambda: store.delete_policy(b.id, policy.id),
        lambda: store.get_credential(b.id, credential.id),
        lambda: store.delete_credential(b.id, credential.id),
    ]
    for attempt in attempts:
        with pytest.raises(NotFound) as other_tenant:
            attempt()
        assert "'b'" not in other_tenant.value.message and a.id not in other_tenant.value.message
    # Exactly the answer for an id that does not exist at all.
    with pytest.raises(NotFound) as missing:
        store.get_api_key(b.id, "key_doesnotexist0000")
    with pytest.raises(NotFound) as foreign:
        store.get_api_key(b.id, key.id)
    assert foreign.value.message == missing.value.message.replace("key_doesnotexist0000", key.id)
    assert foreign.value.code == missing.value.code == "not_found"

    assert store.list_api_keys(b.id).items == ()
    assert store.list_role_bindings(b.id).items == ()
    assert store.list_policies(b.id).items == ()
    assert store.list_credentials(b.id).items == ()
    assert store.get_api_key(a.id, key.id) == key  # all still there for their owner
    assert store.get_policy(a.id, policy.id).name == "q"


def test_deleting_a_tenant_deletes_what_it_owns(store: PolicyStore) -> None:
    tenant = store.create_tenant("a")
    provider = store.create_oidc_provider("idp", "https://idp.example", "aud", tenant_ids=[tenant.id])
    owned = store.create_oidc_provider("own", "https://own.example", "aud", tenant_id=tenant.id)
    key, token = store.create_api_key(tenant.id, "k", "member")
    store.create_role_binding(tenant.id, provider_id=provider.id, kind="subject", subject="s", role="member")
    store.create_policy(tenant.id, "quota", "q", {})
    store.create_credential(tenant.id, "c", "secret")
    store.record_admin_event(tenant_id=tenant.id, principal="p", action="tenant.create", target_kind="tenant")
    store.delete_tenant(tenant.id)
    assert store.find_api_key(token) is None
    with pytest.raises(NotFound):
        store.get_api_key(tenant.id, key.id)
    assert store.find_role_bindings(provider.id, tenant.id, "s") == frozenset()
    with pytest.raises(NotFound):  # its own identity provider went with it
        store.get_oidc_provider(owned.id)
    assert store.get_oidc_provider(provider.id).tenant_ids == ()  # and it left the platform's provider's list
    assert store.list_policies(tenant.id).items == ()
    assert store.list_credentials(tenant.id).items == ()
    assert len(store.list_admin_events(tenant.id).items) == 1  # the record of what happened stays


def test_role_bindings(store: PolicyStore) -> None:
    tenant, other = store.create_tenant("a"), store.create_tenant("b")
    idp = store.create_oidc_provider("idp", "https://idp.example", "aud", tenant_ids=[tenant.id, other.id])
    idp2 = store.create_oidc_provider("idp2", "https://idp2.example", "aud", tenant_ids=[tenant.id])
    alice = store.create_role_binding(tenant.id, provider_id=idp.id, kind="subject", subject="alice", role="member")
    store.create_role_binding(tenant.id, provider_id=idp.id, kind="group", subject="admins", role="tenant-admin")
    store.create_role_binding(tenant.id, provider_id=idp.id, kind="group", subject="alice", role="viewer")
    store.create_role_binding(other.id, provider_id=idp.id, kind="subject", subject="alice", role="tenant-admin")
    store.create_role_binding(tenant.id, provider_id=idp2.id, kind="subject", subject="alice", role="tenant-admin")

    assert alice.id.startswith("rb_") and store.get_role_binding(tenant.id, alice.id) == alice
    assert store.find_role_bindings(idp.id, tenant.id, "alice") == {"member"}
    assert store.find_role_bindings(idp.id, tenant.id, "alice", ["admins", "staff"]) == {"member", "tenant-admin"}
    assert store.find_role_bindings(idp.id, tenant.id, "bob", ["alice"]) == {"viewer"}  # a group, not the subject
    assert store.find_role_bindings(idp.id, tenant.id, "bob") == frozenset()
    assert store.find_role_bindings(idp.id, other.id, "alice") == {"tenant-admin"}

    with pytest.raises(Conflict):
        store.create_role_binding(tenant.id, provider_id=idp.id, kind="subject", subject="alice", role="viewer")
    with pytest.raises(ValidationFailed, match="kind"):
        store.create_role_binding(tenant.id, provider_id=idp.id, kind="user", subject="x", role="viewer")
    with pytest.raises(ValidationFailed, match="unknown role"):
        store.create_role_binding(tenant.id, provider_id=idp.id, kind="subject", subject="x", role="root")
    with pytest.raises(ValidationFailed, match="identity provider"):
        store.create_role_binding(tenant.id, provider_id="idp_missing", kind="subject", subject="x", role="viewer")
    with pytest.raises(NotFound, match="tenant"):
        store.create_role_binding("ten_missing", provider_id=idp.id, kind="subject", subject="x", role="viewer")

    page = store.list_role_bindings(tenant.id, limit=2)
    assert len(page.items) == 2 and page.next_cursor is not None
    assert len(store.list_role_bindings(tenant.id, provider_id=idp2.id).items) == 1
    store.delete_role_binding(tenant.id, alice.id)
    assert store.find_role_bindings(idp.id, tenant.id, "alice") == frozenset()
    store.delete_oidc_provider(idp.id)  # takes its bindings along
    assert [b.provider_id for b in store.list_role_bindings(tenant.id).items] == [idp2.id]


def test_oidc_providers(store: PolicyStore) -> None:
    provider = store.create_oidc_provider(
        "corp",
        "https://login.corp.example",
        "inferflux",
        client_id="client",
        client_secret="shh",
        algorithms=["RS256"],
        role_map={"ml-admins": "tenant-admin"},
        required_claims=["email"],
        leeway_seconds=10,
    )
    assert provider.id.startswith("idp_") and provider.client_secret == "shh"
    assert provider.algorithms == ("RS256",) and provider.role_map == {"ml-admins": "tenant-admin"}
    assert (provider.tenant_claim, provider.roles_claim, provider.enabled) == ("tenant", "roles", True)
    assert store.get_oidc_provider(provider.id) == provider

    updated = store.update_oidc_provider(
        provider.id, client_secret="new", enabled=False, jwks_uri="https://k.example/jwks"
    )
    assert updated.client_secret == "new" and not updated.enabled and updated.jwks_uri == "https://k.example/jwks"
    assert store.list_enabled_oidc_providers() == []
    store.update_oidc_provider(provider.id, enabled=True, client_secret=None)
    [enabled] = store.list_enabled_oidc_providers()
    assert enabled.client_secret is None
    assert store.list_oidc_providers().items == (enabled,)

    with pytest.raises(Conflict):  # (issuer, audience) is the unique pair
        store.create_oidc_provider("other", "https://login.corp.example", "inferflux")
    with pytest.raises(Conflict):
        store.create_oidc_provider("corp", "https://else.example", "aud")
    for bad in (
        {"algorithms": ["none"]},
        {"algorithms": ["HS256"]},
        {"algorithms": []},
        {"role_map": {"x": "god"}},
        {"leeway_seconds": 301},
    ):
        with pytest.raises(ValidationFailed):
            store.create_oidc_provider("bad", "https://bad.example", "aud", **bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationFailed, match="issuer"):
        store.create_oidc_provider("bad", "ftp://bad.example", "aud")
    store.delete_oidc_provider(provider.id)
    with pytest.raises(NotFound):
        store.get_oidc_provider(provider.id)


def test_issuers_differing_in_a_trailing_slash_are_one_issuer(store: PolicyStore) -> None:
    # The verifier routes tokens by issuer without its trailing slash; two such
    # providers would make it refuse the whole list (and the gateway refuse to start).
    first = store.create_oidc_provider("corp", "https://login.corp.example", "aud", enabled=False)
    version = store.policy_version()
    with pytest.raises(Conflict, match="issuer"):
        store.create_oidc_provider("corp2", "https://login.corp.example/", "aud")
    other = store.create_oidc_provider("other", "https://other.example/", "aud")
    with pytest.raises(Conflict, match="issuer"):
        store.update_oidc_provider(other.id, issuer="https://login.corp.example//")
    assert store.policy_version() == version + 1  # only 'other' was written
    assert store.update_oidc_provider(first.id, issuer="https://login.corp.example/").issuer.endswith("/")
    assert {p.name for p in store.list_oidc_providers().items} == {"corp", "other"}


def test_served_models(store: PolicyStore) -> None:
    first = store.create_served_model("llama", "/m/llama.gguf", aliases=["l3"], is_default=True)
    second = store.create_served_model("qwen", "/m/qwen", backend="cuda", dtype="bfloat16")
    assert first.is_default and store.get_served_model_by_name("llama") == first
    assert [m.name for m in store.list_served_models()] == ["llama", "qwen"]

    assert store.set_default_served_model("qwen").is_default
    assert not store.get_served_model(first.id).is_default
    with pytest.raises(NotFound):
        store.set_default_served_model("nope")
    with pytest.raises(Conflict, match="l3"):
        store.create_served_model("mistral", "/m", aliases=["l3"])
    with pytest.raises(Conflict, match="qwen"):
        store.create_served_model("m2", "/m", aliases=["qwen"])
    with pytest.raises(Conflict):
        store.update_served_model(second.id, aliases=["llama"])
    updated = store.update_served_model(first.id, path="/m/llama-q8.gguf", aliases=["l3", "llama3"], is_default=True)
    assert updated.path == "/m/llama-q8.gguf" and updated.aliases == ("l3", "llama3")
    assert [m.name for m in store.list_served_models() if m.is_default] == ["llama"]
    store.delete_served_model(second.id)
    with pytest.raises(NotFound):
        store.get_served_model_by_name("qwen")


def test_policies(store: PolicyStore) -> None:
    tenant = store.create_tenant("a")
    global_policy = store.create_policy(None, "rate_limit", "default", {"rpm": 60})
    own = store.create_policy(tenant.id, "guardrail", "block", {"words": ["x"]}, sensitive_spec="api-token-123")
    assert own.sensitive_spec == "api-token-123" and own.spec == {"words": ["x"]}
    assert store.get_policy(None, global_policy.id) == global_policy
    assert [p.id for p in store.list_policies(None).items] == [global_policy.id]
    assert [p.id for p in store.list_policies(tenant.id).items] == [own.id]
    assert {p.id for p in store.list_policies(tenant.id, include_global=True).items} == {own.id, global_policy.id}
    assert store.list_policies(tenant.id, kind="rate_limit").items == ()

    updated = store.update_policy(tenant.id, own.id, spec={"words": ["y"]}, sensitive_spec=None, enabled=False)
    assert updated.spec == {"words": ["y"]} and updated.sensitive_spec is None and not updated.enabled
    with pytest.raises(ValidationFailed, match="kind"):
        store.create_policy(None, "firewall", "f", {})
    with pytest.raises(ValidationFailed, match="JSON"):
        store.create_policy(None, "quota", "q", {"at": datetime.now(UTC)})
    with pytest.raises(NotFound):
        store.create_policy("ten_missing", "quota", "q", {})
    store.delete_policy(None, global_policy.id)
    assert store.list_policies(None).items == ()


def test_credentials(store: PolicyStore) -> None:
    tenant = store.create_tenant("a")
    credential = store.create_credential(tenant.id, "siem", "splunk-token")
    assert credential.id.startswith("cred_") and credential.secret == "splunk-token"
    assert store.update_credential(tenant.id, credential.id, secret="rotated").secret == "rotated"
    assert [c.secret for c in store.list_credentials(tenant.id).items] == ["rotated"]
    with pytest.raises(ValidationFailed):
        store.create_credential(tenant.id, "empty", "")
    store.delete_credential(tenant.id, credential.id)
    with pytest.raises(NotFound):
        store.get_credential(tenant.id, credential.id)


def test_credentials_by_name(store: PolicyStore) -> None:
    """A model's upstream names its credential: one per name and owner, the platform's found by name."""
    tenant = store.create_tenant("a")
    fleet = store.create_credential(None, "vllm-fleet", "sk-one")
    store.create_credential(tenant.id, "vllm-fleet", "tenant-owned")  # another owner: its own namespace
    store.create_credential(tenant.id, "theirs", "tenant-only")
    assert store.credential_secret_by_name("vllm-fleet") == "sk-one"
    store.update_credential(None, fleet.id, secret="sk-two")
    assert store.credential_secret_by_name("vllm-fleet") == "sk-two"
    with pytest.raises(NotFound):
        store.credential_secret_by_name("theirs")  # a tenant's is not the platform's
    with pytest.raises(Conflict):
        store.create_credential(None, "vllm-fleet", "again")
    with pytest.raises(Conflict):
        store.create_credential(tenant.id, "vllm-fleet", "again")
    other = store.create_credential(None, "other", "x")
    with pytest.raises(Conflict):
        store.update_credential(None, other.id, name="vllm-fleet")
    store.delete_credential(None, fleet.id)
    with pytest.raises(NotFound):
        store.credential_secret_by_name("vllm-fleet")


@pytest.mark.parametrize(
    ("name", "secret", "param"),
    [
        ("Upper", "s", "name"),  # names are slugs, as the YAML that refers to them writes them
        ("a b", "s", "name"),
        ("ok", "", "secret"),
        ("ok", "x" * 8193, "secret"),
        ("ok", "line\r\nx-injected: 1", "secret"),  # CR/LF would split the header it is sent in
        ("ok", "tab\there", "secret"),
        ("ok", "del\x7f", "secret"),
        ("ok", "zero\u200bwidth", "secret"),
        ("ok", "bidi\u202e", "secret"),
        ("ok", "nul\x00", "secret"),
    ],
)
def test_credential_values_are_checked(store: PolicyStore, name: str, secret: str, param: str) -> None:
    with pytest.raises(ValidationFailed) as refused:
        store.create_credential(None, name, secret)
    assert refused.value.param == param
    if param == "secret" and secret:
        assert secret not in refused.value.message  # never quoted back
    assert store.list_credentials(None).items == ()
    good = store.create_credential(None, "good", "x" * 8192)
    with pytest.raises(ValidationFailed):
        store.update_credential(None, good.id, secret=secret if param == "secret" else "")
    assert store.credential_secret_by_name("good") == "x" * 8192


def test_admin_events(store: PolicyStore) -> None:
    a, b = store.create_tenant("a"), store.create_tenant("b")
    for i in range(3):
        store.record_admin_event(
            tenant_id=a.id,
            principal="key:abc",
            action="key.create",
            target_kind="api_key",
            target_id=f"key_{i}",
            detail={"n": i},
        )
    store.record_admin_event(tenant_id=b.id, principal="key:abc", action="tenant.update", target_kind="tenant")
    platform = store.record_admin_event(principal="key:root", action="oidc_provider.create", target_kind="idp")
    page = store.list_admin_events(a.id, limit=2)
    assert [e.target_id for e in page.items] == ["key_0", "key_1"] and page.items[0].detail == {"n": 0}
    assert [e.target_id for e in store.list_admin_events(a.id, after=page.next_cursor).items] == ["key_2"]
    assert len(store.list_admin_events(b.id).items) == 1
    everything = store.list_admin_events(None)
    assert len(everything.items) == 5 and everything.items[-1] == platform and platform.tenant_id is None
    assert platform.at.tzinfo is UTC


def test_identity_providers_are_bound_to_tenants(store: PolicyStore) -> None:
    platform = store.get_tenant(store.create_tenant("platform").id)
    acme, globex = store.create_tenant("acme"), store.create_tenant("globex")
    mine = store.create_oidc_provider("sso", "https://sso.example", "acme-app", tenant_id=acme.id)
    assert (mine.tenant_id, mine.tenant_ids, mine.allow_platform) == (acme.id, (), False)
    # Names are per owner; (issuer, audience) pairs across owners.
    theirs = store.create_oidc_provider("sso", "https://sso.example", "globex-app", tenant_id=globex.id)
    with pytest.raises(Conflict):
        store.create_oidc_provider("copy", "https://sso.example/", "acme-app", tenant_id=globex.id)
    with pytest.raises(Conflict):
        store.create_oidc_provider("sso", "https://elsewhere.example", "a", tenant_id=acme.id)

    # Another owner's provider is answered as a missing one.
    for attempt in (
        lambda: store.get_oidc_provider(theirs.id, owner=acme.id),
        lambda: store.update_oidc_provider(theirs.id, owner=acme.id, enabled=False),
        lambda: store.delete_oidc_provider(theirs.id, owner=acme.id),
        lambda: store.get_oidc_provider(theirs.id, owner=None),
    ):
        with pytest.raises(NotFound, match="No identity provider"):
            attempt()
    assert [p.id for p in store.list_oidc_providers(owner=acme.id).items] == [mine.id]
    assert store.get_oidc_provider(theirs.id).enabled is True

    # What a tenant's provider can never be: a mapper into other tenants, or the platform's.
    refused = [
        ({"tenant_id": acme.id, "tenant_ids": [globex.id]}, "tenant_ids"),
        ({"tenant_id": acme.id, "allow_platform": True}, "allow_platform"),
        ({"tenant_id": acme.id, "role_map": {"root": "platform-admin"}}, "role_map"),
        ({"tenant_id": platform.id}, "tenant_id"),
        ({"tenant_ids": [platform.id]}, "tenant_ids"),  # the platform tenant comes with allow_platform only
        ({"tenant_ids": ["ten_missing"]}, "tenant_ids"),
        ({"role_map": {"root": "platform-admin"}}, "role_map"),  # platform-owned, without allow_platform
    ]
    for n, (settings, param) in enumerate(refused):
        with pytest.raises(ValidationFailed) as refusal:
            store.create_oidc_provider(f"bad-{n}", f"https://bad-{n}.example", "a", **settings)  # type: ignore[arg-type]
        assert refusal.value.param == param, settings
    with pytest.raises(ValidationFailed):
        store.update_oidc_provider(mine.id, tenant_ids=[globex.id])
    with pytest.raises(ValidationFailed):
        store.create_oidc_provider("huge", "https://huge.example/" + "x" * 1500, "y" * 600)
    root = store.create_oidc_provider("root", "https://root.example", "a", allow_platform=True,
                                      role_map={"root": "platform-admin"})  # fmt: skip
    assert root.bounds().grants_platform_admin

    # Role bindings honour the same bounds: another tenant's provider is an unknown one.
    shared = store.create_oidc_provider("shared", "https://shared.example", "a", tenant_ids=[acme.id])
    store.create_role_binding(acme.id, provider_id=mine.id, kind="group", subject="g", role="tenant-admin")
    store.create_role_binding(acme.id, provider_id=shared.id, kind="group", subject="g", role="member")
    for tenant_id, provider_id in [
        (globex.id, mine.id),  # acme's provider, in globex
        (globex.id, shared.id),  # a platform provider outside its list
        (platform.id, shared.id),  # the platform tenant without allow_platform
    ]:
        with pytest.raises(ValidationFailed, match="unknown identity provider") as refusal:
            store.create_role_binding(tenant_id, provider_id=provider_id, kind="subject", subject="x", role="member")
        assert refusal.value.param == "provider_id"
    with pytest.raises(ValidationFailed) as refusal:
        store.create_role_binding(acme.id, provider_id=root.id, kind="subject", subject="x", role="platform-admin")
    assert refusal.value.param == "role"
    store.create_role_binding(platform.id, provider_id=root.id, kind="subject", subject="ops", role="platform-admin")
