"""Tenant names for the console's pages, read through the admin API like everything else.

A page shows a tenant by its name, the id beside it only where the name cannot be had (a tenant
deleted since its usage or events were recorded). Which names a caller may learn is the API's
to say: a platform admin reads them all (``GET /admin/v1/tenants``, page by page), anyone else
knows only its own tenant's (its principal carries it), so a tenant admin's page never names
another tenant.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request

from inferflux.gateway.console.dispatch import api_path, call_api
from inferflux.policy.rbac import Principal

# Pages of GET /admin/v1/tenants read at most (200 tenants each): past that, ids show for the rest.
MAX_PAGES = 50


@dataclass(frozen=True)
class TenantLabel:
    """How a page shows one tenant: ``name`` (None when unknown to this caller) and its ``id``."""

    id: str
    name: str | None

    @property
    def text(self) -> str:
        return self.name or self.id


class TenantNames:
    """Tenant id -> name, of the tenants this caller may see."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    def label(self, tenant_id: object) -> TenantLabel:
        text = "" if tenant_id is None else str(tenant_id)
        return TenantLabel(text, self.names.get(text))


async def tenant_names(request: Request, principal: Principal) -> TenantNames:
    """The names ``principal`` may read: every tenant's for a platform admin, else its own tenant's."""
    names = {principal.tenant_id: principal.tenant_name}
    if not principal.is_platform_admin:
        return TenantNames(names)
    query = {"limit": "200"}
    for _ in range(MAX_PAGES):
        answer = await call_api(request, "GET", api_path("tenants"), query=query)
        page = answer.json() if answer.ok else None
        if not isinstance(page, dict):
            break  # the ids show; the page itself reports what its own call answered
        names.update({t["id"]: t["name"] for t in page.get("data", []) if isinstance(t, dict)})
        if not page.get("next_cursor"):
            break
        query["after"] = page["next_cursor"]
    return TenantNames(names)


async def tenant_of(request: Request, tenant_id: str) -> TenantLabel:
    """One tenant's label for a page under ``/console/tenants/<id>/``, as ``GET /admin/v1/tenants/<id>`` reads it."""
    answer = await call_api(request, "GET", api_path("tenants", tenant_id))
    data = answer.json() if answer.ok else None
    name = data.get("name") if isinstance(data, dict) else None
    return TenantLabel(tenant_id, name if isinstance(name, str) else None)
