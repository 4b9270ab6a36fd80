"""A tenant's API keys (``admin:tenant``): no one creates, rotates or revokes a key with scopes they lack."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel, Field, field_validator
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway.auth import PLATFORM_TENANT, call_store
from inferflux.gateway.authz import requires
from inferflux.gateway.openapi import document
from inferflux.gateway.routes.admin.common import (
    BODY,
    TENANT_PREFIX,
    NoBody,
    check_models_known,
    check_role,
    ok,
    page_args,
    parse_body,
    parse_optional_body,
    record_change,
    record_fields,
    render_page,
    store_of,
    tenant_in_scope,
)
from inferflux.policy.errors import PermissionDenied, ValidationFailed
from inferflux.policy.rbac import Scope


class KeyCreate(BaseModel):
    model_config = BODY
    name: str = Field(min_length=1, max_length=200)
    role: str = Field(description="platform-admin | tenant-admin | member | viewer")
    allowed_models: list[str] | None = Field(default=None, description="Further restricts the tenant's list")
    expires_in_seconds: int | None = Field(default=None, ge=60, le=10 * 365 * 86400)

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        return check_role(value)


class KeyRotate(BaseModel):
    model_config = BODY
    grace_seconds: int = Field(default=3600, ge=0, le=30 * 86400, description="How long the old key keeps working")


def _key(record: Any) -> dict[str, Any]:
    return {"object": "api_key", **record_fields(record, hide=("key_hash",))}


@document("List a tenant's API keys (prefixes only)", tag="keys", paginated=True)
@requires(Scope.ADMIN_TENANT)
async def list_keys(request: Request) -> Response:
    _, tenant_id = await tenant_in_scope(request)
    limit, after = page_args(request)
    return ok(render_page(await call_store(store_of(request).list_api_keys, tenant_id, limit=limit, after=after), _key))


@document("Create an API key; the key itself is in the response, once", tag="keys", body=KeyCreate, status=201)
@requires(Scope.ADMIN_TENANT)
async def create_key(request: Request) -> Response:
    principal, tenant_id = await tenant_in_scope(request)
    body = await parse_body(request, KeyCreate)
    if not principal.may_grant(body.role):
        raise PermissionDenied(f"You cannot create a key with role '{body.role}', which has scopes you lack")
    tenant = await call_store(store_of(request).get_tenant, tenant_id)
    if body.role == "platform-admin" and tenant.name != PLATFORM_TENANT:
        raise ValidationFailed("platform-admin keys exist only in the platform tenant", param="role")
    check_models_known(request, body.allowed_models, "allowed_models", tenant.allowed_models)
    expires = datetime.now(UTC) + timedelta(seconds=body.expires_in_seconds) if body.expires_in_seconds else None
    record, token = await call_store(
        store_of(request).create_api_key,
        tenant_id,
        name=body.name,
        role=body.role,
        allowed_models=body.allowed_models,
        expires_at=expires,
        created_by=principal.subject,
    )
    await record_change(request, principal, "key.create", tenant_id, "api_key", record.id, prefix=record.prefix,
                        role=body.role)  # fmt: skip
    return ok({**_key(record), "key": token}, 201)


@document("Get an API key", tag="keys")
@requires(Scope.ADMIN_TENANT)
async def get_key(request: Request) -> Response:
    _, tenant_id = await tenant_in_scope(request)
    return ok(_key(await call_store(store_of(request).get_api_key, tenant_id, request.path_params["key_id"])))


@document("Revoke an API key (effective on every replica within seconds)", tag="keys", body=NoBody,
          body_required=False)  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def revoke_key(request: Request) -> Response:
    principal, tenant_id = await tenant_in_scope(request)
    await parse_optional_body(request, NoBody)
    key_id = request.path_params["key_id"]
    existing = await call_store(store_of(request).get_api_key, tenant_id, key_id)
    # As for rotation: a tenant admin of the platform tenant must not be able
    # to lock the platform admins out by revoking their keys.
    if not principal.may_grant(existing.role):
        raise PermissionDenied(f"You cannot revoke a key with role '{existing.role}', which has scopes you lack")
    record = await call_store(store_of(request).revoke_api_key, tenant_id, key_id)
    await record_change(request, principal, "key.revoke", tenant_id, "api_key", key_id, prefix=record.prefix)
    return ok(_key(record))


@document("Rotate an API key: a new key now, with the old one's expiry; the old one expires after a grace period",
          tag="keys", body=KeyRotate, body_required=False, status=201)  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def rotate_key(request: Request) -> Response:
    principal, tenant_id = await tenant_in_scope(request)
    body = await parse_optional_body(request, KeyRotate)
    key_id = request.path_params["key_id"]
    old = await call_store(store_of(request).get_api_key, tenant_id, key_id)
    if not principal.may_grant(old.role):
        raise PermissionDenied(f"You cannot rotate a key with role '{old.role}', which has scopes you lack")
    record, token = await call_store(
        store_of(request).rotate_api_key,
        tenant_id,
        key_id,
        grace_seconds=body.grace_seconds,
        created_by=principal.subject,
    )
    await record_change(request, principal, "key.rotate", tenant_id, "api_key", key_id, new_key=record.id,
                        grace=body.grace_seconds)  # fmt: skip
    return ok({**_key(record), "key": token, "replaces": key_id}, 201)


def routes() -> list[BaseRoute]:
    k = TENANT_PREFIX + "/keys"
    return [
        Route(k, list_keys, methods=["GET"]),
        Route(k, create_key, methods=["POST"]),
        Route(k + "/{key_id}", get_key, methods=["GET"]),
        Route(k + "/{key_id}/revoke", revoke_key, methods=["POST"]),
        Route(k + "/{key_id}/rotate", rotate_key, methods=["POST"]),
    ]
