"""What the console shows: one ``Page`` per admin resource, each the view of one admin API list route.

A page's console path mirrors its API path (``/console/tenants/{id}/keys`` is
``GET /admin/v1/tenants/{id}/keys``), its forms post to the same path (create)
or to ``<path>/<item>/<action>`` (revoke, delete, ...), and every one of them
is answered by the API route of that path (``gateway.console.dispatch``). The
forms name the API body's fields; a field left empty is left out, and nothing
is coerced (a number that is not one goes to the API as text and is refused
there, with the API's message). Resources whose bodies are nested (limits,
guardrails, identity providers, model loads) take their JSON body as is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from inferflux.policy.rbac import ROLE_NAMES, Principal, Scope


@dataclass(frozen=True)
class Field:
    name: str
    label: str
    kind: str = "text"  # text | number | select | list (comma separated) | json (the whole body)
    options: tuple[str, ...] = ()
    required: bool = False


@dataclass(frozen=True)
class Action:
    name: str  # the console path's last segment
    label: str
    method: str  # the API call: POST <item>/<api_suffix>, or DELETE <item>
    api_suffix: str | None = None
    unless: str | None = None  # hidden on rows where this field is set (a revoked key)
    danger: bool = False


@dataclass(frozen=True)
class Page:
    key: str
    title: str
    pattern: str  # the console path after /console/, with {tenant_id}
    columns: tuple[str, ...]
    create: tuple[Field, ...] = ()
    actions: tuple[Action, ...] = ()
    id_field: str = "id"
    query: dict[str, str] = field(default_factory=dict)
    scope: Scope = Scope.ADMIN_TENANT  # for the menu only: the API route decides
    note: str = ""
    tail: bool = False  # the audit log: its newest events first (the API pages oldest first)

    @property
    def regex(self) -> re.Pattern[str]:
        return re.compile("^" + self.pattern.replace("{tenant_id}", "(?P<tenant_id>[^/]+)") + "$")

    def action(self, name: str) -> Action | None:
        return next((a for a in self.actions if a.name == name), None)


TAIL_SECONDS = 900
TAIL_ROWS = 200
TAIL_PAGES = 20
TAIL_NOTE = (f"The newest {TAIL_ROWS} events of the last {TAIL_SECONDS // 60} minutes, newest first "
             f"(at most {TAIL_PAGES * TAIL_ROWS} scanned); refreshed every 5 s. GET /admin/v1/.../audit has the rest.")
_ROLES = tuple(reversed(ROLE_NAMES))  # the least privilege first: what a form left alone grants
_JSON = (Field("body", "JSON body, as the admin API takes it", "json", required=True),)
_DELETE = Action("delete", "Delete", "DELETE", danger=True)
_POLICY_COLUMNS = ("id", "name", "kind", "model", "enabled", "updated_at")

PAGES: tuple[Page, ...] = (
    Page("tenants", "Tenants", "tenants", ("name", "display_name", "id", "disabled", "allowed_models"),
         create=(Field("name", "Name (lower-case slug)", required=True), Field("display_name", "Display name"),
                 Field("allowed_models", "Allowed models (comma separated; empty: all)", "list")),
         actions=(_DELETE,), scope=Scope.ADMIN_PLATFORM),
    Page("keys", "API keys", "tenants/{tenant_id}/keys",
         ("prefix", "name", "role", "created_at", "expires_at", "revoked_at", "last_used_at"),
         create=(Field("name", "Name", required=True), Field("role", "Role", "select", _ROLES, required=True),
                 Field("expires_in_seconds", "Expires in (seconds; empty: never)", "number"),
                 Field("allowed_models", "Allowed models (comma separated; empty: the tenant's)", "list")),
         actions=(Action("revoke", "Revoke", "POST", "revoke", unless="revoked_at", danger=True),
                  Action("rotate", "Rotate", "POST", "rotate", unless="revoked_at"))),
    Page("role-bindings", "Role bindings", "tenants/{tenant_id}/role-bindings",
         ("id", "provider_id", "kind", "subject", "role", "created_at"),
         create=(Field("provider_id", "Identity provider id", required=True),
                 Field("kind", "Kind", "select", ("subject", "group"), required=True),
                 Field("subject", "Subject or group", required=True),
                 Field("role", "Role", "select", _ROLES, required=True)),
         actions=(_DELETE,)),
    Page("limits", "Limits", "tenants/{tenant_id}/policies", _POLICY_COLUMNS, create=_JSON, actions=(_DELETE,),
         note="Rate limits and quotas of this tenant (POST /admin/v1/tenants/{id}/policies)."),
    Page("audit", "Audit", "tenants/{tenant_id}/audit",
         ("at", "kind", "principal", "route", "status", "decision", "action", "reasons"), tail=True,
         note=TAIL_NOTE),
    Page("idps", "Identity providers", "oidc-providers", ("id", "name", "issuer", "audience", "client_id", "enabled"),
         create=_JSON, actions=(_DELETE,)),
    Page("models", "Models", "models", ("id", "status", "stage", "elapsed_seconds", "backend", "default", "error"),
         create=_JSON, actions=(Action("default", "Make default", "POST", "default"),
                                Action("unload", "Unload", "DELETE", danger=True)),
         scope=Scope.ADMIN_PLATFORM,
         note='Load: {"name": ..., "path": ...} or {"name": ..., "backend": "openai", "upstream": {...}}.'),
    Page("guardrails", "Guardrails", "guardrails", _POLICY_COLUMNS, create=_JSON, actions=(_DELETE,),
         scope=Scope.ADMIN_PLATFORM),
    Page("global-limits", "Global limits", "policies", _POLICY_COLUMNS, create=_JSON, actions=(_DELETE,),
         scope=Scope.ADMIN_PLATFORM),
    Page("all-audit", "Audit (all tenants)", "audit",
         ("at", "tenant_id", "kind", "principal", "route", "status", "decision", "action", "reasons"), tail=True,
         scope=Scope.ADMIN_PLATFORM, note=TAIL_NOTE),
)


def find_page(path: str) -> tuple[Page, dict[str, str]] | None:
    """The page whose pattern is ``path`` (after /console/), with its path values."""
    for page in PAGES:
        match = page.regex.match(path)
        if match:
            return page, match.groupdict()
    return None


def find_action(path: str) -> tuple[Page, dict[str, str], str, Action] | None:
    """``<page path>/<item>/<action>``: the page, its path values, the item and the action."""
    head, _, name = path.rpartition("/")
    head, _, item = head.rpartition("/")
    found = find_page(head)
    if found is None or not item:
        return None
    action = found[0].action(name)
    return None if action is None else (found[0], found[1], item, action)


def form_body(page: Page, form: dict[str, str]) -> tuple[Any, bytes | None]:
    """The API body of a create form: (fields, None), or (None, raw JSON) for a JSON-body form."""
    if any(f.kind == "json" for f in page.create):
        return None, form.get("body", "").encode()
    body: dict[str, Any] = {}
    for f in page.create:
        value = form.get(f.name, "").strip()
        if not value:
            continue
        if f.kind == "number":
            body[f.name] = int(value) if re.fullmatch(r"-?[0-9]{1,18}", value) else value
        elif f.kind == "list":
            body[f.name] = [v.strip() for v in value.split(",") if v.strip()]
        else:
            body[f.name] = value
    return body, None


def tenant_links(tenant_id: str) -> list[tuple[str, str]]:
    """(title, console path) of the pages of one tenant (its keys, role bindings, limits, audit)."""
    return [(p.title, "/console/" + p.pattern.replace("{tenant_id}", tenant_id)) for p in PAGES
            if "{tenant_id}" in p.pattern]  # fmt: skip


def menu(principal: Principal) -> list[tuple[str, str]]:
    """(title, console path) of the pages this principal's scopes reach; the API still decides each call."""
    entries = [("Home", "/console/")]
    tenant = principal.tenant_id
    for page in PAGES:
        if principal.has(page.scope):
            entries.append((page.title, "/console/" + page.pattern.replace("{tenant_id}", tenant)))
    if principal.has(Scope.ADMIN_TENANT):
        entries.append(("Usage", "/console/usage"))
    entries.append(("Live", "/console/live"))
    return entries


def cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)
