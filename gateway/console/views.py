"""The console's routes: sign-in and out, the resource pages and their forms, data, usage, the live panel."""

from __future__ import annotations

import json
from datetime import UTC, datetime
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route, Router
from starlette.staticfiles import StaticFiles

from inferflux.gateway.auth import Authenticator
from inferflux.gateway.console.dispatch import API_PREFIX, ApiAnswer, call_api
from inferflux.gateway.console.forms import CsrfFailed, no_route, read_form, safe_next, same_origin, unauthenticated
from inferflux.gateway.console.live import live_events
from inferflux.gateway.console.names import tenant_names, tenant_of
from inferflux.gateway.console.oidc import BINDING_COOKIE, OidcLogin, continue_page
from inferflux.gateway.console.pages import TAIL_PAGES, TAIL_ROWS, TAIL_SECONDS, Page, cell, find_action, find_page, form_body, menu, tenant_links
from inferflux.gateway.console.security import REPORT_PATH, CspReports, SecurityHeaders
from inferflux.gateway.console.sessions import (
    COOKIE,
    IDLE_SECONDS,
    LOGIN_COOKIE,
    SESSION_SECONDS,
    Session,
    SessionStore,
    clear_cookie,
    csrf_matches,
    set_cookie,
)
from inferflux.gateway.console.throttle import SignInThrottle, source_of
from inferflux.gateway.console.usage_page import CHART_BY, NUMERIC, usage_view
from inferflux.gateway.context import get_context
from inferflux.gateway.errors import render_error
from inferflux.gateway.metrics import GatewayMetrics
from inferflux.gateway.state import state_of
from inferflux.policy.audit.events import admin_event
from inferflux.policy.errors import ApiError, AuthenticationError, PolicyError
from inferflux.policy.rbac import Principal, Scope
from inferflux.policy.store import PolicyStore

_HERE = Path(__file__).parent


class Console:
    def __init__(
        self,
        store: PolicyStore,
        authenticator: Authenticator,
        metrics: GatewayMetrics,
        *,
        lifetime: float = SESSION_SECONDS,
        idle: float = IDLE_SECONDS,
        throttle: SignInThrottle | None = None,
    ) -> None:
        self.sessions = SessionStore(store, authenticator, lifetime=lifetime, idle=idle)
        self.throttle = throttle if throttle is not None else SignInThrottle()  # failed API-key sign-ins per source
        self.reports = CspReports()
        self.oidc = OidcLogin(store)
        self.metrics = metrics
        self.templates = Environment(loader=FileSystemLoader(_HERE / "templates"),
                                     autoescape=select_autoescape(default=True))  # fmt: skip
        self.templates.filters["cell"] = cell
        self.templates.globals["tenant_links"] = tenant_links
        metrics.gauge("inferflux_console_csp_violations", "CSP violations browsers reported from console pages",
                      lambda: float(self.reports.count))  # fmt: skip
        metrics.gauge("inferflux_console_sessions", "Console sessions open on this replica",
                      lambda: float(len(self.sessions)))  # fmt: skip

    def mount(self) -> Mount:
        routes: list[BaseRoute] = [
            Route("/", self._page(self.home), methods=["GET"]),
            Route("/login", self.login_form, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", self._action(self.logout), methods=["POST"]),
            Route("/oidc/callback", self.oidc_callback, methods=["GET"]),
            Route("/oidc/{provider_id}/start", self.oidc_start, methods=["GET"]),
            Route(REPORT_PATH.removeprefix("/console"), self.reports.receive, methods=["POST"]),
            Route("/live", self._page(self.live), methods=["GET"]),
            Route("/live/events", self._data(self.live_events), methods=["GET"]),
            Route("/usage", self._page(self.usage), methods=["GET"]),
            Route("/api/{path:path}", self._data(self.data), methods=["GET"]),
            Mount("/static", app=StaticFiles(directory=_HERE / "static"), name="console-static"),
            Route("/{path:path}", self._page(self.resource), methods=["GET"]),
            Route("/{path:path}", self._action(self.act), methods=["POST"]),
        ]
        # Unknown paths and methods raise to the app's handlers: the API's JSON 404 and 405.
        return Mount("/console", app=SecurityHeaders(Router(routes)))

    # -- who is calling ---------------------------------------------------------

    async def _session(self, request: Request) -> Session | None:
        session = await self.sessions.resolve(request.cookies.get(COOKIE))
        if session is not None:
            get_context(request).principal = session.principal
        return session

    def _page(self, view: Callable[[Request, Session], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """A page: without a live session, a redirect to the sign-in page."""

        async def page(request: Request) -> Response:
            session = await self._session(request)
            if session is None:
                return RedirectResponse("/console/login?next=" + quote(request.url.path), status_code=303)
            return await view(request, session)

        return page

    def _data(self, view: Callable[[Request, Session], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """A data endpoint: without a live session, the API's 401."""

        async def data(request: Request) -> Response:
            session = await self._session(request)
            if session is None:
                return unauthenticated(request)
            return await view(request, session)

        return data

    def _action(
        self, view: Callable[[Request, Session, dict[str, str]], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """A form post: a live session (401 JSON), this session's CSRF token and a same-origin request (403)."""

        async def action(request: Request) -> Response:
            session = await self._session(request)
            if session is None:
                return unauthenticated(request)
            form = await read_form(request)
            if not csrf_matches(session.csrf, form.get("csrf")) or not same_origin(request):
                return render_error(CsrfFailed("The form's CSRF token is missing or wrong; reload the page"),
                                    get_context(request).request_id)  # fmt: skip
            return await view(request, session, form)

        return action

    # -- rendering --------------------------------------------------------------

    def render(self, request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        session: Session | None = context.pop("session", None)
        principal = session.principal if session else None
        html = self.templates.get_template(template).render(
            principal=principal, menu=menu(principal) if principal else [], csrf=session.csrf if session else "",
            path=request.url.path, **context,
        )  # fmt: skip
        return HTMLResponse(html, status_code=status)

    def failure(self, request: Request, session: Session | None, answer: ApiAnswer, title: str) -> HTMLResponse:
        error = answer.error
        return self.render(request, "error.html", answer.status, session=session, title=title,
                           message=error.get("message", f"HTTP {answer.status}"), code=error.get("code"))  # fmt: skip

    # -- sign-in ----------------------------------------------------------------

    async def login_form(self, request: Request, *, status: int = 200, message: str = "") -> Response:
        token = request.cookies.get(LOGIN_COOKIE) or secrets.token_urlsafe(32)
        providers = await self.oidc.providers()
        response = self.render(request, "login.html", status, title="Sign in", login_csrf=token, message=message,
                               next=safe_next(request.query_params.get("next")), providers=providers)  # fmt: skip
        set_cookie(response, request, LOGIN_COOKIE, token, 3600)
        return response

    async def login(self, request: Request) -> Response:
        form = await read_form(request)
        expected = request.cookies.get(LOGIN_COOKIE)
        if not expected or not csrf_matches(expected, form.get("csrf")) or not same_origin(request):
            return render_error(CsrfFailed("The sign-in form's CSRF token is missing or wrong; reload the page"),
                                get_context(request).request_id)  # fmt: skip
        source = source_of(request.scope.get("client"))
        wait = self.throttle.retry_after(source)
        if wait is not None:  # refused before the key is looked at: no guess is tried while it waits
            get_context(request).reasons.append("sign_in_throttled")  # the refusal's audit event says why
            response = await self.login_form(request, status=429, message="Too many failed sign-ins from this "
                                             f"address: try again in {wait} s")  # fmt: skip
            response.headers["retry-after"] = str(wait)
            return response
        try:
            principal = await state_of(request).authenticator.authenticate(None, form.get("api_key", ""))
        except AuthenticationError as exc:
            self.throttle.failed(source)
            get_context(request).reasons.append(exc.code)
            return await self.login_form(request, status=exc.status_code, message=exc.message)
        self.throttle.succeeded(source)
        return await self._signed_in(request, principal, None, form.get("next"))

    async def _signed_in(
        self, request: Request, principal: Principal, id_token: str | None, next_path: str | None
    ) -> Response:
        get_context(request).principal = principal
        # On the trail before the session exists: a sign-in the trail cannot take is refused (503).
        await _record(request, principal, "console.sign_in", method="oidc" if id_token else "api_key")
        self.sessions.close(request.cookies.get(COOKIE))  # a session id is never carried over a sign-in
        cookie, _ = self.sessions.open(principal, id_token=id_token)
        target = safe_next(next_path)
        # Back from an identity provider's site: a page of ours moves on (see continue_page).
        response = continue_page(target) if id_token else RedirectResponse(target, status_code=303)
        set_cookie(response, request, COOKIE, cookie, int(self.sessions.lifetime))
        clear_cookie(response, request, LOGIN_COOKIE)
        return response

    async def logout(self, request: Request, session: Session, form: dict[str, str]) -> Response:
        self.sessions.close(request.cookies.get(COOKIE))
        await _record(request, session.principal, "console.sign_out")
        response = RedirectResponse("/console/login", status_code=303)
        clear_cookie(response, request, COOKIE)
        return response

    async def oidc_start(self, request: Request) -> Response:
        try:
            return await self.oidc.start(request, request.path_params["provider_id"])
        except ApiError as exc:
            return await self.login_form(request, status=exc.status_code, message=exc.message)

    async def oidc_callback(self, request: Request) -> Response:
        try:
            id_token, next_path = await self.oidc.finish(request)
            principal = await state_of(request).authenticator.authenticate(f"Bearer {id_token}", None)
        except ApiError as exc:
            return await self.login_form(request, status=exc.status_code, message=exc.message)
        response = await self._signed_in(request, principal, id_token, next_path)
        clear_cookie(response, request, BINDING_COOKIE)
        return response

    # -- pages ------------------------------------------------------------------

    async def home(self, request: Request, session: Session) -> Response:
        answer = await call_api(request, "GET", API_PREFIX + "/whoami")
        if not answer.ok:
            return self.failure(request, session, answer, "Home")
        return self.render(request, "home.html", session=session, title="Home", whoami=answer.json())

    async def resource(self, request: Request, session: Session, **extra: Any) -> Response:
        page_path = request.path_params["path"]  # a list page's, also when an action's answer shows it
        found = find_page(page_path)
        if found is None:
            answer = ApiAnswer(404, json.dumps({"error": {"message": f"No console page {request.url.path}",
                                                          "code": "not_found"}}).encode(), "application/json")
            return self.failure(request, session, answer, "Not found")
        page, values = found
        if page.tail:
            answer, rows = await _tail(request, _api_path(page, values))
        else:
            answer = await call_api(request, "GET", _api_path(page, values), query=page.query)
            rows = answer.json().get("data", []) if answer.ok else []
        if not answer.ok:
            return self.failure(request, session, answer, page.title)
        # Tenants by name: the page's own tenant in its title, a tenant column's ids as names.
        tenant = await tenant_of(request, values["tenant_id"]) if "tenant_id" in values else None
        names = await tenant_names(request, session.principal) if "tenant_id" in page.columns else None
        title = f"{page.title} · {tenant.text}" if tenant is not None else page.title
        return self.render(request, "resource.html", extra.pop("status", 200), session=session, title=title,
                           page=page, rows=rows, base="/console/" + page_path.strip("/"), tenant=tenant,
                           names=names, **extra)  # fmt: skip

    async def act(self, request: Request, session: Session, form: dict[str, str]) -> Response:
        path = request.path_params["path"]
        created = find_page(path)
        if created is not None and created[0].create:
            page, values = created
            body, raw = form_body(page, form)
            answer = await call_api(request, "POST", _api_path(page, values), body, raw=raw)
            base = path
        else:
            found = find_action(path)
            if found is None:
                return render_error(no_route(request), get_context(request).request_id)
            page, values, item, action = found
            target = _api_path(page, values) + "/" + quote(item, safe="")
            if action.api_suffix:
                target += "/" + action.api_suffix
            answer = await call_api(request, action.method, target)
            base = path.rsplit("/", 2)[0]
        request.path_params["path"] = base
        if not answer.ok:
            return await self.resource(request, session, status=answer.status,
                                       message=answer.error.get("message", f"HTTP {answer.status}"))  # fmt: skip
        data = answer.json()
        if isinstance(data, dict) and isinstance(data.get("key"), str):
            # A new key: shown in this answer only (not stored, not in a redirect's URL), never again.
            return await self.resource(request, session, secret=data["key"], secret_prefix=data.get("prefix"))
        return RedirectResponse("/console/" + base, status_code=303)

    async def data(self, request: Request, session: Session) -> Response:
        """``GET /admin/v1/<path>``'s answer as it is: status and JSON (a stream is not relayed: the audit's
        live tail is the API's own ``/admin/v1/audit/stream``; the console would hold it open forever)."""
        if request.path_params["path"].rstrip("/").endswith("/stream"):
            return render_error(no_route(request), get_context(request).request_id)
        query = dict(request.query_params)
        answer = await call_api(request, "GET", API_PREFIX + "/" + request.path_params["path"], query=query)
        return Response(answer.body, status_code=answer.status, media_type=answer.content_type or None)

    async def usage(self, request: Request, session: Session) -> Response:
        view = await usage_view(request, session.principal)
        if isinstance(view, ApiAnswer):
            if view.status == 404 and view.error.get("message", "").startswith("No route"):
                return self.render(request, "usage.html", session=session, title="Usage", missing=True)
            return self.failure(request, session, view, "Usage")
        csv = "/console/api/usage?" + urlencode({**view.filters, "format": "csv"})
        return self.render(request, "usage.html", session=session, title="Usage", missing=False, view=view, csv=csv,
                           numeric=NUMERIC, chart_by=CHART_BY)  # fmt: skip

    async def live(self, request: Request, session: Session) -> Response:
        return self.render(request, "live.html", session=session, title="Live")

    async def live_events(self, request: Request, session: Session) -> Response:
        """Server-sent events, one a second: each model's queue, running sequences, KV blocks, tokens/s."""
        try:
            session.principal.require(Scope.READ)
        except PolicyError as exc:
            return render_error(exc, get_context(request).request_id)
        events = live_events(state_of(request), self.metrics, session.principal.allowed_models)
        return StreamingResponse(events, media_type="text/event-stream", headers={"cache-control": "no-store"})


async def _tail(request: Request, path: str) -> tuple[ApiAnswer, list[dict[str, Any]]]:
    """The newest events of the last TAIL_SECONDS, newest first: the API's pages (oldest first) walked forward."""
    since = datetime.fromtimestamp(time.time() - TAIL_SECONDS, UTC).isoformat().replace("+00:00", "Z")
    query = {"since": since, "limit": str(TAIL_ROWS)}
    rows: list[dict[str, Any]] = []
    for _ in range(TAIL_PAGES):
        answer = await call_api(request, "GET", path, query=query)
        if not answer.ok:
            return answer, []
        page = answer.json()
        rows = (rows + page.get("data", []))[-TAIL_ROWS:]
        if not page.get("next_cursor"):
            break
        query["after"] = page["next_cursor"]
    return answer, rows[::-1]


async def _record(request: Request, principal: Principal, action: str, **detail: Any) -> None:
    """A console sign-in or sign-out as an admin event (the changes made in the console are the API's own)."""
    event = admin_event(principal=principal.subject, action=action, target_kind="console_session",
                        target_id=principal.subject, tenant_id=principal.tenant_id, detail=detail or None,
                        key_id=principal.key_id, request_id=get_context(request).request_id,
                        route=f"{request.method} {request.url.path}")  # fmt: skip
    trail = state_of(request).audit_trail
    if trail is not None:
        await trail.record(event)


def _api_path(page: Page, values: dict[str, str]) -> str:
    path = API_PREFIX + "/" + page.pattern
    for name, value in values.items():
        path = path.replace("{" + name + "}", quote(value, safe=""))
    return path
