"""Admin REST for traffic policies (rate limits, quotas) and guardrail policies.

Traffic policies (kinds ``rate_limit`` and ``quota``, ``policy.ratelimit.spec``):

* ``/admin/v1/tenants/{tenant_id}/policies[/{policy_id}]``: a tenant's.
  Reading needs ``admin:tenant`` (one's own tenant; another's answers 404);
  writing needs ``admin:platform``: limits are what the platform grants a
  tenant, so a tenant admin must not be able to raise its own.
* ``/admin/v1/policies[/{policy_id}]``: the global defaults (no tenant),
  ``admin:platform`` only.

A tenant's list holds only its traffic policies; a page may therefore hold
fewer than ``limit`` items before the last one: follow ``next_cursor`` until
it is null.

Guardrail policies (kind ``guardrail``, ``policy.guardrails.spec``) live at
``/admin/v1/guardrails[/{policy_id}]`` with ``admin:tenant``: a tenant admin
manages its own tenant's, which can only make its traffic stricter. The
tenant is the caller's by default; a platform admin may name another with
``tenant_id`` (in the body of a create, in the query otherwise), or a global
policy with ``"tenant_id": null`` / ``?global=true``. Two things are the
platform's alone: global policies, and a remote OPA server (the gateway
would otherwise send requests to any address a tenant admin names).

``sensitive_spec`` (a JSON object, stored encrypted) is write-only: answers
say ``has_sensitive_spec`` instead, and audit events never carry it.

Every change is effective on this replica at once (``admin._audit`` drops the
resolvers' caches) and on the others within their poll interval.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.auth import call_store
from gateway.authz import principal_of, requires
from gateway.openapi import document
from gateway.routes.admin import (
    _BODY,
    PREFIX,
    _audit,
    _body,
    _ok,
    _page,
    _page_args,
    _record,
    _store,
    _tenant_in_scope,
)
from policy import guardrails, ratelimit
from policy.errors import NotFound, PermissionDenied, ValidationFailed
from policy.rbac import Principal, Scope
from policy.store import PolicyRecord

TRAFFIC_KINDS = ratelimit.KINDS
GUARDRAIL = guardrails.KIND


# -- request bodies ----------------------------------------------------------------


class TrafficPolicyCreate(BaseModel):
    model_config = _BODY
    kind: str = Field(pattern=r"^(rate_limit|quota)$", description="rate_limit | quota")
    name: str = Field(min_length=1, max_length=200)
    spec: dict[str, Any] = Field(description="See policy.ratelimit.spec: limits, scope, principal, per_key")
    enabled: bool = True


class TrafficPolicyUpdate(BaseModel):
    model_config = _BODY
    name: str | None = Field(default=None, min_length=1, max_length=200)
    spec: dict[str, Any] | None = None
    enabled: bool | None = None


class GuardrailCreate(BaseModel):
    model_config = _BODY
    tenant_id: str | None = Field(
        default=None,
        max_length=64,
        description="Platform admins: the tenant (absent: the caller's; null: a global policy)",
    )
    name: str = Field(min_length=1, max_length=200)
    spec: dict[str, Any] = Field(description="See policy.guardrails.spec: direction, blocklist, pii, opa, decode")
    sensitive_spec: dict[str, Any] | None = Field(
        default=None, description="Write-only, stored encrypted: confidential blocklist rules, opa_token"
    )
    enabled: bool = True


class GuardrailUpdate(BaseModel):
    model_config = _BODY
    name: str | None = Field(default=None, min_length=1, max_length=200)
    spec: dict[str, Any] | None = None
    sensitive_spec: dict[str, Any] | None = Field(default=None, description="Write-only; null removes it")
    enabled: bool | None = None


# -- plumbing ----------------------------------------------------------------------


def _changes(body: BaseModel, nullable: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields a PATCH sets; null only where it means something (removing a sensitive_spec)."""
    changes = body.model_dump(exclude_unset=True)
    for name, value in changes.items():
        if value is None and name not in nullable:
            raise ValidationFailed(f"{name}: may not be null", param=name)
    return changes


def _policy(record: PolicyRecord) -> dict[str, Any]:
    out = {"object": "guardrail_policy" if record.kind == GUARDRAIL else "policy"}
    out.update(_record(record, hide=("sensitive_spec",)))
    if record.kind == GUARDRAIL:
        out["has_sensitive_spec"] = record.sensitive_spec is not None
    return out


def _spec_digest(spec: dict[str, Any]) -> str:
    # Guardrail specs can be long (Rego); the audit event names the version by its hash.
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# -- traffic policies ------------------------------------------------------------------


async def _traffic_owner(request: Request) -> tuple[Principal, str | None]:
    """The path's tenant (checked like every tenant route), or None under /admin/v1/policies."""
    if "tenant_id" in request.path_params:
        return await _tenant_in_scope(request)
    return principal_of(request), None


async def _check_principal(request: Request, tenant_id: str | None, policy: ratelimit.LimitPolicy) -> None:
    """A key-scoped policy must name one of the tenant's keys (by id or ``key:<prefix>``) or an OIDC subject."""
    name = policy.principal
    if policy.scope != "key" or name is None or tenant_id is None:
        return
    store = _store(request)
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
        page = await call_store(_store(request).list_api_keys, tenant_id, limit=200, after=after)
        if any(key.prefix == prefix for key in page.items):
            return True
        if page.next_cursor is None:
            return False
        after = page.next_cursor


async def _get_traffic(request: Request, tenant_id: str | None) -> PolicyRecord:
    policy_id = request.path_params["policy_id"]
    record = await call_store(_store(request).get_policy, tenant_id, policy_id)
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
    limit, after = _page_args(request)
    kind = request.query_params.get("kind")
    if kind is not None and kind not in TRAFFIC_KINDS:
        raise ValidationFailed(f"kind must be one of {', '.join(TRAFFIC_KINDS)}", param="kind")
    page = await call_store(_store(request).list_policies, tenant_id, limit=limit, after=after, kind=kind)
    data = [_policy(record) for record in page.items if record.kind in TRAFFIC_KINDS]
    return _ok({"object": "list", "data": data, "next_cursor": page.next_cursor})


@document("Create a traffic policy (platform admins only)", tag="policies", body=TrafficPolicyCreate, status=201)
@requires(Scope.ADMIN_PLATFORM)
async def create_traffic_policy(request: Request) -> Response:
    principal, tenant_id = await _traffic_owner(request)
    body = await _body(request, TrafficPolicyCreate)
    await _validated_traffic(request, tenant_id, body.kind, body.spec)
    record = await call_store(
        _store(request).create_policy, tenant_id, body.kind, body.name, body.spec, enabled=body.enabled
    )
    await _audit(request, principal, "policy.create", tenant_id, "policy", record.id,
                 policy_kind=record.kind, name=record.name, spec=record.spec, enabled=record.enabled)  # fmt: skip
    return _ok(_policy(record), 201)


@document("Get a traffic policy", tag="policies")
@requires(Scope.ADMIN_TENANT)
async def get_tenant_policy(request: Request) -> Response:
    _, tenant_id = await _traffic_owner(request)
    return _ok(_policy(await _get_traffic(request, tenant_id)))


@document("Get a global traffic policy", tag="policies")
@requires(Scope.ADMIN_PLATFORM)
async def get_global_policy(request: Request) -> Response:
    return _ok(_policy(await _get_traffic(request, None)))


@document("Update a traffic policy (platform admins only)", tag="policies", body=TrafficPolicyUpdate)
@requires(Scope.ADMIN_PLATFORM)
async def update_traffic_policy(request: Request) -> Response:
    principal, tenant_id = await _traffic_owner(request)
    existing = await _get_traffic(request, tenant_id)
    changes = _changes(await _body(request, TrafficPolicyUpdate))
    if "spec" in changes:
        await _validated_traffic(request, tenant_id, existing.kind, changes["spec"])
    record = await call_store(_store(request).update_policy, tenant_id, existing.id, **changes)
    await _audit(request, principal, "policy.update", tenant_id, "policy", record.id, policy_kind=record.kind,
                 **changes)  # fmt: skip
    return _ok(_policy(record))


@document("Delete a traffic policy (platform admins only)", tag="policies", status=204)
@requires(Scope.ADMIN_PLATFORM)
async def delete_traffic_policy(request: Request) -> Response:
    principal, tenant_id = await _traffic_owner(request)
    existing = await _get_traffic(request, tenant_id)
    await call_store(_store(request).delete_policy, tenant_id, existing.id)
    await _audit(request, principal, "policy.delete", tenant_id, "policy", existing.id,
                 policy_kind=existing.kind, name=existing.name)  # fmt: skip
    return Response(status_code=204)


# -- guardrail policies ------------------------------------------------------------------------


async def _guardrail_owner(request: Request, principal: Principal, body_tenant: object = ...) -> str | None:
    """Whose guardrails: the caller's tenant unless told otherwise; None for the global ones.

    ``body_tenant`` is a create body's ``tenant_id`` (``...``: absent); other
    requests name the tenant in the query (``tenant_id``, or ``global=true``).
    """
    if body_tenant is ...:
        query = request.query_params
        scope_global = query.get("global", "false")
        if scope_global not in ("true", "false"):
            raise ValidationFailed("global must be true or false", param="global")
        if scope_global == "true":
            if "tenant_id" in query:
                raise ValidationFailed("give tenant_id or global=true, not both", param="global")
            body_tenant = None
        else:
            body_tenant = query.get("tenant_id") or principal.tenant_id
    if body_tenant is None:
        principal.require(Scope.ADMIN_PLATFORM)  # global policies bind every tenant
        return None
    tenant_id = str(body_tenant)
    principal.require_tenant(tenant_id)  # another tenant: 404
    await call_store(_store(request).get_tenant, tenant_id)
    return tenant_id


def _sensitive_text(sensitive: dict[str, Any] | None) -> str | None:
    """``sensitive_spec`` as the store keeps it (a JSON text, encrypted there)."""
    return None if sensitive is None else json.dumps(sensitive, separators=(",", ":"))


def _check_guardrail(principal: Principal, spec: dict[str, Any], sensitive: str | None, name: str) -> None:
    """Check the policy as the resolver will compile it, and that the caller may configure what it uses."""
    parsed = guardrails.validate_policy(spec, sensitive, name=name)
    if parsed.opa is not None and parsed.opa.engine == "remote" and not principal.is_platform_admin:
        raise PermissionDenied(
            "Only platform admins may point a guardrail at a remote OPA server; use engine 'embedded'"
        )


async def _get_guardrail(request: Request, tenant_id: str | None) -> PolicyRecord:
    policy_id = request.path_params["policy_id"]
    record = await call_store(_store(request).get_policy, tenant_id, policy_id)
    if record.kind != GUARDRAIL:
        raise NotFound(f"No guardrail policy '{policy_id}'")
    return record


@document("List guardrail policies (the caller's tenant; tenant_id or global=true for platform admins)",
          tag="guardrails", paginated=True)  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def list_guardrails(request: Request) -> Response:
    tenant_id = await _guardrail_owner(request, principal_of(request))
    limit, after = _page_args(request)
    page = await call_store(_store(request).list_policies, tenant_id, limit=limit, after=after, kind=GUARDRAIL)
    return _ok(_page(page, _policy))


@document("Create a guardrail policy", tag="guardrails", body=GuardrailCreate, status=201)
@requires(Scope.ADMIN_TENANT)
async def create_guardrail(request: Request) -> Response:
    principal = principal_of(request)
    body = await _body(request, GuardrailCreate)
    named = body.tenant_id if "tenant_id" in body.model_fields_set else ...
    tenant_id = await _guardrail_owner(request, principal, named)
    sensitive = _sensitive_text(body.sensitive_spec)
    _check_guardrail(principal, body.spec, sensitive, body.name)
    record = await call_store(
        _store(request).create_policy,
        tenant_id,
        GUARDRAIL,
        body.name,
        body.spec,
        sensitive_spec=sensitive,
        enabled=body.enabled,
    )
    await _audit(request, principal, "guardrail.create", tenant_id, "policy", record.id, name=record.name,
                 spec_sha256=_spec_digest(record.spec), sensitive_spec=sensitive is not None,
                 enabled=record.enabled)  # fmt: skip
    return _ok(_policy(record), 201)


@document("Get a guardrail policy (sensitive_spec is never returned)", tag="guardrails")
@requires(Scope.ADMIN_TENANT)
async def get_guardrail(request: Request) -> Response:
    tenant_id = await _guardrail_owner(request, principal_of(request))
    return _ok(_policy(await _get_guardrail(request, tenant_id)))


@document("Update a guardrail policy", tag="guardrails", body=GuardrailUpdate)
@requires(Scope.ADMIN_TENANT)
async def update_guardrail(request: Request) -> Response:
    principal = principal_of(request)
    tenant_id = await _guardrail_owner(request, principal)
    existing = await _get_guardrail(request, tenant_id)
    changes = _changes(await _body(request, GuardrailUpdate), nullable=("sensitive_spec",))
    # The whole policy as it will be is checked, not just the fields sent.
    if "sensitive_spec" in changes:
        changes["sensitive_spec"] = _sensitive_text(changes["sensitive_spec"])
    sensitive = changes.get("sensitive_spec", existing.sensitive_spec)
    _check_guardrail(principal, changes.get("spec", existing.spec), sensitive, changes.get("name", existing.name))
    record = await call_store(_store(request).update_policy, tenant_id, existing.id, **changes)
    detail: dict[str, Any] = {"fields": sorted(changes)}
    if "spec" in changes:
        detail["spec_sha256"] = _spec_digest(record.spec)
    await _audit(request, principal, "guardrail.update", tenant_id, "policy", record.id, **detail)
    return _ok(_policy(record))


@document("Delete a guardrail policy", tag="guardrails", status=204)
@requires(Scope.ADMIN_TENANT)
async def delete_guardrail(request: Request) -> Response:
    principal = principal_of(request)
    tenant_id = await _guardrail_owner(request, principal)
    existing = await _get_guardrail(request, tenant_id)
    await call_store(_store(request).delete_policy, tenant_id, existing.id)
    await _audit(request, principal, "guardrail.delete", tenant_id, "policy", existing.id, name=existing.name)
    return Response(status_code=204)


def routes(tenant_prefix: str) -> list[BaseRoute]:
    t, g = tenant_prefix + "/policies", PREFIX + "/policies"
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
        Route(PREFIX + "/guardrails", list_guardrails, methods=["GET"]),
        Route(PREFIX + "/guardrails", create_guardrail, methods=["POST"]),
        Route(PREFIX + "/guardrails" + one, get_guardrail, methods=["GET"]),
        Route(PREFIX + "/guardrails" + one, update_guardrail, methods=["PATCH"]),
        Route(PREFIX + "/guardrails" + one, delete_guardrail, methods=["DELETE"]),
    ]
