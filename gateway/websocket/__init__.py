"""The WebSocket front door, ``/v1/websocket``: several streamed requests on one connection.

``protocol`` reads the client's messages and shapes the events, ``dispatch`` runs
one request through the whole app as the HTTP request it stands for, ``session``
holds a connection (its handshake, its requests in flight, its close). The
protocol is in docs/api.md ("WebSocket"); its settings are the ``websocket``
section (docs/operators.md).
"""

from __future__ import annotations

from starlette.routing import BaseRoute, WebSocketRoute

from inferflux.gateway.websocket.session import serve

PATH = "/v1/websocket"


def routes() -> list[BaseRoute]:
    return [WebSocketRoute(PATH, serve)]
