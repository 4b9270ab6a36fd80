"""The console's SVG charts (gateway/console/charts.py) and the usage page's series and axis (usage_page.py):
each point sits where its value puts it, series differ by more than colour, nothing needs inline style."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from xml.etree import ElementTree

import pytest

from inferflux.gateway.console.charts import (
    DASHES, MARKERS, PLOT_H, TOP, Chart, Series, marker, nice_ceiling, number, render
)
from inferflux.gateway.console.names import TenantNames
from inferflux.gateway.console.usage_page import _axis, _series

SVG = "{http://www.w3.org/2000/svg}"
HOURS = tuple(datetime(2026, 12, 7, h, tzinfo=UTC) for h in range(6))


def _parse(markup: str) -> ElementTree.Element:
    # The figure as XML (the SVG's own namespace, which HTML implies, made explicit for the parser).
    return ElementTree.fromstring(str(markup).replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1)
                                  .replace('<svg class="key"', '<svg xmlns="http://www.w3.org/2000/svg" class="key"'))


def test_points_sit_where_their_values_put_them() -> None:
    values = {"acme": {HOURS[0]: 3, HOURS[2]: 7}, "glo<bex": {HOURS[1]: 1250, HOURS[5]: 10}}
    chart = Chart("Requests per hour", "requests", "hour (UTC)", "%H:%M", HOURS,
                  tuple(Series(k, {b: float(v) for b, v in d.items()}) for k, d in values.items()))  # fmt: skip
    figure = _parse(render(chart, "c"))
    points = figure.findall(f".//{SVG}g[@data-series]")
    assert len(points) == 2 * len(HOURS)  # a quiet bucket is a point at 0
    assert chart.top == 2000  # the nice ceiling above 1250
    for point in points:
        value = float(point.get("data-value"))  # type: ignore[arg-type]
        bucket = datetime.fromisoformat(point.get("data-bucket"))  # type: ignore[arg-type]
        assert value == values[point.get("data-series")].get(bucket, 0)  # type: ignore[index]
        shape = point[0]
        y = float(shape.get("cy") or float(shape.get("y", 0)) + 3.2)  # a circle's centre, a square's corner
        if shape.tag == f"{SVG}circle" or shape.tag == f"{SVG}rect":
            assert y == pytest.approx(TOP + PLOT_H * (1 - value / 2000), abs=0.1)
        assert point.find(f"{SVG}title") is not None
    # The lines run through the same points, oldest bucket first.
    for line, label in zip(figure.findall(f".//{SVG}polyline"), values, strict=True):
        ys = [float(p.split(",")[1]) for p in line.get("points", "").split()]
        expected = [TOP + PLOT_H * (1 - values[label].get(b, 0) / 2000) for b in HOURS]
        assert ys == pytest.approx(expected, abs=0.1)
    assert "glo&lt;bex" in render(chart, "c")  # labels are escaped


def test_series_differ_without_colour_and_carry_no_inline_style() -> None:
    series = tuple(Series(f"s{k}", {HOURS[0]: float(k)}) for k in range(len(DASHES)))
    markup = str(render(Chart("t", "tokens", "hour (UTC)", "%H:%M", HOURS[:2], series), "c"))
    assert "style=" not in markup and "<script" not in markup and "href" not in markup
    figure = _parse(markup)
    lines = figure.findall(f"./{SVG}svg/{SVG}polyline")
    assert len({line.get("stroke-dasharray") for line in lines}) == len(DASHES)  # a dash pattern each
    assert len({marker(shape, 0, 0) for shape in MARKERS}) == len(MARKERS) == len(DASHES)  # a marker shape each
    first = {g.get("data-series"): ElementTree.tostring(g[0]) for g in figure.findall(f".//{SVG}g[@data-series]")
             if g.get("data-bucket") == HOURS[1].isoformat()}  # every series at 0 there: only the shapes differ
    assert len(set(first.values())) == len(series)
    legend = figure.findall(".//li")
    assert [li.text or "".join(li.itertext()) for li in legend] == [s.label for s in series]
    # The axes say what they show.
    texts = ["".join(t.itertext()) for t in figure.iter(f"{SVG}text")]
    assert "tokens" in texts and "hour (UTC)" in texts and "01:00" in texts


def test_nice_ceilings_and_short_numbers() -> None:
    assert [nice_ceiling(v) for v in (0, 0.4, 1, 3, 7, 12, 1250, 2100, 9000)] == [1, 1, 1, 5, 10, 20, 2000, 2500, 10000]
    assert [number(v) for v in (0, 3, 0.25, 1250, 2_500_000)] == ["0", "3", "0.25", "1.25k", "2.5M"]


def test_the_axis_spans_the_window_and_the_series_fold_the_rest() -> None:
    now = datetime(2026, 12, 7, 22, 40, tzinfo=UTC)
    last = now.replace(minute=0)
    hours = _axis([last - timedelta(hours=3)], timedelta(hours=1), None, None, now)
    assert len(hours) == 24 and hours[-1] == last and hours[0] == last - timedelta(hours=23)
    november = [datetime(2026, 11, d, tzinfo=UTC) for d in range(1, 6)]
    days = _axis([november[2]], timedelta(days=1), november[0], november[4], now)
    assert days == tuple(november[:4])  # [from, to) by the day
    week = _axis([last.replace(hour=0)], timedelta(days=1), None, None, now)
    assert len(week) == 7 and week[-1] == last.replace(hour=0)
    rows = [{"bucket": "2026-12-07T22:00:00Z", "tenant_id": f"ten_{i}", "requests": i} for i in range(1, 9)]
    rows.append({"bucket": "2026-12-07T22:00:00Z", "tenant_id": "ten_8", "requests": 2})
    folded = _series(rows, "tenant_id", "requests", TenantNames({"ten_8": "acme"}))
    assert [s.label for s in folded] == ["acme", "ten_7", "ten_6", "ten_5", "ten_4", "other (3)"]
    assert folded[0].values == {datetime(2026, 12, 7, 22, tzinfo=UTC): 10.0}  # two rows of one bucket add up
    assert sum(folded[-1].values.values()) == 1 + 2 + 3
