"""Tenants (``admin:platform``; a tenant admin may read its own) and their model allow-lists."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway.auth import PLATFORM_TENANT, call_store
from inferflux.gateway.authz import principal_of, requires
from inferflux.gateway.openapi import document
from inferflux.gateway.routes.admin.common import (
    BODY,
    NAME_PATTERN,
    PREFIX,
    TENANT_PREFIX,
    check_models_known,
    ok,
    page_args,
    parse_body,
    record_change,
    record_fields,
    render_page,
    store_of,
    tenant_in_scope,
)
from inferflux.policy.errors import Conflict
from inferflux.policy.rbac import Scope


class TenantCreate(BaseModel):
    model_config = BODY
    name: str = Field(pattern=NAME_PATTERN, description="Lower-case slug, unique")
    display_name: str | None = Field(default=None, max_length=200)
    allowed_models: list[str] | None = Field(default=None, description="Model names this tenant may use; null = all")


class TenantUpdate(BaseModel):
    model_config = BODY
    display_name: str | None = Field(default=None, max_length=200)
    disabled: bool | None = None


class ModelAllowList(BaseModel):
    model_config = BODY
    allowed_models: list[str] | None = Field(description="Model names; null = every model")


def _tenant(record: Any) -> dict[str, Any]:
    return {"object": "tenant", **record_fields(record)}


@document("List tenants", tag="tenants", paginated=True)
@requires(Scope.ADMIN_PLATFORM)
async def list_tenants(request: Request) -> Response:
    limit, after = page_args(request)
    return ok(render_page(await call_store(store_of(request).list_tenants, limit=limit, after=after), _tenant))


@document("Create a tenant", tag="tenants", body=TenantCreate, status=201)
@requires(Scope.ADMIN_PLATFORM)
async def create_tenant(request: Request) -> Response:
    body = await parse_body(request, TenantCreate)
    check_models_known(request, body.allowed_models, "allowed_models")
    principal = principal_of(request)
    tenant = await call_store(
        store_of(request).create_tenant, body.name, display_name=body.display_name, allowed_models=body.allowed_models
    )
    await record_change(request, principal, "tenant.create", tenant.id, "tenant", tenant.id, name=tenant.name)
    return ok(_tenant(tenant), 201)


@document("Get a tenant", tag="tenants")
@requires(Scope.ADMIN_TENANT)
async def get_tenant(request: Request) -> Response:
    _, tenant_id = await tenant_in_scope(request)
    return ok(_tenant(await call_store(store_of(request).get_tenant, tenant_id)))


@document("Update a tenant (display name, disabled)", tag="tenants", body=TenantUpdate)
@requires(Scope.ADMIN_PLATFORM)
async def update_tenant(request: Request) -> Response:
    principal, tenant_id = await tenant_in_scope(request)
    body = await parse_body(request, TenantUpdate)
    changes = body.model_dump(exclude_unset=True)
    tenant = await call_store(store_of(request).get_tenant, tenant_id)
    if changes.get("disabled") and tenant.name == PLATFORM_TENANT:
        raise Conflict("The platform tenant cannot be disabled")
    tenant = await call_store(store_of(request).update_tenant, tenant_id, **changes)
    await record_change(request, principal, "tenant.update", tenant_id, "tenant", tenant_id, **changes)
    return ok(_tenant(tenant))


@document("Delete a tenant and everything in it", tag="tenants", status=204)
@requires(Scope.ADMIN_PLATFORM)
async def delete_tenant(request: Request) -> Response:
    principal, tenant_id = await tenant_in_scope(request)
    tenant = await call_store(store_of(request).get_tenant, tenant_id)
    if tenant.name == PLATFORM_TENANT:
        raise Conflict("The platform tenant cannot be deleted")
    await call_store(store_of(request).delete_tenant, tenant_id)
    await record_change(request, principal, "tenant.delete", None, "tenant", tenant_id, name=tenant.name)
    return Response(status_code=204)


@document("The tenant's model allow-list", tag="tenants")
@requires(Scope.ADMIN_TENANT)
async def get_tenant_models(request: Request) -> Response:
    _, tenant_id = await tenant_in_scope(request)
    tenant = await call_store(store_of(request).get_tenant, tenant_id)
    return ok({"object": "model_allow_list", "tenant_id": tenant_id, "allowed_models": tenant.allowed_models})


@document("Set the tenant's model allow-list", tag="tenants", body=ModelAllowList)
@requires(Scope.ADMIN_PLATFORM)
async def set_tenant_models(request: Request) -> Response:
    principal, tenant_id = await tenant_in_scope(request)
    body = await parse_body(request, ModelAllowList)
    check_models_known(request, body.allowed_models, "allowed_models")
    tenant = await call_store(store_of(request).update_tenant, tenant_id, allowed_models=body.allowed_models)
    await record_change(request, principal, "tenant.models", tenant_id, "tenant", tenant_id,
                        allowed_models=body.allowed_models)  # fmt: skip
    return ok({"object": "model_allow_list", "tenant_id": tenant_id, "allowed_models": tenant.allowed_models})


def routes() -> list[BaseRoute]:
    t = TENANT_PREFIX
    return [
        Route(PREFIX + "/tenants", list_tenants, methods=["GET"]),
        Route(PREFIX + "/tenants", create_tenant, methods=["POST"]),
        Route(t, get_tenant, methods=["GET"]),
        Route(t, update_tenant, methods=["PATCH"]),
        Route(t, delete_tenant, methods=["DELETE"]),
        Route(t + "/models", get_tenant_models, methods=["GET"]),
        Route(t + "/models", set_tenant_models, methods=["PUT"]),
    ]
