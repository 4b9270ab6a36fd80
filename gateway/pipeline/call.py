"""``Call``: one API request as the pipeline's stages see it, built once by the driver (``gateway.pipeline.run``).

The middleware keep what they learn of a request in its ASGI scope (the
context, the principal on it) and in the app's state; a stage reading them
there would take the whole ``Request`` and call the accessors (``get_context``,
``principal_of``, ``state_of``) again and again. The driver reads them once, into
this frozen record, and hands it to every stage instead of the request: what a
stage may use of the request is what is here. The accessors stay for the
middleware, which run before any ``Call`` exists.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.types import Receive

from inferflux.gateway.authz import principal_of
from inferflux.gateway.context import RequestContext, get_context
from inferflux.gateway.pipeline.sse import drain_deadline, run_until_disconnect
from inferflux.gateway.state import GatewayState, state_of
from inferflux.policy.rbac import Principal

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Call:
    ctx: RequestContext  # what the audit event, the logs and the trace read of this request; stages fill it
    principal: Principal  # who calls (authentication put it on the context)
    state: GatewayState  # the app's, typed
    route: str  # the request's path, as OPA is told it
    headers: Headers  # the client's (only ``upstreams.forward_headers`` of them ever travel on)
    body: Callable[[], Awaitable[bytes]]  # the request's body, read once and kept by Starlette
    receive: Receive  # where the client's disconnect arrives, once the body is read
    deadline: asyncio.Event | None  # set when a draining server's grace is over (None: the app has no drain)

    @classmethod
    def of(cls, request: Request) -> Call:
        return cls(get_context(request), principal_of(request), state_of(request), request.url.path,
                   request.headers, request.body, request.receive, drain_deadline(request.scope))  # fmt: skip

    async def watched(self, work: Awaitable[T]) -> T:
        """``work``, cancelled with ``ClientDisconnected`` if the client leaves first, or ``ShuttingDown``
        (503) if a drain's grace ends first. Only once the body is read: this consumes ``receive``."""
        return await run_until_disconnect(self.receive, work, self.deadline)
