"""``GatewayState``: what one app holds, typed, in place of Starlette's untyped ``app.state`` bag.

``create_app`` builds one and sets it as ``app.state``, so ``request.app.state.limiter``
still reads as before, and ``state_of(request)`` gives the same object with its
types. Limits derived from settings (the JSON decoder's, the stop sequences')
are built here once per app rather than once per request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import HTTPConnection

if TYPE_CHECKING:
    from inferflux.backends.engine import GrammarBudget
    from inferflux.policy.audit import AuditStore, AuditTrail
    from inferflux.policy.guardrails import GuardrailResolver
    from inferflux.policy.ratelimit import RateLimiter
    from inferflux.policy.snapshot import StoreSnapshot
    from inferflux.policy.store import PolicyStore

    from inferflux.gateway.auth import Authenticator
    from inferflux.gateway.drain import Drain
    from inferflux.gateway.gate import AuditHealth
    from inferflux.gateway.metrics import GatewayMetrics
    from inferflux.gateway.models.admin import ModelAdmin
    from inferflux.gateway.models.manifests import ManifestWatcher
    from inferflux.gateway.models.served import ModelManager
    from inferflux.gateway.pipeline.body import JsonLimits, SchemaLimits
    from inferflux.gateway.pipeline.sampling import StopLimits
    from inferflux.gateway.settings import Settings
    from inferflux.gateway.traffic import TrafficPolicy


@dataclass(eq=False)
class GatewayState:
    settings: Settings
    manager: ModelManager
    metrics: GatewayMetrics
    store: PolicyStore
    authenticator: Authenticator
    model_admin: ModelAdmin
    traffic: TrafficPolicy
    snapshot: StoreSnapshot
    audit_health: AuditHealth
    drain: Drain
    json_limits: JsonLimits  # the generation routes' bodies
    store_json_limits: JsonLimits  # bodies the store keeps: no U+0000 (PostgreSQL refuses it)
    stop_limits: StopLimits
    schema_limits: SchemaLimits  # a request's schemas and tools, before its guardrails (gateway.pipeline.body)
    grammar_budget: GrammarBudget  # each new grammar's compile (gateway.pipeline.grammars)
    manifests: ManifestWatcher | None = None  # registry.path's manifests, when it is set
    audit_trail: AuditTrail | None = None  # set when the app starts (the spool locks its directory)
    traffic_tasks: set[asyncio.Task[Any]] = field(default_factory=set)  # rate-limit settlements in flight

    @property
    def limiter(self) -> RateLimiter:
        return self.traffic.limiter

    @property
    def guardrails(self) -> GuardrailResolver:
        return self.traffic.guardrails

    @property
    def audit_store(self) -> AuditStore:
        return self.traffic.audit_store


def state_of(conn: HTTPConnection) -> GatewayState:
    """The app's state, typed."""
    state: GatewayState = conn.app.state
    return state
