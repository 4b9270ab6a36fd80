"""The admin REST API under ``/admin/v1``.

Scopes: ``admin:platform`` for tenants and models; ``admin:tenant`` for
what lives inside one tenant (keys, role bindings, its identity providers,
its model allow-list, its audit log). A tenant admin naming another tenant,
or an object of another tenant, gets 404: the answer never tells whether it
exists; a platform-only route answers it as a route that does not exist
(``gateway.authz``).

Every change is recorded as an admin event on the tamper-evident audit trail
(``policy.audit``), durable before the response is sent. Lists are paginated
with ``limit`` (1-200, default 50) and the opaque ``after`` cursor of the
previous page's ``next_cursor``.

Traffic and guardrail policies are in ``admin_policies``, the audit log and
its live tail in ``admin_audit``; ``routes()`` here serves them all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.auth import PLATFORM_TENANT, call_store
from gateway.authz import principal_of, requires
from gateway.context import get_context
from gateway.metrics import route_template
from gateway.openapi import document
from gateway.jsonbody import decode_json_body
from policy.audit.errors import AuditUnavailable
from policy.audit.events import admin_event
from policy.errors import Conflict, NotFound, PermissionDenied, ValidationFailed
from policy.ratelimit import PolicyResolver
from policy.rbac import ROLE_NAMES, Principal, Scope
from policy.store import UNSET, PolicyStore
from policy.store.repository import OwnerFilter

M = TypeVar("M", bound=BaseModel)

log = logging.getLogger("inferflux.gateway.admin")

PREFIX = "/admin/v1"
_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
_MAX_LIST = 200
_LIMIT_PATTERN = re.compile(r"[0-9]{1,4}")


# -- request bodies ----------------------------------------------------------

_BODY = ConfigDict(extra="forbid", strict=True)


def _check_role(value: str) -> str:
    if value not in ROLE_NAMES:
        raise ValueError(f"unknown role {value!r}; roles are {', '.join(ROLE_NAMES)}")
    return value


class TenantCreate(BaseModel):
    model_config = _BODY
    name: str = Field(pattern=_NAME_PATTERN, description="Lower-case slug, unique")
    display_name: str | None = Field(default=None, max_length=200)
    allowed_models: list[str] | None = Field(default=None, description="Model names this tenant may use; null = all")


class TenantUpdate(BaseModel):
    model_config = _BODY
    display_name: str | None = Field(default=None, max_length=200)
    disabled: bool | None = None


class ModelAllowList(BaseModel):
    model_config = _BODY
    allowed_models: list[str] | None = Field(description="Model names; null = every model")


class KeyCreate(BaseModel):
    model_config = _BODY
    name: str = Field(min_length=1, max_length=200)
    role: str = Field(description="platform-admin | tenant-admin | member | viewer")
    allowed_models: list[str] | None = Field(default=None, description="Further restricts the tenant's list")
    expires_in_seconds: int | None = Field(default=None, ge=60, le=10 * 365 * 86400)

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        return _check_role(value)


class NoBody(BaseModel):
    """The body of an action that takes no fields: none, or ``{}``."""

    model_config = _BODY


class KeyRotate(BaseModel):
    model_config = _BODY
    grace_seconds: int = Field(default=3600, ge=0, le=30 * 86400, description="How long the old key keeps working")


class RoleBindingCreate(BaseModel):
    model_config = _BODY
    provider_id: str = Field(min_length=1)
    kind: str = Field(pattern=r"^(subject|group)$")
    subject: str = Field(min_length=1, max_length=512, description="The OIDC 'sub', or a group name")
    role: str

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        return _check_role(value)


class OidcProviderCreate(BaseModel):
    model_config = _BODY
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
    name: str = Field(pattern=_NAME_PATTERN)
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
            _check_role(role)
        return value


class OidcProviderUpdate(BaseModel):
    model_config = _BODY
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


class ModelLoadRequest(BaseModel):
    model_config = _BODY
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
    path: str = Field(min_length=1, description="A GGUF file or a safetensors directory on the server")
    backend: str | None = Field(default=None, description="Registered backend name; default from settings")
    dtype: str | None = Field(default=None, pattern=r"^(auto|float32|bfloat16)$")
    aliases: list[str] = Field(default_factory=list)
    default: bool = False


# -- plumbing ------------------------------------------------------------------


def _store(request: Request) -> PolicyStore:
    return request.app.state.store  # type: ignore[no-any-return]


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | frozenset | set):
        return [_jsonable(v) for v in value]
    return value


def _record(record: Any, *, hide: tuple[str, ...] = ()) -> dict[str, Any]:
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name not in hide}
    return _jsonable(fields)


class _StoredJSON(JSONResponse):
    """JSON of what the store holds, which an older version may have let a lone surrogate into:
    escaped (``\\ud800``, still JSON) rather than a 500, so such a record can be read and deleted."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def _ok(body: Any, status: int = 200) -> JSONResponse:
    return _StoredJSON(body, status_code=status)


async def _body(request: Request, model: type[M]) -> M:
    # allow_nul=False: the store keeps these strings, and PostgreSQL's text refuses U+0000.
    limits = request.app.state.settings.input_limits.json_limits(allow_nul=False)
    data = decode_json_body(await request.body(), limits)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            message = "unknown field"
        raise ValidationFailed(f"{param}: {message}" if param else message, param=param) from None


async def _optional_body(request: Request, model: type[M]) -> M:
    """``_body`` for a body that may be left out (then the model's defaults)."""
    return await _body(request, model) if (await request.body()).strip() else model()


def _page_args(request: Request) -> tuple[int, str | None]:
    raw = request.query_params.get("limit", "50")
    # ASCII digits, few of them: str.isdigit() also accepts "²", and int()
    # refuses that and over 4300 digits alike (a 500 instead of a 422).
    if not _LIMIT_PATTERN.fullmatch(raw) or not 1 <= int(raw) <= _MAX_LIST:
        raise ValidationFailed(f"limit must be an integer from 1 to {_MAX_LIST}", param="limit")
    return int(raw), request.query_params.get("after") or None


def _page(page: Any, render: Any) -> dict[str, Any]:
    return {"object": "list", "data": [render(item) for item in page.items], "next_cursor": page.next_cursor}


async def _tenant_in_scope(request: Request) -> tuple[Principal, str]:
    """The path's tenant, if this principal may administer it (404 otherwise)."""
    principal = principal_of(request)
    tenant_id = request.path_params["tenant_id"]
    principal.require_tenant(tenant_id)
    await call_store(_store(request).get_tenant, tenant_id)  # 404 for a missing one
    return principal, tenant_id


async def _audit(
    request: Request, principal: Principal, action: str, tenant_id: str | None, kind: str, target: str, **detail: Any
) -> None:
    """Record a change on the audit trail, and make it effective on this replica now.

    Other replicas see it at their next poll of the store's policy version;
    this one drops its cached decisions (authentication, limits, guardrails)
    at once, so a client that revoked a key or lowered a limit here never
    finds the old state still in force here. The event is durable (fsynced)
    when this returns. Its attempt is already on the trail (``gateway.audit.record_attempt``,
    before the change); a trail that fails in between answers 503, saying that the
    change was made and only its attempt is on record (and the log says which).
    """
    state = request.app.state
    await state.authenticator.refresh(force=True)
    limits = getattr(state.limiter, "limits", None)
    if isinstance(limits, PolicyResolver):
        await limits.refresh(force=True)
    state.guardrails.invalidate()
    event = admin_event(
        principal=principal.subject,
        action=action,
        target_kind=kind,
        target_id=target,
        tenant_id=tenant_id,
        detail=_jsonable(detail),
        key_id=principal.key_id,
        request_id=get_context(request).request_id,
        route=f"{request.method} {route_template(request.scope)}",
    )
    try:
        await state.audit_trail.record(event)
    except AuditUnavailable as exc:
        log.error("admin change %s of %s %s by %s made but not audited: %s",
                  action, kind, target, principal.subject, exc.message)  # fmt: skip
        raise AuditUnavailable(
            f"The change was made and its attempt is on the audit trail (request {event.request_id}), but not its "
            f"outcome ({exc.message}); tell an operator"
        ) from None


def _check_models_known(
    request: Request, names: list[str] | None, param: str, usable: tuple[str, ...] | None = None
) -> None:
    """Refuse names of models that do not exist, or that are not among ``usable`` (None: any)."""
    if names is None:
        return
    manager = request.app.state.manager
    known = {m.name for m in manager} | set(manager.loading())
    if usable is not None:
        # A model outside the tenant's allow-list is answered like a missing
        # one, as /v1 does, so a tenant admin cannot probe which models exist.
        known &= set(usable)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValidationFailed(f"unknown model(s): {', '.join(unknown)}", param=param)


# -- whoami ------------------------------------------------------------------


@document("Who the credential belongs to and what it may do", tag="admin")
@requires(Scope.READ)
async def whoami(request: Request) -> Response:
    p = principal_of(request)
    return _ok(
        {
            "tenant_id": p.tenant_id,
            "tenant": p.tenant_name,
            "subject": p.subject,
            "kind": p.kind,
            "roles": sorted(p.roles),
            "scopes": sorted(s.value for s in p.scopes),
            "key_id": p.key_id,
            "allowed_models": None if p.allowed_models is None else sorted(p.allowed_models),
        }
    )


# -- tenants -----------------------------------------------------------------


def _tenant(record: Any) -> dict[str, Any]:
    return {"object": "tenant", **_record(record)}


@document("List tenants", tag="tenants", paginated=True)
@requires(Scope.ADMIN_PLATFORM)
async def list_tenants(request: Request) -> Response:
    limit, after = _page_args(request)
    return _ok(_page(await call_store(_store(request).list_tenants, limit=limit, after=after), _tenant))


@document("Create a tenant", tag="tenants", body=TenantCreate, status=201)
@requires(Scope.ADMIN_PLATFORM)
async def create_tenant(request: Request) -> Response:
    body = await _body(request, TenantCreate)
    _check_models_known(request, body.allowed_models, "allowed_models")
    principal = principal_of(request)
    tenant = await call_store(
        _store(request).create_tenant, body.name, display_name=body.display_name, allowed_models=body.allowed_models
    )
    await _audit(request, principal, "tenant.create", tenant.id, "tenant", tenant.id, name=tenant.name)
    return _ok(_tenant(tenant), 201)


@document("Get a tenant", tag="tenants")
@requires(Scope.ADMIN_TENANT)
async def get_tenant(request: Request) -> Response:
    _, tenant_id = await _tenant_in_scope(request)
    return _ok(_tenant(await call_store(_store(request).get_tenant, tenant_id)))


@document("Update a tenant (display name, disabled)", tag="tenants", body=TenantUpdate)
@requires(Scope.ADMIN_PLATFORM)
async def update_tenant(request: Request) -> Response:
    principal, tenant_id = await _tenant_in_scope(request)
    body = await _body(request, TenantUpdate)
    changes = body.model_dump(exclude_unset=True)
    tenant = await call_store(_store(request).get_tenant, tenant_id)
    if changes.get("disabled") and tenant.name == PLATFORM_TENANT:
        raise Conflict("The platform tenant cannot be disabled")
    tenant = await call_store(_store(request).update_tenant, tenant_id, **changes)
    await _audit(request, principal, "tenant.update", tenant_id, "tenant", tenant_id, **changes)
    return _ok(_tenant(tenant))


@document("Delete a tenant and everything in it", tag="tenants", status=204)
@requires(Scope.ADMIN_PLATFORM)
async def delete_tenant(request: Request) -> Response:
    principal, tenant_id = await _tenant_in_scope(request)
    tenant = await call_store(_store(request).get_tenant, tenant_id)
    if tenant.name == PLATFORM_TENANT:
        raise Conflict("The platform tenant cannot be deleted")
    await call_store(_store(request).delete_tenant, tenant_id)
    await _audit(request, principal, "tenant.delete", None, "tenant", tenant_id, name=tenant.name)
    return Response(status_code=204)


@document("The tenant's model allow-list", tag="tenants")
@requires(Scope.ADMIN_TENANT)
async def get_tenant_models(request: Request) -> Response:
    _, tenant_id = await _tenant_in_scope(request)
    tenant = await call_store(_store(request).get_tenant, tenant_id)
    return _ok({"object": "model_allow_list", "tenant_id": tenant_id, "allowed_models": tenant.allowed_models})


@document("Set the tenant's model allow-list", tag="tenants", body=ModelAllowList)
@requires(Scope.ADMIN_PLATFORM)
async def set_tenant_models(request: Request) -> Response:
    principal, tenant_id = await _tenant_in_scope(request)
    body = await _body(request, ModelAllowList)
    _check_models_known(request, body.allowed_models, "allowed_models")
    tenant = await call_store(_store(request).update_tenant, tenant_id, allowed_models=body.allowed_models)
    await _audit(request, principal, "tenant.models", tenant_id, "tenant", tenant_id, allowed_models=body.allowed_models)
    return _ok({"object": "model_allow_list", "tenant_id": tenant_id, "allowed_models": tenant.allowed_models})


# -- API keys ------------------------------------------------------------------


def _key(record: Any) -> dict[str, Any]:
    return {"object": "api_key", **_record(record, hide=("key_hash",))}


@document("List a tenant's API keys (prefixes only)", tag="keys", paginated=True)
@requires(Scope.ADMIN_TENANT)
async def list_keys(request: Request) -> Response:
    _, tenant_id = await _tenant_in_scope(request)
    limit, after = _page_args(request)
    return _ok(_page(await call_store(_store(request).list_api_keys, tenant_id, limit=limit, after=after), _key))


@document("Create an API key; the key itself is in the response, once", tag="keys", body=KeyCreate, status=201)
@requires(Scope.ADMIN_TENANT)
async def create_key(request: Request) -> Response:
    principal, tenant_id = await _tenant_in_scope(request)
    body = await _body(request, KeyCreate)
    if not principal.may_grant(body.role):
        raise PermissionDenied(f"You cannot create a key with role '{body.role}', which has scopes you lack")
    tenant = await call_store(_store(request).get_tenant, tenant_id)
    if body.role == "platform-admin" and tenant.name != PLATFORM_TENANT:
        raise ValidationFailed("platform-admin keys exist only in the platform tenant", param="role")
    _check_models_known(request, body.allowed_models, "allowed_models", tenant.allowed_models)
    expires = datetime.now(UTC) + timedelta(seconds=body.expires_in_seconds) if body.expires_in_seconds else None
    record, token = await call_store(
        _store(request).create_api_key,
        tenant_id,
        name=body.name,
        role=body.role,
        allowed_models=body.allowed_models,
        expires_at=expires,
        created_by=principal.subject,
    )
    await _audit(request, principal, "key.create", tenant_id, "api_key", record.id, prefix=record.prefix, role=body.role)
    return _ok({**_key(record), "key": token}, 201)


@document("Get an API key", tag="keys")
@requires(Scope.ADMIN_TENANT)
async def get_key(request: Request) -> Response:
    _, tenant_id = await _tenant_in_scope(request)
    return _ok(_key(await call_store(_store(request).get_api_key, tenant_id, request.path_params["key_id"])))


@document("Revoke an API key (effective on every replica within seconds)", tag="keys", body=NoBody,
          body_required=False)  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def revoke_key(request: Request) -> Response:
    principal, tenant_id = await _tenant_in_scope(request)
    await _optional_body(request, NoBody)
    key_id = request.path_params["key_id"]
    existing = await call_store(_store(request).get_api_key, tenant_id, key_id)
    # As for rotation: a tenant admin of the platform tenant must not be able
    # to lock the platform admins out by revoking their keys.
    if not principal.may_grant(existing.role):
        raise PermissionDenied(f"You cannot revoke a key with role '{existing.role}', which has scopes you lack")
    record = await call_store(_store(request).revoke_api_key, tenant_id, key_id)
    await _audit(request, principal, "key.revoke", tenant_id, "api_key", key_id, prefix=record.prefix)
    return _ok(_key(record))


@document("Rotate an API key: a new key now, the old one expires after a grace period", tag="keys", body=KeyRotate,
          body_required=False, status=201)  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def rotate_key(request: Request) -> Response:
    principal, tenant_id = await _tenant_in_scope(request)
    body = await _optional_body(request, KeyRotate)
    key_id = request.path_params["key_id"]
    old = await call_store(_store(request).get_api_key, tenant_id, key_id)
    if not principal.may_grant(old.role):
        raise PermissionDenied(f"You cannot rotate a key with role '{old.role}', which has scopes you lack")
    record, token = await call_store(
        _store(request).rotate_api_key,
        tenant_id,
        key_id,
        grace_seconds=body.grace_seconds,
        created_by=principal.subject,
    )
    await _audit(request, principal, "key.rotate", tenant_id, "api_key", key_id, new_key=record.id, grace=body.grace_seconds)
    return _ok({**_key(record), "key": token, "replaces": key_id}, 201)


# -- role bindings -----------------------------------------------------------------


def _binding(record: Any) -> dict[str, Any]:
    return {"object": "role_binding", **_record(record)}


@document("List a tenant's role bindings for OIDC subjects and groups", tag="role-bindings", paginated=True)
@requires(Scope.ADMIN_TENANT)
async def list_bindings(request: Request) -> Response:
    _, tenant_id = await _tenant_in_scope(request)
    limit, after = _page_args(request)
    page = await call_store(_store(request).list_role_bindings, tenant_id, limit=limit, after=after)
    return _ok(_page(page, _binding))


@document("Bind a role to an OIDC subject or group", tag="role-bindings", body=RoleBindingCreate, status=201)
@requires(Scope.ADMIN_TENANT)
async def create_binding(request: Request) -> Response:
    principal, tenant_id = await _tenant_in_scope(request)
    body = await _body(request, RoleBindingCreate)
    if not principal.may_grant(body.role):
        raise PermissionDenied(f"You cannot grant role '{body.role}', which has scopes you lack")
    # The store refuses platform-admin outside the platform tenant, and a provider that may not
    # sign users into this tenant exactly as a missing one.
    record = await call_store(
        _store(request).create_role_binding,
        tenant_id,
        provider_id=body.provider_id,
        kind=body.kind,
        subject=body.subject,
        role=body.role,
    )
    await _audit(request, principal, "role_binding.create", tenant_id, "role_binding", record.id, role=body.role)
    return _ok(_binding(record), 201)


@document("Get a role binding", tag="role-bindings")
@requires(Scope.ADMIN_TENANT)
async def get_binding(request: Request) -> Response:
    _, tenant_id = await _tenant_in_scope(request)
    return _ok(_binding(await call_store(_store(request).get_role_binding, tenant_id, request.path_params["binding_id"])))


@document("Delete a role binding", tag="role-bindings", status=204)
@requires(Scope.ADMIN_TENANT)
async def delete_binding(request: Request) -> Response:
    principal, tenant_id = await _tenant_in_scope(request)
    binding_id = request.path_params["binding_id"]
    binding = await call_store(_store(request).get_role_binding, tenant_id, binding_id)
    if not principal.may_grant(binding.role):
        raise PermissionDenied(f"You cannot remove a binding of role '{binding.role}', which has scopes you lack")
    await call_store(_store(request).delete_role_binding, tenant_id, binding_id)
    await _audit(request, principal, "role_binding.delete", tenant_id, "role_binding", binding_id)
    return Response(status_code=204)


# -- OIDC providers --------------------------------------------------------------


def _provider(record: Any) -> dict[str, Any]:
    out = {"object": "oidc_provider", **_record(record, hide=("client_secret",))}
    out["has_client_secret"] = bool(getattr(record, "client_secret", None))
    return out


def _check_provider(body: OidcProviderCreate | OidcProviderUpdate, issuer: str, existing: Any = None) -> None:
    """Reject settings the verifier would refuse, at write time rather than on first login."""
    from policy.authn.oidc import OidcProviderConfig

    # A new provider is checked with its defaults; an update, merged over what is stored.
    stored = _record(existing) if existing is not None else {}
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
            _check_role(role)
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
            await call_store(_store(request).get_tenant, named)  # 404 for a missing one
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
    limit, after = _page_args(request)
    owner = _provider_owner(principal_of(request))
    page = await call_store(_store(request).list_oidc_providers, limit=limit, after=after, owner=owner)
    return _ok(_page(page, _provider))


@document("Register an OIDC identity provider (a tenant's, or platform-owned)", tag="oidc",
          body=OidcProviderCreate, status=201)  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def create_provider(request: Request) -> Response:
    principal = principal_of(request)
    body = await _body(request, OidcProviderCreate)
    owner = await _new_provider_owner(request, principal, body)
    _check_provider(body, body.issuer)
    record = await call_store(
        _store(request).create_oidc_provider, tenant_id=owner, **body.model_dump(exclude={"tenant_id"})
    )
    await _audit(request, principal, "oidc_provider.create", owner, "oidc_provider", record.id, issuer=body.issuer,
                 tenant_ids=record.tenant_ids, allow_platform=record.allow_platform)  # fmt: skip
    return _ok(_provider(record), 201)


@document("Get an OIDC identity provider", tag="oidc")
@requires(Scope.ADMIN_TENANT)
async def get_provider(request: Request) -> Response:
    owner = _provider_owner(principal_of(request))
    record = await call_store(_store(request).get_oidc_provider, request.path_params["provider_id"], owner=owner)
    return _ok(_provider(record))


@document("Update an OIDC identity provider (its owner never changes)", tag="oidc", body=OidcProviderUpdate)
@requires(Scope.ADMIN_TENANT)
async def update_provider(request: Request) -> Response:
    principal = principal_of(request)
    provider_id, owner = request.path_params["provider_id"], _provider_owner(principal)
    existing = await call_store(_store(request).get_oidc_provider, provider_id, owner=owner)
    body = await _body(request, OidcProviderUpdate)
    _check_provider(body, existing.issuer, existing)
    changes = body.model_dump(exclude_unset=True)
    record = await call_store(_store(request).update_oidc_provider, provider_id, owner=owner, **changes)
    await _audit(request, principal, "oidc_provider.update", record.tenant_id, "oidc_provider", provider_id,
                 fields=sorted(changes))  # fmt: skip
    return _ok(_provider(record))


@document("Delete an OIDC identity provider and its role bindings", tag="oidc", status=204)
@requires(Scope.ADMIN_TENANT)
async def delete_provider(request: Request) -> Response:
    principal = principal_of(request)
    provider_id, owner = request.path_params["provider_id"], _provider_owner(principal)
    existing = await call_store(_store(request).get_oidc_provider, provider_id, owner=owner)
    await call_store(_store(request).delete_oidc_provider, provider_id, owner=owner)
    await _audit(request, principal, "oidc_provider.delete", existing.tenant_id, "oidc_provider", provider_id)
    return Response(status_code=204)


# -- models ------------------------------------------------------------------------


@document("Served and loading models, with status", tag="models")
@requires(Scope.ADMIN_PLATFORM)
async def list_models(request: Request) -> Response:
    admin = request.app.state.model_admin
    return _ok({"object": "list", "data": admin.describe_all()})


@document("Load a model in the background (progress at GET /admin/v1/models/{name})", tag="models", body=ModelLoadRequest, status=202)
@requires(Scope.ADMIN_PLATFORM)
async def load_model(request: Request) -> Response:
    principal = principal_of(request)
    body = await _body(request, ModelLoadRequest)
    admin = request.app.state.model_admin
    status = await admin.load(
        name=body.name, path=body.path, backend=body.backend, dtype=body.dtype, aliases=body.aliases, default=body.default
    )
    await _audit(request, principal, "model.load", None, "model", body.name, path=body.path, backend=status["backend"])
    return _ok(status, 202)


@document("A model's status and load progress", tag="models")
@requires(Scope.ADMIN_PLATFORM)
async def get_model(request: Request) -> Response:
    return _ok(request.app.state.model_admin.describe(request.path_params["name"]))


@document("Unload a model and forget it", tag="models", status=204)
@requires(Scope.ADMIN_PLATFORM)
async def unload_model(request: Request) -> Response:
    principal = principal_of(request)
    name = request.path_params["name"]
    await request.app.state.model_admin.unload(name)
    await _audit(request, principal, "model.unload", None, "model", name)
    return Response(status_code=204)


@document("Make a model the default", tag="models", body=NoBody, body_required=False)
@requires(Scope.ADMIN_PLATFORM)
async def set_default_model(request: Request) -> Response:
    principal = principal_of(request)
    await _optional_body(request, NoBody)
    name = request.path_params["name"]
    status = await request.app.state.model_admin.set_default(name)
    await _audit(request, principal, "model.default", None, "model", name)
    return _ok(status)


def routes() -> list[BaseRoute]:
    """Every admin route: these, the policies' and the audit log's."""
    from gateway.routes import admin_audit, admin_policies  # they import this module's helpers

    t = PREFIX + "/tenants/{tenant_id}"
    return [
        *_routes(t),
        *admin_policies.routes(t),
        *admin_audit.routes(t),
    ]


def _routes(t: str) -> list[BaseRoute]:
    return [
        Route(PREFIX + "/whoami", whoami, methods=["GET"]),
        Route(PREFIX + "/tenants", list_tenants, methods=["GET"]),
        Route(PREFIX + "/tenants", create_tenant, methods=["POST"]),
        Route(t, get_tenant, methods=["GET"]),
        Route(t, update_tenant, methods=["PATCH"]),
        Route(t, delete_tenant, methods=["DELETE"]),
        Route(t + "/models", get_tenant_models, methods=["GET"]),
        Route(t + "/models", set_tenant_models, methods=["PUT"]),
        Route(t + "/keys", list_keys, methods=["GET"]),
        Route(t + "/keys", create_key, methods=["POST"]),
        Route(t + "/keys/{key_id}", get_key, methods=["GET"]),
        Route(t + "/keys/{key_id}/revoke", revoke_key, methods=["POST"]),
        Route(t + "/keys/{key_id}/rotate", rotate_key, methods=["POST"]),
        Route(t + "/role-bindings", list_bindings, methods=["GET"]),
        Route(t + "/role-bindings", create_binding, methods=["POST"]),
        Route(t + "/role-bindings/{binding_id}", get_binding, methods=["GET"]),
        Route(t + "/role-bindings/{binding_id}", delete_binding, methods=["DELETE"]),
        Route(PREFIX + "/oidc-providers", list_providers, methods=["GET"]),
        Route(PREFIX + "/oidc-providers", create_provider, methods=["POST"]),
        Route(PREFIX + "/oidc-providers/{provider_id}", get_provider, methods=["GET"]),
        Route(PREFIX + "/oidc-providers/{provider_id}", update_provider, methods=["PATCH"]),
        Route(PREFIX + "/oidc-providers/{provider_id}", delete_provider, methods=["DELETE"]),
        Route(PREFIX + "/models", list_models, methods=["GET"]),
        Route(PREFIX + "/models", load_model, methods=["POST"]),
        Route(PREFIX + "/models/{name}", get_model, methods=["GET"]),
        Route(PREFIX + "/models/{name}", unload_model, methods=["DELETE"]),
        Route(PREFIX + "/models/{name}/default", set_default_model, methods=["POST"]),
    ]

