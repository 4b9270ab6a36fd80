"""``GET /admin/v1/whoami``: who the credential belongs to and what it may do (any scope that reads)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway.authz import principal_of, requires
from inferflux.gateway.openapi import document
from inferflux.gateway.routes.admin.common import PREFIX, ok
from inferflux.policy.rbac import Scope


@document("Who the credential belongs to and what it may do", tag="admin")
@requires(Scope.READ)
async def whoami(request: Request) -> Response:
    p = principal_of(request)
    return ok(
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


def routes() -> list[BaseRoute]:
    return [Route(PREFIX + "/whoami", whoami, methods=["GET"])]
