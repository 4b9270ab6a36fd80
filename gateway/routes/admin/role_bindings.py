"""A tenant's role bindings (``admin:tenant``): a role for an OIDC subject or group of one of its providers."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway.auth import call_store
from inferflux.gateway.authz import requires
from inferflux.gateway.openapi import document
from inferflux.gateway.routes.admin.common import (
    BODY,
    TENANT_PREFIX,
    check_role,
    ok,
    page_args,
    parse_body,
    record_change,
    record_fields,
    render_page,
    store_of,
    tenant_in_scope,
)
from inferflux.policy.errors import PermissionDenied
from inferflux.policy.rbac import Scope


class RoleBindingCreate(BaseModel):
    model_config = BODY
    provider_id: str = Field(min_length=1)
    kind: str = Field(pattern=r"^(subject|group)$")
    subject: str = Field(min_length=1, max_length=512, description="The OIDC 'sub', or a group name")
    role: str

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        return check_role(value)


def _binding(record: Any) -> dict[str, Any]:
    return {"object": "role_binding", **record_fields(record)}


@document("List a tenant's role bindings for OIDC subjects and groups", tag="role-bindings", paginated=True)
@requires(Scope.ADMIN_TENANT)
async def list_bindings(request: Request) -> Response:
    _, tenant_id = await tenant_in_scope(request)
    limit, after = page_args(request)
    page = await call_store(store_of(request).list_role_bindings, tenant_id, limit=limit, after=after)
    return ok(render_page(page, _binding))


@document("Bind a role to an OIDC subject or group", tag="role-bindings", body=RoleBindingCreate, status=201)
@requires(Scope.ADMIN_TENANT)
async def create_binding(request: Request) -> Response:
    principal, tenant_id = await tenant_in_scope(request)
    body = await parse_body(request, RoleBindingCreate)
    if not principal.may_grant(body.role):
        raise PermissionDenied(f"You cannot grant role '{body.role}', which has scopes you lack")
    # The store refuses platform-admin outside the platform tenant, and a provider that may not
    # sign users into this tenant exactly as a missing one.
    record = await call_store(
        store_of(request).create_role_binding,
        tenant_id,
        provider_id=body.provider_id,
        kind=body.kind,
        subject=body.subject,
        role=body.role,
    )
    await record_change(request, principal, "role_binding.create", tenant_id, "role_binding", record.id,
                        role=body.role)  # fmt: skip
    return ok(_binding(record), 201)


@document("Get a role binding", tag="role-bindings")
@requires(Scope.ADMIN_TENANT)
async def get_binding(request: Request) -> Response:
    _, tenant_id = await tenant_in_scope(request)
    return ok(_binding(await call_store(store_of(request).get_role_binding, tenant_id, request.path_params["binding_id"])))


@document("Delete a role binding", tag="role-bindings", status=204)
@requires(Scope.ADMIN_TENANT)
async def delete_binding(request: Request) -> Response:
    principal, tenant_id = await tenant_in_scope(request)
    binding_id = request.path_params["binding_id"]
    binding = await call_store(store_of(request).get_role_binding, tenant_id, binding_id)
    if not principal.may_grant(binding.role):
        raise PermissionDenied(f"You cannot remove a binding of role '{binding.role}', which has scopes you lack")
    await call_store(store_of(request).delete_role_binding, tenant_id, binding_id)
    await record_change(request, principal, "role_binding.delete", tenant_id, "role_binding", binding_id)
    return Response(status_code=204)


def routes() -> list[BaseRoute]:
    b = TENANT_PREFIX + "/role-bindings"
    return [
        Route(b, list_bindings, methods=["GET"]),
        Route(b, create_binding, methods=["POST"]),
        Route(b + "/{binding_id}", get_binding, methods=["GET"]),
        Route(b + "/{binding_id}", delete_binding, methods=["DELETE"]),
    ]
