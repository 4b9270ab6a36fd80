"""Traffic policies: rate limits, quotas and budgets (kinds ``rate_limit``, ``quota``, ``budget``; ``policy.ratelimit.spec``).

* ``/admin/v1/tenants/{tenant_id}/policies[/{policy_id}]``: a tenant's.
  Reading needs ``admin:tenant`` (one's own tenant; another's answers 404);
  writing needs ``admin:platform``: limits are what the platform grants a
  tenant, so a tenant admin must not be able to raise its own.
* ``/admin/v1/policies[/{policy_id}]``: the global defaults (no tenant),
  ``admin:platform`` only.

A tenant's list holds only its traffic policies (guardrail policies,
``guardrails.py``, share their table in the store); a page may therefore hold
fewer than ``limit`` items before the last one: follow ``next_cursor`` until
it is null.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway.auth import call_store
from inferflux.gateway.authz import principal_of, requires
from inferflux.gateway.openapi import document
from inferflux.gateway.routes.admin.common import (
    BODY,
    PREFIX,
    TENANT_PREFIX,
    ok,
    page_args,
    parse_body,
    patch_changes,
    record_change,
    record_fields,
    store_of,
    tenant_in_scope,
)
from inferflux.policy import ratelimit
from inferflux.policy.errors import NotFound, ValidationFailed
from inferflux.policy.rbac import Principal, Scope
from inferflux.policy.store import PolicyRecord

TRAFFIC_KINDS = ratelimit.KINDS


class TrafficPolicyCreate(BaseModel):
    model_config = BODY
    kind: str = Field(pattern=r"^(rate_limit|quota|budget)$", description="rate_limit | quota | budget")
    name: str = Field(min_length=1, max_length=200)
    spec: dict[str, Any] = Field(description="See policy.ratelimit.spec: limits, scope, principal, per_key")
    enabled: bool = True


class TrafficPolicyUpdate(BaseModel):
    model_config = BODY
    name: str | None = Field(default=None, min_length=1, max_length=200)
    spec: dict[str, Any] | None = None
    enabled: bool | None = None


def _policy(record: PolicyRecord) -> dict[str, Any]:
    return {"object": "policy", **record_fields(record, hide=("sensitive_spec",))}


async def _traffic_owner(request: Request) -> tuple[Principal, str | None]:
    """The path's tenant (checked like every tenant route), or None under /admin/v1/policies."""
    if "tenant_id" in request.path_params:
        return await tenant_in_scope(request)
    return principal_of(request), None


async def _check_principal(request: Request, tenant_id: str | None, policy: ratelimit.LimitPolicy) -> None:
    """A key-scoped policy must name one of the tenant's keys (by id or ``key:<prefix>``) or an OIDC subject."""
    name = policy.principal
    if policy.scope != "key" or name is None or tenant_id is None:
        return
    store = store_of(request)
    if name.startswith("key_"):
        try:
            await call_store(store.get_api_key, tenant_id, name)
            return
        except NotFound:
            pass
    elif name.startswith("key:") and await _has_key_prefix(request, tenant_id, name.removeprefix("key:")):
        return
    elif name.startswith("oidc:") and name.count(":") >= 2 and name.split(":", 2)[2]:
        try:  # the subject itself cannot be checked: it exists only in the identity provider
            await call_store(store.get_oidc_provider, name.split(":", 2)[1])
            return
        except NotFound:
            pass
    raise ValidationFailed(
        "spec.principal must be an API key of this tenant (its id or key:<prefix>) or oidc:<provider id>:<subject>",
        param="spec.principal",
    )


async def _has_key_prefix(request: Request, tenant_id: str, prefix: str) -> bool:
    after = None
    while True:
        page = await call_store(store_of(request).list_api_keys, tenant_id, limit=200, after=after)
        if any(key.prefix == prefix for key in page.items):
            return True
        if page.next_cursor is None:
            return False
        after = page.next_cursor


async def _get_traffic(request: Request, tenant_id: str | None) -> PolicyRecord:
    policy_id = request.path_params["policy_id"]
    record = await call_store(store_of(request).get_policy, tenant_id, policy_id)
    if record.kind not in TRAFFIC_KINDS:  # a guardrail: managed under /admin/v1/guardrails
        raise NotFound(f"No policy '{policy_id}'")
    return record


async def _validated_traffic(request: Request, tenant_id: str | None, kind: str, spec: dict[str, Any]) -> None:
    policy = ratelimit.parse_spec(kind, spec, is_global=tenant_id is None)
    await _check_principal(request, tenant_id, policy)


@document("List traffic policies (rate limits, quotas); pages may be short", tag="policies", paginated=True)
@requires(Scope.ADMIN_TENANT)
async def list_tenant_policies(request: Request) -> Response:
    return await _list_traffic(request)


@document("List global traffic policies; pages may be short", tag="policies", paginated=True)
@requires(Scope.ADMIN_PLATFORM)
async def list_global_policies(request: Request) -> Response:
    return await _list_traffic(request)


async def _list_traffic(request: Request) -> Response:
    _, tenant_id = await _traffic_owner(request)
    limit, after = page_args(request)
    kind = request.query_params.get("kind")
    if kind is not None and kind not in TRAFFIC_KINDS:
        raise ValidationFailed(f"kind must be one of {', '.join(TRAFFIC_KINDS)}", param="kind")
    page = await call_store(store_of(request).list_policies, tenant_id, limit=limit, after=after, kind=kind)
    data = [_policy(record) for record in page.items if record.kind in TRAFFIC_KINDS]
    return ok({"object": "list", "data": data, "next_cursor": page.next_cursor})


@document("Create a traffic policy (platform admins only)", tag="policies", body=TrafficPolicyCreate, status=201)
@requires(Scope.ADMIN_PLATFORM)
async def create_traffic_policy(request: Request) -> Response:
    principal, tenant_id = await _traffic_owner(request)
    body = await parse_body(request, TrafficPolicyCreate)
    await _validated_traffic(request, tenant_id, body.kind, body.spec)
    record = await call_store(
        store_of(request).create_policy, tenant_id, body.kind, body.name, body.spec, enabled=body.enabled
    )
    await record_change(request, principal, "policy.create", tenant_id, "policy", record.id,
                        policy_kind=record.kind, name=record.name, spec=record.spec, enabled=record.enabled)  # fmt: skip
    return ok(_policy(record), 201)


@document("Get a traffic policy", tag="policies")
@requires(Scope.ADMIN_TENANT)
async def get_tenant_policy(request: Request) -> Response:
    _, tenant_id = await _traffic_owner(request)
    return ok(_policy(await _get_traffic(request, tenant_id)))


@document("Get a global traffic policy", tag="policies")
@requires(Scope.ADMIN_PLATFORM)
async def get_global_policy(request: Request) -> Response:
    return ok(_policy(await _get_traffic(request, None)))


@document("Update a traffic policy (platform admins only)", tag="policies", body=TrafficPolicyUpdate)
@requires(Scope.ADMIN_PLATFORM)
async def update_traffic_policy(request: Request) -> Response:
    principal, tenant_id = await _traffic_owner(request)
    existing = await _get_traffic(request, tenant_id)
    changes = patch_changes(await parse_body(request, TrafficPolicyUpdate))
    if "spec" in changes:
        await _validated_traffic(request, tenant_id, existing.kind, changes["spec"])
    record = await call_store(store_of(request).update_policy, tenant_id, existing.id, **changes)
    await record_change(request, principal, "policy.update", tenant_id, "policy", record.id, policy_kind=record.kind,
                        **changes)  # fmt: skip
    return ok(_policy(record))


@document("Delete a traffic policy (platform admins only)", tag="policies", status=204)
@requires(Scope.ADMIN_PLATFORM)
async def delete_traffic_policy(request: Request) -> Response:
    principal, tenant_id = await _traffic_owner(request)
    existing = await _get_traffic(request, tenant_id)
    await call_store(store_of(request).delete_policy, tenant_id, existing.id)
    await record_change(request, principal, "policy.delete", tenant_id, "policy", existing.id,
                        policy_kind=existing.kind, name=existing.name)  # fmt: skip
    return Response(status_code=204)


def routes() -> list[BaseRoute]:
    t, g = TENANT_PREFIX + "/policies", PREFIX + "/policies"
    one = "/{policy_id}"
    return [
        Route(t, list_tenant_policies, methods=["GET"]),
        Route(t, create_traffic_policy, methods=["POST"]),
        Route(t + one, get_tenant_policy, methods=["GET"]),
        Route(t + one, update_traffic_policy, methods=["PATCH"]),
        Route(t + one, delete_traffic_policy, methods=["DELETE"]),
        Route(g, list_global_policies, methods=["GET"]),
        Route(g, create_traffic_policy, methods=["POST"]),
        Route(g + one, get_global_policy, methods=["GET"]),
        Route(g + one, update_traffic_policy, methods=["PATCH"]),
        Route(g + one, delete_traffic_policy, methods=["DELETE"]),
    ]
