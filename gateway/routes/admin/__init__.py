"""The admin REST API under ``/admin/v1``, a module per resource over ``common``.

Scopes: ``admin:platform`` for tenants, models and upstream credentials; ``admin:tenant`` for
what lives inside one tenant (keys, role bindings, its identity providers,
its model allow-list, its audit log). A tenant admin naming another tenant,
or an object of another tenant, gets 404: the answer never tells whether it
exists; a platform-only route answers it as a route that does not exist
(``gateway.authz``).

Every change is recorded as an admin event on the tamper-evident audit trail
(``policy.audit``), durable before the response is sent, and is effective on
this replica at once (``common.record_change`` drops the cached decisions)
and on the others within their poll interval. Lists are paginated with
``limit`` (1-200, default 50) and the opaque ``after`` cursor of the previous
page's ``next_cursor``.

The resources: ``whoami``, ``status`` (readiness, version, queue and KV per
model), ``tenants`` (and their model allow-lists),
``keys``, ``role_bindings``, ``idps`` (OIDC providers), ``models`` (served
models), ``credentials`` (the secrets upstream model servers are called
with), ``policies`` (rate limits, quotas and budgets), ``guardrails``, ``audit`` (the
log and its live tail), ``usage`` (usage and spend, the price table). ``routes()`` serves them all,
in this order.
"""

from __future__ import annotations

from starlette.routing import BaseRoute

from inferflux.gateway.routes.admin import (
    audit,
    credentials,
    guardrails,
    idps,
    keys,
    models,
    policies,
    role_bindings,
    status,
    tenants,
    usage,
    whoami,
)


def routes() -> list[BaseRoute]:
    """Every admin route, in the order the route table and the OpenAPI document list them."""
    return [
        *whoami.routes(),
        *status.routes(),
        *tenants.routes(),
        *keys.routes(),
        *role_bindings.routes(),
        *idps.routes(),
        *models.routes(),
        *credentials.routes(),
        *policies.routes(),
        *guardrails.routes(),
        *audit.routes(),
        *usage.routes(),
    ]
