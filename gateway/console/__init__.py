"""The web console at ``/console``: server-rendered pages over the admin API, for operators and tenant admins.

``Console.mount()`` is a Starlette ``Mount``; ``gateway.app`` serves it and
leaves its authentication to it (``AuthMiddleware`` skips ``/console``, whose
callers hold a session cookie rather than a bearer credential). Every read and
change goes through the admin API's own route (``gateway.console.dispatch``),
so RBAC, validation, the other-tenant 404 and the audit record are the API's.

Unauthenticated: a page (GET) redirects to ``/console/login``; a data
endpoint (``/console/api/...``, ``/console/live/events``) and a form post
answer 401 JSON, as the API would. A form post needs the session's CSRF token
(403 ``csrf_failed`` otherwise). The routes are in ``gateway.console.views``
(what they read of a request, and the refusals they answer with, in
``forms``; the live panel's events in ``live``; the usage page in ``usage_page``, its SVG charts in
``charts``; tenants' names in ``names``); sessions in ``sessions``, the
CSP and its reports in ``security``, OIDC sign-in in ``oidc``, the throttling
of failed API-key sign-ins (429 with Retry-After per source) in ``throttle``.
"""

from __future__ import annotations

from inferflux.gateway.console.throttle import SignInThrottle
from inferflux.gateway.console.views import Console

__all__ = ["Console", "SignInThrottle"]
