"""Line charts as inline SVG, drawn on the server: no script, no external asset, no inline style.

The console's CSP (``security.py``) allows no inline style, so the markup carries geometry and
SVG presentation attributes only, and the colours come from console.css by class (``s0`` ...).
Each series has a colour, a dash pattern and a marker shape of its own, so a chart reads without
colour as well; every point holds its value in a ``<title>`` (the browser's tooltip) and in
``data-`` attributes, and the legend names each series beside its line and marker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from html import escape

from markupsafe import Markup

WIDTH, HEIGHT = 600, 240
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 14, 46
PLOT_W, PLOT_H = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
DASHES = ("", "7 3", "2 3", "9 3 2 3", "1 4", "12 4")
MARKERS = ("circle", "square", "triangle", "diamond", "cross", "down")
STYLES = len(DASHES)  # console.css colours .s0 to .s5; a chart shows at most this many series
X_TICKS = 6


@dataclass(frozen=True)
class Series:
    label: str
    values: dict[datetime, float]  # bucket -> value; a bucket missing is 0


@dataclass(frozen=True)
class Chart:
    title: str
    y_label: str
    x_label: str
    x_format: str  # strftime of the x axis' tick labels
    buckets: tuple[datetime, ...]  # the x axis, oldest first, evenly spaced
    series: tuple[Series, ...]

    @property
    def top(self) -> float:
        highest = max((s.values.get(b, 0.0) for s in self.series for b in self.buckets), default=0.0)
        return nice_ceiling(highest)

    def x(self, index: int) -> float:
        n = len(self.buckets)
        return LEFT + (PLOT_W * index / (n - 1) if n > 1 else PLOT_W / 2)

    def y(self, value: float) -> float:
        return TOP + PLOT_H * (1 - value / self.top)


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2, 2.5 or 5 times a power of ten at or above ``value`` (1 at least): the y axis' top."""
    if value <= 1:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= value)


def number(value: float) -> str:
    """A tick's or a point's value, short: 1250 -> 1.25k."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}" if value != int(value) else str(int(value))


def render(chart: Chart, chart_id: str) -> Markup:
    """The chart's ``<figure>``: the SVG (axes, grid, a line and markers per series) and its legend."""
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-labelledby="{chart_id}-title">',
             f'<title id="{chart_id}-title">{escape(chart.title)}</title>', *_axes(chart)]  # fmt: skip
    for k, series in enumerate(chart.series):
        points = [(chart.x(i), chart.y(series.values.get(b, 0.0))) for i, b in enumerate(chart.buckets)]
        parts.append(f'<polyline class="line s{k}" fill="none" stroke-width="2"{_dash(k)} '
                     f'points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in points)}"/>')  # fmt: skip
        for bucket, (x, y) in zip(chart.buckets, points, strict=True):
            value = series.values.get(bucket, 0.0)
            tip = f"{series.label} · {bucket.strftime(chart.x_format)}: {number(value)} {chart.y_label}"
            data = (f'class="point s{k}" data-series="{escape(series.label)}" '
                    f'data-bucket="{bucket.isoformat()}" data-value="{value:g}"')  # fmt: skip
            parts.append(f"<g {data}>{marker(MARKERS[k], x, y)}<title>{escape(tip)}</title></g>")
    parts.append("</svg>")
    legend = "".join(f'<li><svg class="key" viewBox="0 0 36 12" aria-hidden="true"><line class="line s{k}" '
                     f'x1="2" y1="6" x2="34" y2="6" stroke-width="2"{_dash(k)}/>{marker(MARKERS[k], 18, 6)}</svg>'
                     f"{escape(s.label)}</li>" for k, s in enumerate(chart.series))  # fmt: skip
    return Markup(f'<figure class="chart" id="{chart_id}"><figcaption>{escape(chart.title)}</figcaption>'
                  f'{"".join(parts)}<ul class="legend">{legend}</ul></figure>')  # fmt: skip


def _dash(k: int) -> str:
    return f' stroke-dasharray="{DASHES[k]}"' if DASHES[k] else ""


def _axes(chart: Chart) -> list[str]:
    """The grid, the y ticks (0 to the top, in quarters), the x ticks and both axes' titles."""
    out = []
    for q in range(5):
        value = chart.top * q / 4
        y = chart.y(value)
        out.append(f'<line class="grid" x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + PLOT_W}" y2="{y:.1f}"/>'
                   f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{number(value)}</text>')  # fmt: skip
    n = len(chart.buckets)
    every = max(1, math.ceil(n / X_TICKS))
    for i in range(n - 1, -1, -every):  # the latest bucket labelled, and every few before it
        x = chart.x(i)
        out.append(f'<line class="axis" x1="{x:.1f}" y1="{TOP + PLOT_H}" x2="{x:.1f}" y2="{TOP + PLOT_H + 4}"/>'
                   f'<text class="tick" x="{x:.1f}" y="{TOP + PLOT_H + 16}" text-anchor="middle">'
                   f"{escape(chart.buckets[i].strftime(chart.x_format))}</text>")  # fmt: skip
    out.append(f'<line class="axis" x1="{LEFT}" y1="{TOP + PLOT_H}" x2="{LEFT + PLOT_W}" y2="{TOP + PLOT_H}"/>'
               f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + PLOT_H}"/>'
               f'<text class="label" x="{LEFT + PLOT_W / 2}" y="{HEIGHT - 6}" text-anchor="middle">'
               f"{escape(chart.x_label)}</text>"
               f'<text class="label" x="14" y="{TOP + PLOT_H / 2}" text-anchor="middle" '
               f'transform="rotate(-90 14 {TOP + PLOT_H / 2})">{escape(chart.y_label)}</text>')  # fmt: skip
    return out


def marker(shape: str, x: float, y: float) -> str:
    """A point's marker: a shape per series, so that series differ without colour."""
    if shape == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5"/>'
    if shape == "square":
        return f'<rect x="{x - 3.2:.1f}" y="{y - 3.2:.1f}" width="6.4" height="6.4"/>'
    if shape == "cross":
        return (f'<path class="stroked" d="M{x - 3.5:.1f},{y - 3.5:.1f}L{x + 3.5:.1f},{y + 3.5:.1f}'
                f'M{x - 3.5:.1f},{y + 3.5:.1f}L{x + 3.5:.1f},{y - 3.5:.1f}"/>')  # fmt: skip
    corners = {"triangle": ((0, -4.5), (4, 3), (-4, 3)), "down": ((0, 4.5), (4, -3), (-4, -3)),
               "diamond": ((0, -4.5), (4, 0), (0, 4.5), (-4, 0))}[shape]  # fmt: skip
    return f'<path d="M{"L".join(f"{x + dx:.1f},{y + dy:.1f}" for dx, dy in corners)}Z"/>'
