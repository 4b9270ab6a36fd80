"""Guardrail policies (kind ``guardrail``, ``policy.guardrails.spec``) at ``/admin/v1/guardrails[/{policy_id}]``.

They need ``admin:tenant``: a tenant admin manages its own tenant's, which
can only make its traffic stricter. The tenant is the caller's by default; a
platform admin may name another with ``tenant_id`` (in the body of a create,
in the query otherwise), or a global policy with ``"tenant_id": null`` /
``?global=true``. Two things are the platform's alone: global policies, and
a remote OPA server (the gateway would otherwise send requests to any
address a tenant admin names).

``sensitive_spec`` (a JSON object, stored encrypted) is write-only: answers
say ``has_sensitive_spec`` instead, and audit events never carry it.
"""

from __future__ import annotations

import hashlib
import json
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
    ok,
    page_args,
    parse_body,
    patch_changes,
    record_change,
    record_fields,
    render_page,
    store_of,
)
from inferflux.policy.errors import NotFound, PermissionDenied, ValidationFailed
from inferflux.policy.guardrails import KIND as GUARDRAIL
from inferflux.policy.guardrails import validate_policy
from inferflux.policy.guardrails.spec import OpaEngine
from inferflux.policy.rbac import Principal, Scope
from inferflux.policy.store import PolicyRecord


class GuardrailCreate(BaseModel):
    model_config = BODY
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
    model_config = BODY
    name: str | None = Field(default=None, min_length=1, max_length=200)
    spec: dict[str, Any] | None = None
    sensitive_spec: dict[str, Any] | None = Field(default=None, description="Write-only; null removes it")
    enabled: bool | None = None


def _guardrail(record: PolicyRecord) -> dict[str, Any]:
    out = {"object": "guardrail_policy", **record_fields(record, hide=("sensitive_spec",))}
    out["has_sensitive_spec"] = record.sensitive_spec is not None
    return out


def _spec_digest(spec: dict[str, Any]) -> str:
    # Guardrail specs can be long (Rego); the audit event names the version by its hash.
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
    await call_store(store_of(request).get_tenant, tenant_id)
    return tenant_id


def _sensitive_text(sensitive: dict[str, Any] | None) -> str | None:
    """``sensitive_spec`` as the store keeps it (a JSON text, encrypted there)."""
    return None if sensitive is None else json.dumps(sensitive, separators=(",", ":"))


def _check_guardrail(principal: Principal, spec: dict[str, Any], sensitive: str | None, name: str) -> None:
    """Check the policy as the resolver will compile it, and that the caller may configure what it uses."""
    parsed = validate_policy(spec, sensitive, name=name)
    if parsed.opa is not None and parsed.opa.engine is OpaEngine.REMOTE and not principal.is_platform_admin:
        raise PermissionDenied(
            "Only platform admins may point a guardrail at a remote OPA server; use engine 'embedded'"
        )


async def _get_guardrail(request: Request, tenant_id: str | None) -> PolicyRecord:
    policy_id = request.path_params["policy_id"]
    record = await call_store(store_of(request).get_policy, tenant_id, policy_id)
    if record.kind != GUARDRAIL:
        raise NotFound(f"No guardrail policy '{policy_id}'")
    return record


@document("List guardrail policies (the caller's tenant; tenant_id or global=true for platform admins)",
          tag="guardrails", paginated=True)  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def list_guardrails(request: Request) -> Response:
    tenant_id = await _guardrail_owner(request, principal_of(request))
    limit, after = page_args(request)
    page = await call_store(store_of(request).list_policies, tenant_id, limit=limit, after=after, kind=GUARDRAIL)
    return ok(render_page(page, _guardrail))


@document("Create a guardrail policy", tag="guardrails", body=GuardrailCreate, status=201)
@requires(Scope.ADMIN_TENANT)
async def create_guardrail(request: Request) -> Response:
    principal = principal_of(request)
    body = await parse_body(request, GuardrailCreate)
    named = body.tenant_id if "tenant_id" in body.model_fields_set else ...
    tenant_id = await _guardrail_owner(request, principal, named)
    sensitive = _sensitive_text(body.sensitive_spec)
    _check_guardrail(principal, body.spec, sensitive, body.name)
    record = await call_store(
        store_of(request).create_policy,
        tenant_id,
        GUARDRAIL,
        body.name,
        body.spec,
        sensitive_spec=sensitive,
        enabled=body.enabled,
    )
    await record_change(request, principal, "guardrail.create", tenant_id, "policy", record.id, name=record.name,
                        spec_sha256=_spec_digest(record.spec), sensitive_spec=sensitive is not None,
                        enabled=record.enabled)  # fmt: skip
    return ok(_guardrail(record), 201)


@document("Get a guardrail policy (sensitive_spec is never returned)", tag="guardrails")
@requires(Scope.ADMIN_TENANT)
async def get_guardrail(request: Request) -> Response:
    tenant_id = await _guardrail_owner(request, principal_of(request))
    return ok(_guardrail(await _get_guardrail(request, tenant_id)))


@document("Update a guardrail policy", tag="guardrails", body=GuardrailUpdate)
@requires(Scope.ADMIN_TENANT)
async def update_guardrail(request: Request) -> Response:
    principal = principal_of(request)
    tenant_id = await _guardrail_owner(request, principal)
    existing = await _get_guardrail(request, tenant_id)
    changes = patch_changes(await parse_body(request, GuardrailUpdate), nullable=("sensitive_spec",))
    # The whole policy as it will be is checked, not just the fields sent.
    if "sensitive_spec" in changes:
        changes["sensitive_spec"] = _sensitive_text(changes["sensitive_spec"])
    sensitive = changes.get("sensitive_spec", existing.sensitive_spec)
    _check_guardrail(principal, changes.get("spec", existing.spec), sensitive, changes.get("name", existing.name))
    record = await call_store(store_of(request).update_policy, tenant_id, existing.id, **changes)
    detail: dict[str, Any] = {"fields": sorted(changes)}
    if "spec" in changes:
        detail["spec_sha256"] = _spec_digest(record.spec)
    await record_change(request, principal, "guardrail.update", tenant_id, "policy", record.id, **detail)
    return ok(_guardrail(record))


@document("Delete a guardrail policy", tag="guardrails", status=204)
@requires(Scope.ADMIN_TENANT)
async def delete_guardrail(request: Request) -> Response:
    principal = principal_of(request)
    tenant_id = await _guardrail_owner(request, principal)
    existing = await _get_guardrail(request, tenant_id)
    await call_store(store_of(request).delete_policy, tenant_id, existing.id)
    await record_change(request, principal, "guardrail.delete", tenant_id, "policy", existing.id, name=existing.name)
    return Response(status_code=204)


def routes() -> list[BaseRoute]:
    g, one = PREFIX + "/guardrails", "/{policy_id}"
    return [
        Route(g, list_guardrails, methods=["GET"]),
        Route(g, create_guardrail, methods=["POST"]),
        Route(g + one, get_guardrail, methods=["GET"]),
        Route(g + one, update_guardrail, methods=["PATCH"]),
        Route(g + one, delete_guardrail, methods=["DELETE"]),
    ]
