"""Usage, spend and prices: ``/admin/v1/usage`` and ``/admin/v1/prices``.

* ``GET /admin/v1/usage``: requests, tokens, refusals by reason, calls the client
  left (``cancelled``, 499: not refusals) and cost per
  bucket (``group`` ``day``, or ``hour`` or ``minute`` for the last 24 hours) and per the
  fields in ``by`` (``tenant``, ``key``, ``model``), filtered by ``tenant_id``,
  ``key_id``, ``model``, ``from`` and ``to`` (bucket starts in [from, to)).
  ``admin:tenant``: a tenant admin sees its own tenant (naming another answers
  404, as everywhere in the admin API); a platform admin every tenant, or one.
  Pages by ``limit`` and ``offset``, with a ``next`` link; ``format=csv`` (or
  ``Accept: text/csv``) answers CSV.
* ``/admin/v1/prices[/{model}]``: the price table (micro-dollar exact; given and
  shown in dollars per million tokens), ``admin:platform`` only: what a model
  costs is the platform's to say. Writes are audited like every admin change.

Usage is rolled up from the audit trail as it is indexed (``policy.usage.rollup``),
so it is exactly the sum of the indexed audit events, a moment behind the requests.
Budgets are traffic policies of kind ``budget`` (``policies.py``).
"""

from __future__ import annotations

import csv
import io
import re
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from inferflux.gateway.auth import call_store
from inferflux.gateway.authz import principal_of, requires
from inferflux.gateway.openapi import document, query_param
from inferflux.gateway.routes.admin.common import BODY, PREFIX, jsonable, ok, parse_body, record_change
from inferflux.gateway.state import state_of
from inferflux.policy.errors import ValidationFailed
from inferflux.policy.rbac import Scope
from inferflux.policy.usage.cost import Price, format_usd, parse_usd
from inferflux.policy.usage.buckets import GRAINS
from inferflux.policy.usage.store import GROUPS, MAX_PAGE, PriceRecord, UsageItem

_QUERY = frozenset({"tenant_id", "key_id", "model", "from", "to", "group", "by", "limit", "offset", "format"})
_DIGITS = re.compile(r"[0-9]{1,9}")
_MAX_TEXT = 255
_USD = {"type": ["string", "integer"], "description": "US dollars, a decimal string such as \"0.15\" or an integer"}
_USAGE_DOCS = (
    query_param("tenant_id", {"type": "string", "maxLength": 64}, "One tenant (tenant admins: only their own)"),
    query_param("key_id", {"type": "string", "maxLength": 64}, "One API key"),
    query_param("model", {"type": "string", "maxLength": _MAX_TEXT}, "One model"),
    query_param("from", {"type": "string", "format": "date-time"}, "Buckets starting at or after (RFC 3339)"),
    query_param("to", {"type": "string", "format": "date-time"}, "Buckets starting before (RFC 3339)"),
    query_param("group", {"type": "string", "enum": list(GRAINS)}, "Bucket size (hour, minute: the last 24 hours)"),
    query_param("by", {"type": "string", "maxLength": 20}, "Comma-separated fields among tenant, key, model"),
    query_param("limit", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}, "Rows per page (100)"),
    query_param("offset", {"type": "integer", "minimum": 0}, "Rows to skip"),
    query_param("format", {"type": "string", "enum": ["json", "csv"]}, "json (default) or csv"),
)
_FIELD_NAMES = {"tenant": "tenant_id", "key": "key_id", "model": "model"}


class PriceBody(BaseModel):
    model_config = BODY
    prompt_usd_per_million: str | int = Field(json_schema_extra=_USD)
    completion_usd_per_million: str | int = Field(json_schema_extra=_USD)


def _text(request: Request, name: str) -> str | None:
    value = request.query_params.get(name)
    if value is not None and not 1 <= len(value) <= _MAX_TEXT:
        raise ValidationFailed(f"{name} must be 1 to {_MAX_TEXT} characters", param=name)
    return value


def _time(request: Request, name: str) -> datetime | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        value = datetime.fromisoformat(raw.upper()) if len(raw) <= 40 and "T" in raw.upper() else None
    except ValueError:
        value = None
    if value is None or value.tzinfo is None:
        raise ValidationFailed(f"{name} must be an RFC 3339 date-time with a time zone, e.g. 2026-11-01T00:00:00Z",
                               param=name)  # fmt: skip
    return value


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name, str(default))
    if not _DIGITS.fullmatch(raw) or not low <= int(raw) <= high:
        raise ValidationFailed(f"{name} must be an integer from {low} to {high}", param=name)
    return int(raw)


def _usage_args(request: Request) -> dict[str, Any]:
    unknown = sorted(set(request.query_params) - _QUERY)
    if unknown:
        raise ValidationFailed(f"unknown query parameter(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_QUERY))}",
                               param=unknown[0])  # fmt: skip
    principal = principal_of(request)
    tenant_id = _text(request, "tenant_id")
    if tenant_id is not None:
        principal.require_tenant(tenant_id)  # another tenant's: 404
    elif not principal.is_platform_admin:
        tenant_id = principal.tenant_id
    grain = request.query_params.get("group", "day")
    if grain not in GRAINS:
        raise ValidationFailed(f"group must be one of {', '.join(GRAINS)}", param="group")
    by_raw = request.query_params.get("by", "tenant")
    by = tuple(part for part in by_raw.split(",") if part) if by_raw else ()
    if len(by_raw) > 20 or any(part not in GROUPS for part in by) or len(set(by)) != len(by):
        raise ValidationFailed(f"by must be distinct comma-separated fields among {', '.join(GROUPS)}", param="by")
    since, until = _time(request, "from"), _time(request, "to")
    if since is not None and until is not None and until <= since:
        raise ValidationFailed("to must be later than from", param="to")
    return {"tenant_id": tenant_id, "key_id": _text(request, "key_id"), "model": _text(request, "model"),
            "since": since, "until": until, "grain": grain, "group_by": by,
            "limit": _int(request, "limit", 100, 1, MAX_PAGE), "offset": _int(request, "offset", 0, 0, 10**9)}  # fmt: skip


def _row(item: UsageItem) -> dict[str, Any]:
    refused = sum(item.refusals.values())
    return {
        "object": "usage",
        "bucket": jsonable(item.bucket),
        **{_FIELD_NAMES[g]: v for g, v in item.group.items()},
        "requests": item.requests,
        "refused": refused,
        "cancelled": item.cancelled,
        "prompt_tokens": item.prompt_tokens,
        "completion_tokens": item.completion_tokens,
        "total_tokens": item.prompt_tokens + item.completion_tokens,
        "cost_usd": format_usd(item.cost_micros),
        "refusals": dict(sorted(item.refusals.items())),
    }


def _csv(rows: list[dict[str, Any]], group_by: tuple[str, ...]) -> Response:
    columns = ["bucket", *(_FIELD_NAMES[g] for g in group_by), "requests", "refused", "cancelled", "prompt_tokens",
               "completion_tokens", "total_tokens", "cost_usd", "refusals"]  # fmt: skip
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(columns)
    for row in rows:
        refusals = ";".join(f"{reason}={n}" for reason, n in row["refusals"].items())
        writer.writerow([_cell(row[c]) for c in columns[:-1]] + [_cell(refusals)])
    return Response(out.getvalue(), media_type="text/csv; charset=utf-8")


def _cell(value: Any) -> Any:
    # A spreadsheet runs a cell that starts with = + - @ as a formula: reasons and model names are not ours.
    text = str(value)
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else value


@document("Usage and spend per bucket (day, or hour or minute for the last 24 h) grouped by tenant, key and/or model; "
          "tenant admins see their own tenant", tag="usage", query=_USAGE_DOCS)  # fmt: skip
@requires(Scope.ADMIN_TENANT)
async def get_usage(request: Request) -> Response:
    args = _usage_args(request)
    as_csv = request.query_params.get("format") == "csv" or (
        "format" not in request.query_params and "text/csv" in request.headers.get("accept", "")
    )
    if request.query_params.get("format") not in (None, "json", "csv"):
        raise ValidationFailed("format must be json or csv", param="format")
    items, more = await call_store(state_of(request).traffic.usage.query, **args)
    rows = [_row(item) for item in items]
    if as_csv:
        return _csv(rows, args["group_by"])
    following = None
    if more:
        query = dict(request.query_params)
        query["offset"] = str(args["offset"] + args["limit"])
        following = f"{request.url.path}?{urlencode(query)}"
    return ok({"object": "list", "data": rows, "next": following})


def _price(record: PriceRecord) -> dict[str, Any]:
    return {
        "object": "model_price",
        "model": record.model,
        "prompt_usd_per_million": format_usd(record.price.prompt),
        "completion_usd_per_million": format_usd(record.price.completion),
        "updated_at": jsonable(record.updated_at),
    }


def _model(request: Request) -> str:
    model = request.path_params["model"]
    if not 1 <= len(model) <= _MAX_TEXT:
        raise ValidationFailed(f"model must be 1 to {_MAX_TEXT} characters", param="model")
    return model


@document("The price table: dollars per million prompt and completion tokens per model", tag="usage")
@requires(Scope.ADMIN_PLATFORM)
async def list_prices(request: Request) -> Response:
    prices = await call_store(state_of(request).traffic.usage.prices)
    return ok({"object": "list", "data": [_price(p) for p in prices.values()], "next_cursor": None})


@document("A model's price", tag="usage")
@requires(Scope.ADMIN_PLATFORM)
async def get_price(request: Request) -> Response:
    return ok(_price(await call_store(state_of(request).traffic.usage.get_price, _model(request))))


@document("Set a model's price (201 when new); it prices requests and usage from now on", tag="usage",
          body=PriceBody)  # fmt: skip
@requires(Scope.ADMIN_PLATFORM)
async def put_price(request: Request) -> Response:
    model = _model(request)
    body = await parse_body(request, PriceBody)
    price = Price(parse_usd(body.prompt_usd_per_million, "prompt_usd_per_million"),
                  parse_usd(body.completion_usd_per_million, "completion_usd_per_million"))  # fmt: skip
    traffic = state_of(request).traffic
    record, created = await call_store(traffic.usage.set_price, model, price)
    traffic.prices.invalidate()
    await record_change(request, principal_of(request), "price.set", None, "model_price", model,
                        prompt_usd_per_million=format_usd(price.prompt),
                        completion_usd_per_million=format_usd(price.completion))  # fmt: skip
    return ok(_price(record), 201 if created else 200)


@document("Delete a model's price (its requests cost nothing from now on)", tag="usage", status=204)
@requires(Scope.ADMIN_PLATFORM)
async def delete_price(request: Request) -> Response:
    model = _model(request)
    traffic = state_of(request).traffic
    await call_store(traffic.usage.delete_price, model)
    traffic.prices.invalidate()
    await record_change(request, principal_of(request), "price.delete", None, "model_price", model)
    return Response(status_code=204)


def routes() -> list[BaseRoute]:
    one = PREFIX + "/prices/{model}"
    return [
        Route(PREFIX + "/usage", get_usage, methods=["GET"]),
        Route(PREFIX + "/prices", list_prices, methods=["GET"]),
        Route(one, get_price, methods=["GET"]),
        Route(one, put_price, methods=["PUT"]),
        Route(one, delete_price, methods=["DELETE"]),
    ]
