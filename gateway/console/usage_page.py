"""The usage page's contents: the table of ``GET /admin/v1/usage`` and two charts of the same route.

The table is the API's answer for the page's filters, one row per bucket and group, its tenants
by name. The charts draw requests and tokens over time, one line per tenant or per model
(``chart``), from one more call of the same route: by the hour for the page's minute and hour
buckets (the last 24 hours), by the day for its day buckets. A tenant admin's calls name its own
tenant, so what it is shown is the API's answer for that tenant alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.requests import Request

from inferflux.gateway.console.charts import STYLES, Chart, Series, render
from inferflux.gateway.console.dispatch import API_PREFIX, ApiAnswer, call_api
from inferflux.gateway.console.names import TenantNames, tenant_names
from inferflux.policy.rbac import Principal

FILTERS = ("group", "by", "from", "to", "model", "key_id", "tenant_id", "limit", "offset")
CHART_BY = ("tenant", "model")
CHART_ROWS = "1000"  # the API's largest page: the charts read one
MAX_BUCKETS = 400  # a sparse range of days draws its latest 400
# The table's columns: (the API's field, its header). tenant_id shows the tenant's name.
COLUMNS = (("bucket", "bucket"), ("tenant_id", "tenant"), ("key_id", "key"), ("model", "model"),
           ("requests", "requests"), ("refused", "refused"), ("prompt_tokens", "prompt"),
           ("completion_tokens", "completion"), ("total_tokens", "total tokens"), ("cost_usd", "cost (USD)"),
           ("refusals", "refusals"))  # fmt: skip
NUMERIC = frozenset({"requests", "refused", "prompt_tokens", "completion_tokens", "total_tokens", "cost_usd"})


@dataclass
class UsageView:
    filters: dict[str, str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    columns: list[tuple[str, str]] = field(default_factory=list)
    top: float = 1.0  # the largest total_tokens: the meters' scale
    names: TenantNames = field(default_factory=lambda: TenantNames({}))
    chart_by: str = "tenant"
    charts: list[Any] = field(default_factory=list)  # rendered <figure>s
    chart_note: str = ""


async def usage_view(request: Request, principal: Principal) -> UsageView | ApiAnswer:
    """The page's view, or the API's answer when it refused the table's call."""
    params = request.query_params
    query = {k: v for k, v in params.items() if k in FILTERS and v}
    if not principal.is_platform_admin:
        query["tenant_id"] = principal.tenant_id
    answer = await call_api(request, "GET", API_PREFIX + "/usage", query=query)
    if not answer.ok:
        return answer
    view = UsageView(query)
    view.rows = [r for r in (answer.json() or {}).get("data", []) if isinstance(r, dict)]
    present = {k for row in view.rows for k in row}
    view.columns = [(k, title) for k, title in COLUMNS if k in present]
    view.top = max((float(r.get("total_tokens") or 0) for r in view.rows), default=0.0) or 1.0
    view.names = await tenant_names(request, principal)
    default = "tenant" if principal.is_platform_admin else "model"
    view.chart_by = params.get("chart") if params.get("chart") in CHART_BY else default
    await _charts(request, view)
    return view


async def _charts(request: Request, view: UsageView) -> None:
    """Requests and tokens per hour (or day), one line per tenant or model, of the page's filters."""
    daily = view.filters.get("group", "day") == "day"
    query = {k: v for k, v in view.filters.items() if k in ("from", "to", "model", "key_id", "tenant_id")}
    query.update(group="day" if daily else "hour", by=view.chart_by, limit=CHART_ROWS)
    answer = await call_api(request, "GET", API_PREFIX + "/usage", query=query)
    data = answer.json() if answer.ok else None
    if not isinstance(data, dict):  # the table's call answered; this one, the same route, should too
        view.chart_note = answer.error.get("message", f"The charts' data: HTTP {answer.status}")
        return
    rows = [r for r in data.get("data", []) if isinstance(r, dict)]
    if not rows:
        return
    if data.get("next"):
        view.chart_note = f"The charts draw the first {CHART_ROWS} rows of their query; narrow the filters."
    step, label, fmt = (timedelta(days=1), "day (UTC)", "%m-%d") if daily else (timedelta(hours=1), "hour (UTC)", "%H:%M")
    window = (_parsed(view.filters.get("from")), _parsed(view.filters.get("to")))
    buckets = _axis([_when(r["bucket"]) for r in rows], step, *window)
    field_name = "tenant_id" if view.chart_by == "tenant" else "model"
    per = "day" if daily else "hour"
    for measure, title in (("requests", "Requests"), ("total_tokens", "Tokens")):
        series = _series(rows, field_name, measure, view.names)
        chart = Chart(f"{title} per {per}, by {view.chart_by}", title.lower(), label, fmt, buckets, series)
        view.charts.append(render(chart, f"chart-{measure.replace('_', '-')}"))


def _when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _parsed(text: str | None) -> datetime | None:
    """A from or to filter, as the API read it (it refused the page already if it could not)."""
    try:
        return _when(text.upper()) if text else None
    except ValueError:
        return None


def _axis(starts: list[datetime], step: timedelta, since: datetime | None, until: datetime | None,
          now: datetime | None = None) -> tuple[datetime, ...]:  # fmt: skip
    """The page's window in buckets, a quiet bucket a 0: from ``since`` (else the last 24 hours by the hour,
    the last 7 days by the day, or from the first bucket with data) to ``until`` or now, whichever is sooner;
    at most MAX_BUCKETS, the latest."""
    now = now or datetime.now(UTC)
    last = _floor(min(until - timedelta(microseconds=1), now) if until else now, step)
    last = max(last, max(starts))
    hourly = step < timedelta(days=1)
    first = _floor(since, step) if since else last - step * (23 if hourly else 6)  # a day, or a week at least
    if hourly:
        first = max(first, last - step * 23)  # the hours of the minute window
    first = min(first, min(starts))
    count = min(int((last - first) / step) + 1, MAX_BUCKETS)
    return tuple(last - step * i for i in reversed(range(count)))


def _floor(at: datetime, step: timedelta) -> datetime:
    at = at.astimezone(UTC)
    return at.replace(hour=0, minute=0, second=0, microsecond=0) if step >= timedelta(days=1) else \
        at.replace(minute=0, second=0, microsecond=0)


def _series(rows: list[dict[str, Any]], field_name: str, measure: str, names: TenantNames) -> tuple[Series, ...]:
    """One series per tenant or model, the busiest first; past ``STYLES`` of them, the rest as one "other"."""
    values: dict[str, dict[datetime, float]] = {}
    for row in rows:
        key = str(row.get(field_name) or "")
        per_bucket = values.setdefault(key, {})
        bucket = _when(row["bucket"])
        per_bucket[bucket] = per_bucket.get(bucket, 0.0) + float(row.get(measure) or 0)
    order = sorted(values, key=lambda k: (-sum(values[k].values()), k))
    kept, rest = order[: STYLES - 1], order[STYLES - 1 :]
    if len(rest) == 1:
        kept, rest = order, []
    series = [Series(_label(k, field_name, names), values[k]) for k in kept]
    if rest:
        other: dict[datetime, float] = {}
        for k in rest:
            for bucket, v in values[k].items():
                other[bucket] = other.get(bucket, 0.0) + v
        series.append(Series(f"other ({len(rest)})", other))
    return tuple(series)


def _label(key: str, field_name: str, names: TenantNames) -> str:
    if field_name == "tenant_id":
        return names.label(key).text
    return key or "(no model)"
