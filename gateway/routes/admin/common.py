"""What every admin resource module shares: store access, bodies, pages, tenant scope, and the record of a change.

The resource modules (``tenants``, ``keys``, ...) import from here and from
nothing of each other, so the package has no import cycle: this module
imports no resource module.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from datetime import UTC, datetime
from enum import Enum
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from inferflux.gateway.auth import call_store
from inferflux.gateway.authz import principal_of
from inferflux.gateway.context import get_context, route_template
from inferflux.gateway.pipeline.body import decode_json_body
from inferflux.gateway.state import state_of
from inferflux.gateway.validation_errors import first_error
from inferflux.policy.audit.errors import AuditUnavailable
from inferflux.policy.audit.events import admin_event
from inferflux.policy.errors import ValidationFailed
from inferflux.policy.ratelimit import PolicyResolver
from inferflux.policy.rbac import ROLE_NAMES, Principal
from inferflux.policy.store import PolicyStore

M = TypeVar("M", bound=BaseModel)

log = logging.getLogger("inferflux.gateway.admin")

PREFIX = "/admin/v1"
TENANT_PREFIX = PREFIX + "/tenants/{tenant_id}"
NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
MAX_LIST = 200
_LIMIT_PATTERN = re.compile(r"[0-9]{1,4}")

# Request bodies: unknown fields refused, no coercion ("1" is not 1).
BODY = ConfigDict(extra="forbid", strict=True)


class NoBody(BaseModel):
    """The body of an action that takes no fields: none, or ``{}``."""

    model_config = BODY


def check_role(value: str) -> str:
    """``value`` if it names a role (a pydantic validator's ValueError otherwise)."""
    if value not in ROLE_NAMES:
        raise ValueError(f"unknown role {value!r}; roles are {', '.join(ROLE_NAMES)}")
    return value


def store_of(request: Request) -> PolicyStore:
    return state_of(request).store


# -- answers -------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """``value`` with datetimes as RFC 3339 UTC text, enums as their values, sets as lists."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | frozenset | set):
        return [jsonable(v) for v in value]
    return value


def record_fields(record: Any, *, hide: tuple[str, ...] = ()) -> dict[str, Any]:
    """A store record's fields as JSON values, less those in ``hide`` (secrets, hashes)."""
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name not in hide}
    return jsonable(fields)


class StoredJSON(JSONResponse):
    """JSON of what the store holds, which an older version may have let a lone surrogate into:
    escaped (``\\ud800``, still JSON) rather than a 500, so such a record can be read and deleted."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def ok(body: Any, status: int = 200) -> JSONResponse:
    return StoredJSON(body, status_code=status)


# -- requests ------------------------------------------------------------------


async def parse_body(request: Request, model: type[M]) -> M:
    """The body decoded with the input limits and validated as ``model`` (400 naming the first bad field)."""
    # No U+0000 (store_json_limits): the store keeps these strings, and PostgreSQL's text refuses it.
    data = decode_json_body(await request.body(), state_of(request).store_json_limits)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = first_error(exc)
        raise ValidationFailed(first.line(), param=first.path) from None


async def parse_optional_body(request: Request, model: type[M]) -> M:
    """``parse_body`` for a body that may be left out (then the model's defaults)."""
    return await parse_body(request, model) if (await request.body()).strip() else model()


def patch_changes(body: BaseModel, nullable: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields a PATCH sets; null only where it means something (removing a sensitive_spec)."""
    changes = body.model_dump(exclude_unset=True)
    for name, value in changes.items():
        if value is None and name not in nullable:
            raise ValidationFailed(f"{name}: may not be null", param=name)
    return changes


def page_args(request: Request) -> tuple[int, str | None]:
    """``limit`` (1-200, default 50) and the ``after`` cursor of a list request."""
    raw = request.query_params.get("limit", "50")
    # ASCII digits, few of them: str.isdigit() also accepts "²", and int()
    # refuses that and over 4300 digits alike (a 500 instead of a 422).
    if not _LIMIT_PATTERN.fullmatch(raw) or not 1 <= int(raw) <= MAX_LIST:
        raise ValidationFailed(f"limit must be an integer from 1 to {MAX_LIST}", param="limit")
    return int(raw), request.query_params.get("after") or None


def render_page(page: Any, render: Any) -> dict[str, Any]:
    return {"object": "list", "data": [render(item) for item in page.items], "next_cursor": page.next_cursor}


async def tenant_in_scope(request: Request) -> tuple[Principal, str]:
    """The path's tenant, if this principal may administer it (404 otherwise)."""
    principal = principal_of(request)
    tenant_id = request.path_params["tenant_id"]
    principal.require_tenant(tenant_id)
    await call_store(store_of(request).get_tenant, tenant_id)  # 404 for a missing one
    return principal, tenant_id


def check_models_known(
    request: Request, names: list[str] | None, param: str, usable: tuple[str, ...] | None = None
) -> None:
    """Refuse names of models that do not exist, or that are not among ``usable`` (None: any)."""
    if names is None:
        return
    manager = state_of(request).manager
    known = {m.name for m in manager} | set(manager.loading())
    if usable is not None:
        # A model outside the tenant's allow-list is answered like a missing
        # one, as /v1 does, so a tenant admin cannot probe which models exist.
        known &= set(usable)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValidationFailed(f"unknown model(s): {', '.join(unknown)}", param=param)


# -- the record of a change ------------------------------------------------------


async def record_change(
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
    state = state_of(request)
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
        detail=jsonable(detail),
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
