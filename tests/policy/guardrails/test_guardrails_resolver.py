"""Effective guardrails from the policy store (SQLite and PostgreSQL): merging, caching, live edits."""

from __future__ import annotations

import asyncio

import pytest

from inferflux.policy.guardrails import GuardrailMisconfigured, GuardrailResolver, Guardrails, opa_input
from inferflux.policy.rbac import Principal
from inferflux.policy.store import PolicyStore

ALLOW_ALL = 'package inferflux.guardrails\nimport rego.v1\ndecision := {"allow": true}\n'
DENY_ALL = 'package inferflux.guardrails\nimport rego.v1\ndecision := {"allow": false, "reasons": ["closed today"]}\n'


def authorize(guardrails: Guardrails, tenant_id: str) -> tuple[bool, tuple[str, ...]]:
    principal = Principal(tenant_id, "acme", "key:x", "api_key", frozenset({"member"}))
    doc = opa_input(principal, model="m", route="/v1/completions", prompt_tokens=1)
    verdict = asyncio.run(guardrails.authorize(doc))
    return verdict.allowed, verdict.reasons


def test_global_and_tenant_policies_merge(store: PolicyStore) -> None:
    acme = store.create_tenant("acme")
    other = store.create_tenant("other")
    store.create_policy(None, "guardrail", "global", {"pii": {"email": "redact", "card": "log"}})
    store.create_policy(acme.id, "guardrail", "acme", {"pii": {"card": "block"}, "blocklist": [{"literal": "ski"}]})
    store.create_policy(other.id, "guardrail", "off", {"blocklist": [{"literal": "golf"}]}, enabled=False)
    resolver = GuardrailResolver(store, poll_seconds=0)

    acme_rails = resolver.get(acme.id)
    assert acme_rails.check_input(["ski"]).blocked
    card = acme_rails.check_input(["4111 1111 1111 1111"])
    assert card.blocked and card.findings[0].policy == "acme"  # the strictest mode wins
    assert acme_rails.check_input(["bob@example.com"]).texts == ("[EMAIL]",)

    other_rails = resolver.get(other.id)
    assert not other_rails.check_input(["ski golf"]).blocked  # acme's rule and a disabled policy do not apply
    assert other_rails.check_input(["4111 1111 1111 1111"]).texts == ("4111 1111 1111 1111",)
    assert other_rails.check_input(["bob@example.com"]).texts == ("[EMAIL]",)


def test_edits_take_effect_without_restart(store: PolicyStore) -> None:
    acme = store.create_tenant("acme")
    policy = store.create_policy(acme.id, "guardrail", "acme", {"opa": {"rego": ALLOW_ALL}})
    resolver = GuardrailResolver(store, poll_seconds=0)
    assert authorize(resolver.get(acme.id), acme.id) == (True, ())
    assert not resolver.get(acme.id).check_input(["ski"]).blocked

    store.update_policy(acme.id, policy.id, spec={"opa": {"rego": DENY_ALL}, "blocklist": [{"literal": "ski"}]})
    assert authorize(resolver.get(acme.id), acme.id) == (False, ("closed today",))
    assert resolver.get(acme.id).check_input(["ski"]).blocked

    store.update_policy(acme.id, policy.id, enabled=False)
    assert authorize(resolver.get(acme.id), acme.id) == (True, ())


def test_cached_within_the_poll_interval(store: PolicyStore) -> None:
    acme = store.create_tenant("acme")
    now = [0.0]
    resolver = GuardrailResolver(store, poll_seconds=1.0, clock=lambda: now[0])
    first = resolver.get(acme.id)
    assert resolver.cached(acme.id) is first
    store.create_policy(acme.id, "guardrail", "acme", {"blocklist": [{"literal": "ski"}]})
    assert resolver.get(acme.id) is first  # the version is not read again yet
    now[0] = 1.5
    assert resolver.cached(acme.id) is None
    assert resolver.get(acme.id).check_input(["ski"]).blocked
    assert asyncio.run(resolver.resolve(acme.id)) is resolver.get(acme.id)


def test_readings_of_another_poller_stand_for_its_own_polls(store: PolicyStore) -> None:
    # The gateway's authenticator reads policy_version every interval and hands it over (observe):
    # the resolver then answers from its cache without reading the store, and drops it on a change.
    acme = store.create_tenant("acme")
    now = [0.0]
    reads = [0]
    read_version = store.policy_version

    def counted() -> int:
        reads[0] += 1
        return read_version()

    resolver = GuardrailResolver(store, poll_seconds=1.0, clock=lambda: now[0])
    first = resolver.get(acme.id)
    store.policy_version = counted  # type: ignore[method-assign]
    for step in range(1, 6):  # a reading every interval, requests in between: no read of its own
        now[0] = step * 1.0
        resolver.observe(read_version())
        now[0] += 0.99
        assert resolver.cached(acme.id) is first
    assert reads[0] == 0
    store.create_policy(acme.id, "guardrail", "acme", {"blocklist": [{"literal": "ski"}]})
    resolver.observe(read_version())  # the change, seen by the other poller
    assert resolver.cached(acme.id) is None
    assert resolver.get(acme.id).check_input(["ski"]).blocked and reads[0] == 0
    # The readings stop: after two intervals the resolver reads the version itself again.
    now[0] += 2.0
    assert resolver.cached(acme.id) is None
    resolver.get(acme.id)
    assert reads[0] == 1


def test_unchanged_opa_policy_is_not_recompiled(store: PolicyStore) -> None:
    acme = store.create_tenant("acme")
    store.create_policy(acme.id, "guardrail", "acme", {"opa": {"rego": ALLOW_ALL}})
    resolver = GuardrailResolver(store, poll_seconds=0)
    engine = resolver.get(acme.id).engines[0]
    store.create_tenant("unrelated")  # moves the policy version
    assert resolver.get(acme.id).engines[0] is engine


def test_an_invalid_stored_policy_fails_closed(store: PolicyStore) -> None:
    acme = store.create_tenant("acme")
    store.create_policy(acme.id, "guardrail", "broken", {"blocklist": [{"regex": "("}]})
    resolver = GuardrailResolver(store, poll_seconds=0)
    with pytest.raises(GuardrailMisconfigured) as caught:
        resolver.get(acme.id)
    assert caught.value.status_code == 503 and "'broken'" in caught.value.message


def test_resolver_closes_its_engines(store: PolicyStore) -> None:
    acme = store.create_tenant("acme")
    store.create_policy(acme.id, "guardrail", "acme", {"opa": {"rego": ALLOW_ALL}})
    resolver = GuardrailResolver(store, poll_seconds=60)
    first = resolver.get(acme.id)
    asyncio.run(resolver.aclose())
    assert resolver.cached(acme.id) is None
    assert resolver.get(acme.id).engines[0] is not first.engines[0]


def test_edits_do_not_pile_up_compiled_policies(store: PolicyStore) -> None:
    acme, other = store.create_tenant("acme"), store.create_tenant("other")
    policy = store.create_policy(acme.id, "guardrail", "acme", {"opa": {"rego": ALLOW_ALL}})
    store.create_policy(other.id, "guardrail", "other", {"opa": {"rego": DENY_ALL}})
    resolver = GuardrailResolver(store, poll_seconds=0)
    kept = resolver.get(other.id).engines[0]
    for i in range(20):  # each edit is a new policy version and a new compiled engine
        rego = ALLOW_ALL.replace("true}", f'true, "reasons": ["edit {i}"]}}')
        store.update_policy(acme.id, policy.id, spec={"opa": {"rego": rego}})
        assert resolver.get(acme.id).engines[0].name == "acme"
        assert resolver.get(other.id).engines[0] is kept  # unchanged: taken back, not recompiled
    assert resolver.held_engines <= 4  # this version's two, and at most two retired
    assert authorize(resolver.get(acme.id), acme.id) == (True, ())
