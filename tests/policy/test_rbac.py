"""Roles, scopes and the principal's checks."""

from __future__ import annotations

import pytest

from inferflux.policy.errors import NotFound, PermissionDenied
from inferflux.policy.rbac import ROLE_SCOPES, Principal, Role, Scope, effective_models, parse_role, scopes_of


def _principal(role: str, tenant: str = "ten_a", models: frozenset[str] | None = None) -> Principal:
    return Principal(tenant_id=tenant, tenant_name=tenant, subject="key:x", kind="api_key", roles=frozenset({role}), allowed_models=models)


def test_role_scopes_are_nested() -> None:
    # Each role can do everything the one below it can: no role is a sideways grant.
    order = [Role.VIEWER, Role.MEMBER, Role.TENANT_ADMIN, Role.PLATFORM_ADMIN]
    for lower, higher in zip(order, order[1:]):
        assert ROLE_SCOPES[lower] < ROLE_SCOPES[higher]
    assert ROLE_SCOPES[Role.VIEWER] == {Scope.READ}
    assert Scope.GENERATE not in ROLE_SCOPES[Role.VIEWER]
    assert Scope.ADMIN_PLATFORM in ROLE_SCOPES[Role.PLATFORM_ADMIN]


def test_unknown_roles_grant_nothing() -> None:
    assert scopes_of(["superuser"]) == frozenset()
    with pytest.raises(ValueError, match="unknown role"):
        parse_role("superuser")


def test_require_scope() -> None:
    viewer = _principal("viewer")
    viewer.require(Scope.READ)
    with pytest.raises(PermissionDenied) as info:
        viewer.require(Scope.GENERATE)
    assert info.value.status_code == 403


def test_other_tenant_is_not_found_except_for_platform_admin() -> None:
    admin = _principal("tenant-admin", tenant="ten_a")
    admin.require_tenant("ten_a")
    with pytest.raises(NotFound):
        admin.require_tenant("ten_b")
    _principal("platform-admin", tenant="ten_p").require_tenant("ten_b")


@pytest.mark.parametrize(
    ("granter", "role", "allowed"),
    [
        ("tenant-admin", "member", True),
        ("tenant-admin", "tenant-admin", True),
        ("tenant-admin", "platform-admin", False),
        ("member", "viewer", True),
        ("viewer", "member", False),
        ("platform-admin", "platform-admin", True),
    ],
)
def test_may_grant_only_own_scopes(granter: str, role: str, allowed: bool) -> None:
    assert _principal(granter).may_grant(role) is allowed


def test_model_allow_lists_intersect() -> None:
    assert effective_models(None, None) is None
    assert effective_models(["a", "b"], None) == {"a", "b"}
    assert effective_models(["a", "b"], ["b", "c"]) == {"b"}
    assert effective_models([], ["a"]) == frozenset()
    p = _principal("member", models=frozenset({"a"}))
    assert p.may_use_model("a") and not p.may_use_model("b")
    assert _principal("member").may_use_model("anything")
