"""The Grafana dashboard (deploy/grafana/inferflux.json): every query names metrics the gateway exports.

The names exported are read from a real scrape of a running app's ``/metrics`` (after a few
requests, so that the labelled series exist), not from a list kept here: a metric renamed or
dropped in the code fails this test until the dashboard follows. A counter ``x`` is queried as
``x_total``, a histogram as ``x_bucket``, ``x_sum`` and ``x_count``; the scrape's ``# TYPE``
lines say which family is which, also for families with no sample yet (no model is served here).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from admin_seed import seed_store

from inferflux.gateway.app import create_app
from inferflux.gateway.models.served import ModelManager
from inferflux.gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "inferflux.json"

_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("_sum", "_count", "_created"), "gauge": ("",), "untyped": ("",)}  # fmt: skip
# PromQL's words that are not metric names.
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                       "unless", "offset", "inf", "nan"})  # fmt: skip
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers outside strings, label matchers, ranges,
    grouping clauses and function calls (a Grafana variable such as ``$model`` is not one)."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries' steps
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables
    return {name for name in _IDENT.findall(text) if name.lower() not in _KEYWORDS}


def exported(scrape: str) -> set[str]:
    """Every sample name ``scrape`` (Prometheus text format) has or, per its ``# TYPE`` lines, can have."""
    names: set[str] = set()
    for line in scrape.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            base = re.sub(r"_total$", "", family) if kind == "counter" else family
            names.update(base + suffix for suffix in _SUFFIXES.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target (rows' nested panels included) and every query variable."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
        for panel in panels:
            for target in panel.get("targets", ()):
                yield f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]
            yield from walk(panel.get("panels", []))

    yield from walk(dashboard["panels"])
    for variable in dashboard.get("templating", {}).get("list", ()):
        if variable.get("type") == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", text.strip())
            yield f"variable {variable['name']!r}", inner.group(1) if inner else text


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data_dir = tmp_path_factory.mktemp("grafana")
    seeded = seed_store(data_dir)
    try:
        app = create_app(Settings(data_dir=data_dir / "app"), ModelManager(expected=[]), store=seeded.store, owns_models=False)
        with TestClient(app) as client:
            assert client.get("/v1/models", headers=seeded.admin).status_code == 200
            assert client.get("/v1/models").status_code == 401  # a refusal: the labelled series exist
            answer = client.get("/metrics")
            assert answer.status_code == 200
            yield answer.text
    finally:
        seeded.store.close()


def test_the_extraction_finds_metric_names_and_nothing_else() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, route) (rate(a_bucket{route=~"/v1/.*", x="by(b)"}[$__rate_interval])))'
            ' / on (model) group_left (tenant) sum without (pod) (b_total offset 5m) + c > bool 1')  # fmt: skip
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}
    variable = {"type": "query", "name": "m", "query": {"query": "label_values(x_total, model)"}}
    assert list(queries({"panels": [], "templating": {"list": [variable]}})) == [("variable 'm'", "x_total")]
    assert exported("# TYPE h histogram\n# TYPE c_total counter\ng 1\n") >= {"h_bucket", "h_count", "c_total", "g"}


def test_every_dashboard_query_names_an_exported_metric(scrape: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = exported(scrape)
    found = list(queries(dashboard))
    assert len(found) >= 20, "the dashboard lost its panels"
    unknown = {where: sorted(metric_names(expr) - names) for where, expr in found}
    assert not {w: u for w, u in unknown.items() if u}, "metrics the server does not export"
    assert all(metric_names(expr) for _, expr in found), "a query that reads no metric"
    # Grafana needs a unique id per panel, and the datasource variable to bind every query.
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(p.get("datasource", {}).get("uid") == "${datasource}" for p in dashboard["panels"] if p["type"] != "row")


def test_the_dashboard_covers_the_serving_signals(scrape: str) -> None:
    """What an operator looks at first, each on some panel: a metric dropped from the dashboard fails here."""
    read = set().union(*(metric_names(expr) for _, expr in queries(json.loads(DASHBOARD.read_text()))))
    for name in ("inferflux_http_requests_total", "inferflux_http_request_duration_seconds_bucket",
                 "inferflux_time_to_first_token_seconds_bucket", "inferflux_completion_tokens_total",
                 "inferflux_engine_waiting_sequences", "inferflux_kv_blocks_used", "inferflux_ratelimit_denied_total",
                 "inferflux_guardrail_findings_total", "inferflux_audit_spool_healthy",
                 "inferflux_policy_serving_stale"):  # fmt: skip
        assert name in read, name
