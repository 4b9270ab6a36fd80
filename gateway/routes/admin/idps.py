"""OIDC identity providers (``admin:tenant``): a tenant admin's own tenant's; platform admins' every one.

A platform admin alone registers platform-owned providers (``tenant_id``
absent or null), with the tenants they may sign users into. A provider's
owner never changes; its settings are checked as the verifier will read them
when written, not at the first login.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway.auth import call_store
from inferflux.gateway.authz import principal_of, requires
from inferflux.gateway.openapi import document
from inferflux.gateway.routes.admin.common import (
    BODY,
    NAME_PATTERN,
    PREFIX,
    check_role,
    ok,
    page_args,
    parse_body,
    record_change,
    record_fields,
    render_page,
    store_of,
)
from inferflux.policy.authn.oidc import OidcProviderConfig
from inferflux.policy.errors import ValidationFailed
from inferflux.policy.rbac import Principal, Scope
from inferflux.policy.store import UNSET
from inferflux.policy.store.repository import OwnerFilter


class OidcProviderCreate(BaseModel):
    model_config = BODY
    tenant_id: str | None = Field(
        default=None,
        max_length=64,
        description="The owning tenant: absent for a tenant admin's own; platform admins: absent or null "
        "for a platform-owned provider",
    )
    tenant_ids: list[str] = Field(
        default_factory=list, description="Platform-owned only: the tenant ids it may sign users into"
    )
    allow_platform: bool = Field(
        default=False, description="Platform-owned only: may sign users into the platform tenant, platform-admin too"
    )
    name: str = Field(pattern=NAME_PATTERN)
    issuer: str = Field(min_length=1, max_length=2048)
    audience: str = Field(min_length=1, max_length=2048)
    client_id: str | None = None
    client_secret: str | None = Field(default=None, description="Write-only; stored encrypted")
    jwks_uri: str | None = None
    algorithms: list[str] = Field(default_factory=lambda: ["RS256", "ES256", "EdDSA"])
    tenant_claim: str = "tenant"
    roles_claim: str = "roles"
    role_map: dict[str, str] = Field(default_factory=dict, description="Claim value -> role")
    required_claims: list[str] = Field(default_factory=list)
    leeway_seconds: int = Field(default=30, ge=0, le=300)
    enabled: bool = True

    @field_validator("role_map")
    @classmethod
    def _roles(cls, value: dict[str, str]) -> dict[str, str]:
        for role in value.values():
            check_role(role)
        return value


class OidcProviderUpdate(BaseModel):
    model_config = BODY
    tenant_ids: list[str] | None = Field(default=None, description="Platform-owned only")
    allow_platform: bool | None = Field(default=None, description="Platform-owned only")
    audience: str | None = Field(default=None, min_length=1)
    client_id: str | None = None
    client_secret: str | None = None
    jwks_uri: str | None = None
    algorithms: list[str] | None = None
    tenant_claim: str | None = None
    roles_claim: str | None = None
    role_map: dict[str, str] | None = None
    required_claims: list[str] | None = None
    leeway_seconds: int | None = Field(default=None, ge=0, le=300)
    enabled: bool | None = None


def _provider(record: Any) -> dict[str, Any]:
    out = {"object": "oidc_provider", **record_fields(record, hide=("client_secret",))}
    out["has_client_secret"] = bool(getattr(record, "client_secret", None))
    return out


def _check_provider(body: OidcProviderCreate | OidcProviderUpdate, issuer: str, existing: Any = None) -> None:
    """Reject settings the verifier would refuse, at write time rather than on first login."""
    # A new provider is checked with its defaults; an update, merged over what is stored.
    stored = record_fields(existing) if existing is not None else {}
    merged = {**stored, **body.model_dump(exclude_unset=existing is not None)}
    try:
        OidcProviderConfig(
            id="check",
            name=merged.get("name", "check"),
            issuer=issuer,
            audience=merged["audience"],
            algorithms=tuple(merged.get("algorithms") or ()),
            role_map=dict(merged.get("role_map") or {}),
            jwks_uri=merged.get("jwks_uri"),
        )
    except ValueError as exc:
        raise ValidationFailed(str(exc)) from None
    for role in (merged.get("role_map") or {}).values():
        try:
            check_role(role)
        except ValueError as exc:
            raise ValidationFailed(str(exc), param="role_map") from None


def _provider_owner(principal: Principal) -> OwnerFilter:
    """Whose providers a caller may see and change: a tenant admin its tenant's, a platform admin all."""
    return UNSET if principal.is_platform_admin else principal.tenant_id


async def _new_provider_owner(request: Request, principal: Principal, body: OidcProviderCreate) -> str | None:
    """The owner of a new provider: a tenant admin's own tenant (another: 404); for a platform admin
    the tenant it names, or the platform (None) when it names none."""
    named = body.tenant_id if "tenant_id" in body.model_fields_set else None
    if principal.is_platform_admin:
        if named is not None:
            await call_store(store_of(request).get_tenant, named)  # 404 for a missing one
        return named
    if "tenant_id" in body.model_fields_set and named is None:
        principal.require(Scope.ADMIN_PLATFORM)  # a platform-owned provider is the platform's to make
    owner = named or principal.tenant_id
    principal.require_tenant(owner)
    return owner


@document("List OIDC identity providers (a tenant admin's own tenant's; every one for platform admins)",
          tag="oidc", paginated=True)  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def list_providers(request: Request) -> Response:
    limit, after = page_args(request)
    owner = _provider_owner(principal_of(request))
    page = await call_store(store_of(request).list_oidc_providers, limit=limit, after=after, owner=owner)
    return ok(render_page(page, _provider))


@document("Register an OIDC identity provider (a tenant's, or platform-owned)", tag="oidc",
          body=OidcProviderCreate, status=201)  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def create_provider(request: Request) -> Response:
    principal = principal_of(request)
    body = await parse_body(request, OidcProviderCreate)
    owner = await _new_provider_owner(request, principal, body)
    _check_provider(body, body.issuer)
    record = await call_store(
        store_of(request).create_oidc_provider, tenant_id=owner, **body.model_dump(exclude={"tenant_id"})
    )
    await record_change(request, principal, "oidc_provider.create", owner, "oidc_provider", record.id,
                        issuer=body.issuer, tenant_ids=record.tenant_ids,
                        allow_platform=record.allow_platform)  # fmt: skip
    return ok(_provider(record), 201)


@document("Get an OIDC identity provider", tag="oidc")
@requires(Scope.ADMIN_TENANT)
async def get_provider(request: Request) -> Response:
    owner = _provider_owner(principal_of(request))
    record = await call_store(store_of(request).get_oidc_provider, request.path_params["provider_id"], owner=owner)
    return ok(_provider(record))


@document("Update an OIDC identity provider (its owner never changes)", tag="oidc", body=OidcProviderUpdate)
@requires(Scope.ADMIN_TENANT)
async def update_provider(request: Request) -> Response:
    principal = principal_of(request)
    provider_id, owner = request.path_params["provider_id"], _provider_owner(principal)
    existing = await call_store(store_of(request).get_oidc_provider, provider_id, owner=owner)
    body = await parse_body(request, OidcProviderUpdate)
    _check_provider(body, existing.issuer, existing)
    changes = body.model_dump(exclude_unset=True)
    record = await call_store(store_of(request).update_oidc_provider, provider_id, owner=owner, **changes)
    await record_change(request, principal, "oidc_provider.update", record.tenant_id, "oidc_provider", provider_id,
                        fields=sorted(changes))  # fmt: skip
    return ok(_provider(record))


@document("Delete an OIDC identity provider and its role bindings", tag="oidc", status=204)
@requires(Scope.ADMIN_TENANT)
async def delete_provider(request: Request) -> Response:
    principal = principal_of(request)
    provider_id, owner = request.path_params["provider_id"], _provider_owner(principal)
    existing = await call_store(store_of(request).get_oidc_provider, provider_id, owner=owner)
    await call_store(store_of(request).delete_oidc_provider, provider_id, owner=owner)
    await record_change(request, principal, "oidc_provider.delete", existing.tenant_id, "oidc_provider", provider_id)
    return Response(status_code=204)


def routes() -> list[BaseRoute]:
    p = PREFIX + "/oidc-providers"
    return [
        Route(p, list_providers, methods=["GET"]),
        Route(p, create_provider, methods=["POST"]),
        Route(p + "/{provider_id}", get_provider, methods=["GET"]),
        Route(p + "/{provider_id}", update_provider, methods=["PATCH"]),
        Route(p + "/{provider_id}", delete_provider, methods=["DELETE"]),
    ]
