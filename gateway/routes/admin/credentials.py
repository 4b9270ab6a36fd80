"""Upstream credentials (``admin:platform``): secrets the gateway presents to the model servers it fronts.

A model of the ``openai`` backend names its credential (``upstream.credential``),
and only platform admins define upstreams, so these are the platform's
credentials (the store's ``tenant_id`` None) and only platform admins see
them: to anyone else the routes do not exist (404). Tenant-owned credentials
exist in the store but are not served here.

The secret is write-only: sealed in the store, never in an answer, a log line
or an audit event (which carry the id and the name). It changes by rotation
(``POST .../rotate``), in place: the name never changes, since models refer to
it, and whoever reads the secret by name (``PolicyStore.credential_secret_by_name``)
reads the new one from then on; like every store write, a rotation bumps the
policy version, which every replica polls.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, SecretStr
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
    ok,
    page_args,
    parse_body,
    record_change,
    record_fields,
    render_page,
    store_of,
)
from inferflux.gateway.state import state_of
from inferflux.policy.errors import Conflict
from inferflux.policy.rbac import Scope
from inferflux.policy.store.validate import MAX_CREDENTIAL_SECRET

# The store checks the secret (``policy.store.validate.credential_secret``: length, no control
# characters); the schema says so to clients. SecretStr keeps it out of every repr.
_SECRET = Field(
    description="Write-only: sealed in the store, never shown again. No control characters or line breaks",
    json_schema_extra={"minLength": 1, "maxLength": MAX_CREDENTIAL_SECRET, "writeOnly": True},
)
_PLATFORM = None  # the store's owner of platform credentials


class CredentialCreate(BaseModel):
    model_config = BODY
    name: str = Field(pattern=NAME_PATTERN, description="What a model's upstream.credential names; never changes")
    secret: SecretStr = _SECRET


class CredentialRotate(BaseModel):
    model_config = BODY
    secret: SecretStr = _SECRET


def _credential(record: Any) -> dict[str, Any]:
    return {"object": "credential", **record_fields(record, hide=("secret", "tenant_id"))}


@document("List the platform's upstream credentials (never their secrets)", tag="credentials", paginated=True)
@requires(Scope.ADMIN_PLATFORM)
async def list_credentials(request: Request) -> Response:
    limit, after = page_args(request)
    page = await call_store(store_of(request).list_credentials, _PLATFORM, limit=limit, after=after)
    return ok(render_page(page, _credential))


@document("Store an upstream credential (the secret is write-only)", tag="credentials", body=CredentialCreate,
          status=201)  # fmt: skip
@requires(Scope.ADMIN_PLATFORM)
async def create_credential(request: Request) -> Response:
    principal = principal_of(request)
    body = await parse_body(request, CredentialCreate)
    record = await call_store(store_of(request).create_credential, _PLATFORM, body.name, body.secret.get_secret_value())
    await record_change(request, principal, "credential.create", _PLATFORM, "credential", record.id, name=record.name)
    return ok(_credential(record), 201)


@document("Get an upstream credential (not its secret)", tag="credentials")
@requires(Scope.ADMIN_PLATFORM)
async def get_credential(request: Request) -> Response:
    record = await call_store(store_of(request).get_credential, _PLATFORM, request.path_params["credential_id"])
    return ok(_credential(record))


@document("Replace an upstream credential's secret (its id and name stay)", tag="credentials",
          body=CredentialRotate)  # fmt: skip
@requires(Scope.ADMIN_PLATFORM)
async def rotate_credential(request: Request) -> Response:
    principal = principal_of(request)
    credential_id = request.path_params["credential_id"]
    await call_store(store_of(request).get_credential, _PLATFORM, credential_id)  # 404 before reading the body
    body = await parse_body(request, CredentialRotate)
    record = await call_store(store_of(request).update_credential, _PLATFORM, credential_id,
                              secret=body.secret.get_secret_value())  # fmt: skip
    await record_change(request, principal, "credential.rotate", _PLATFORM, "credential", credential_id,
                        name=record.name)  # fmt: skip
    return ok(_credential(record))


@document("Delete an upstream credential (models naming it can no longer reach their upstream)",
          tag="credentials", status=204)  # fmt: skip
@requires(Scope.ADMIN_PLATFORM)
async def delete_credential(request: Request) -> Response:
    principal = principal_of(request)
    credential_id = request.path_params["credential_id"]
    existing = await call_store(store_of(request).get_credential, _PLATFORM, credential_id)
    users = await _models_using(request, existing.name)
    if users:
        # Deleting it would leave those models without a key at their next start or rotation.
        raise Conflict(f"The credential '{existing.name}' is used by the model(s) {', '.join(sorted(users))}; "
                       "unload or change them first", param="credential_id")  # fmt: skip
    await call_store(store_of(request).delete_credential, _PLATFORM, credential_id)
    await record_change(request, principal, "credential.delete", _PLATFORM, "credential", credential_id,
                        name=existing.name)  # fmt: skip
    return Response(status_code=204)


async def _models_using(request: Request, name: str) -> set[str]:
    """Models, served here or in the store's registry, whose upstream key is the credential ``name``."""
    state = state_of(request)
    users = {m.name for m in state.manager if m.upstream is not None and m.upstream.get("credential") == name}
    for record in await call_store(store_of(request).list_served_models):
        if record.upstream is not None and record.upstream.get("credential") == name:
            users.add(record.name)
    users |= {e.name for e in state.settings.models if e.upstream is not None and e.upstream.credential == name}
    return users


def routes() -> list[BaseRoute]:
    c = PREFIX + "/credentials"
    return [
        Route(c, list_credentials, methods=["GET"]),
        Route(c, create_credential, methods=["POST"]),
        Route(c + "/{credential_id}", get_credential, methods=["GET"]),
        Route(c + "/{credential_id}/rotate", rotate_credential, methods=["POST"]),
        Route(c + "/{credential_id}", delete_credential, methods=["DELETE"]),
    ]
