"""The console's response headers (a strict CSP and friends) and the CSP violation report endpoint.

The pages carry no inline script or style and load nothing from elsewhere, so
the policy can be ``'self'`` only; a violation means a page broke that rule
(or something injected markup), and is recorded: logged, counted in
``inferflux_console_csp_violations``, and kept (the last 100) for tests and
operators to read.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferflux.gateway.logs.redaction import redact

log = logging.getLogger("inferflux.gateway.console")

REPORT_PATH = "/console/csp-report"
CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
        "object-src 'none'",
        # report-uri only: Chromium ignores it when report-to is present, and the Reporting API
        # batches reports for up to a minute; report-uri posts each violation at once.
        f"report-uri {REPORT_PATH}",
    )
)
HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    # same-origin, not no-referrer: under no-referrer a browser posts forms with "Origin: null", which the
    # CSRF check (gateway.console.forms.same_origin) must refuse.
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
    "cross-origin-opener-policy": "same-origin",
}
_MAX_REPORT = 64 * 1024
_FIELDS = ("document-uri", "documentURL", "violated-directive", "effectiveDirective", "blocked-uri", "blockedURL",
           "source-file", "sourceFile", "line-number", "lineNumber")  # fmt: skip


class SecurityHeaders:
    """Adds ``HEADERS`` to every console answer (an error's included); static files may be cached."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = scope["path"].startswith("/console/static/")

        async def send_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in HEADERS.items():
                    if not (static and name == "cache-control"):
                        headers[name] = value
            await send(message)

        await self.app(scope, receive, send_headers)


class CspReports:
    """What browsers reported; bounded."""

    def __init__(self) -> None:
        self.count = 0
        self.recent: deque[dict[str, Any]] = deque(maxlen=100)

    async def receive(self, request: Request) -> Response:
        body = await request.body()
        if len(body) > _MAX_REPORT:
            return Response(status_code=413)
        try:
            data = json.loads(body)
        except ValueError:
            return Response(status_code=400)
        # report-uri sends {"csp-report": {...}}; the Reporting API a list of {"type", "body"}.
        items = data if isinstance(data, list) else [data]
        for item in items:
            if not isinstance(item, dict):
                continue
            report = item.get("csp-report") or item.get("body") or {}
            if not isinstance(report, dict):
                continue
            kept = {k: str(report[k])[:500] for k in _FIELDS if k in report}
            self.count += 1
            self.recent.append(kept)
            log.warning("console CSP violation: %s", redact(json.dumps(kept)))
        return Response(status_code=204)
