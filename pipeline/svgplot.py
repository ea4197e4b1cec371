"""Two tiny inline-SVG plots for the HTML report (no plotting library needed): scatter and histogram.
Every plot has a title, and its axes run between round ticks (1, 2 or 5 x 10^k)."""

from __future__ import annotations

import math
from html import escape

import numpy as np

W, H = 520, 310
LEFT, RIGHT, TOP, BOTTOM = 66, 12, 30, 42
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
TICKS = 6  # about this many ticks an axis


def nice_step(span: float, ticks: int = TICKS) -> float:
    """The smallest of 1, 2, 5 x 10^k that cuts `span` into at most ticks - 1 steps."""
    raw = span / max(ticks - 1, 1)
    base = 10.0 ** math.floor(math.log10(raw))
    return next(m * base for m in (1, 2, 5, 10) if m * base >= raw * (1 - 1e-9))


def nice_axis(lo: float, hi: float, ticks: int = TICKS, integer: bool = False) -> list[float]:
    """Round tick values from a multiple of the step at or below `lo` to one at or above `hi`."""
    if hi - lo <= 1e-9 * max(abs(lo), abs(hi)):  # equal but for rounding: ticks that far apart round to one
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    step = nice_step(hi - lo, ticks)
    if integer:
        step = max(step, 1.0)
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    digits = max(0, -math.floor(math.log10(step)))
    return [round(k * step, digits) + 0.0 for k in range(first, last + 1)]  # + 0.0: no "-0"


def tick_label(value: float, step: float) -> str:
    if abs(value) >= 1e6:
        return f"{value:g}"
    return f"{value:.{max(0, -math.floor(math.log10(step)))}f}"


def _padded(lo: float, hi: float) -> tuple[float, float]:
    """A range with 5% room on each side, so points on the edges stay whole; never below 0 for data that
    is not."""
    if hi <= lo:
        return lo, hi
    pad = (hi - lo) * 0.05
    return (lo - pad if lo < 0 or lo - pad >= 0 else 0.0), hi + pad


def _text(x: float, y: float, size: int, anchor: str, label: str, extra: str = "") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
        f"{escape(label)}</text>"
    )


class _Frame:
    """The plot area between round ticks, and the mapping of data values into it."""

    def __init__(self, xticks: list[float], yticks: list[float]):
        self.xticks, self.yticks = xticks, yticks
        self.pw, self.ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def x(self, v: float) -> float:
        lo, hi = self.xticks[0], self.xticks[-1]
        return LEFT + (v - lo) / (hi - lo) * self.pw

    def y(self, v: float) -> float:
        lo, hi = self.yticks[0], self.yticks[-1]
        return TOP + self.ph - (v - lo) / (hi - lo) * self.ph

    def axes(self, xlabel: str, ylabel: str) -> list[str]:
        out = [f'<rect x="{LEFT}" y="{TOP}" width="{self.pw}" height="{self.ph}" fill="none" stroke="#888"/>']
        xstep, ystep = self.xticks[1] - self.xticks[0], self.yticks[1] - self.yticks[0]
        for t in self.xticks:
            out.append(_text(self.x(t), H - BOTTOM + 16, 11, "middle", tick_label(t, xstep)))
        for t in self.yticks:
            out.append(_text(LEFT - 6, self.y(t) + 4, 11, "end", tick_label(t, ystep)))
        out.append(_text(LEFT + self.pw / 2, H - 6, 12, "middle", xlabel))
        mid = TOP + self.ph / 2
        out.append(_text(14, mid, 12, "middle", ylabel, f' transform="rotate(-90 14 {mid})"'))
        return out


def _svg(title: str, body: list[str], legend: list[tuple[str, str]] = ()) -> str:
    x = W - RIGHT - 110  # legend in the top right corner
    items = [
        f'<rect x="{x}" y="{TOP + 6 + 16 * i}" width="10" height="10" fill="{c}"/>'
        + _text(x + 14, TOP + 15 + 16 * i, 11, "start", name)
        for i, (name, c) in enumerate(legend)
    ]
    heading = _text(W / 2, 19, 13, "middle", title, ' font-weight="bold"')
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        f'role="img" aria-label="{escape(title)}"><title>{escape(title)}</title>'
        + "".join([heading, *body, *items])
        + "</svg>"
    )


def _no_data(title: str) -> str:
    return _svg(title, [_text(W / 2, H / 2, 13, "middle", "no data to plot", ' fill="#888"')])


def scatter(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str) -> str:
    pts = [p for ps in series.values() for p in ps if all(math.isfinite(v) for v in p)]
    if not pts:
        return _no_data(title)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    frame = _Frame(nice_axis(*_padded(min(xs), max(xs))), nice_axis(*_padded(min(0.0, min(ys)), max(ys))))
    body = frame.axes(xlabel, ylabel)
    legend = []
    for (name, ps), color in zip(series.items(), COLORS * 8):
        legend.append((name, color))
        for x, y in ps:
            if math.isfinite(x) and math.isfinite(y):
                body.append(
                    f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="3" fill="{color}" '
                    'fill-opacity="0.7"/>'
                )
    return _svg(title, body, legend)


def histogram(series: dict[str, list[float]], title: str, xlabel: str, bins: int = 20) -> str:
    values = [v for vs in series.values() for v in vs if math.isfinite(v)]
    if not values:
        return _no_data(title)
    xticks = nice_axis(min(values), max(values))
    edges = np.linspace(xticks[0], xticks[-1], bins + 1)
    counts = {k: np.histogram([v for v in vs if math.isfinite(v)], edges)[0] for k, vs in series.items()}
    top = max(int(c.max()) for c in counts.values()) or 1
    frame = _Frame(xticks, nice_axis(0.0, float(top), integer=True))
    body = frame.axes(xlabel, "rows")
    legend = []
    bin_width = (frame.x(edges[1]) - frame.x(edges[0])) / max(1, len(series))
    for j, ((name, c), color) in enumerate(zip(counts.items(), COLORS * 8)):
        legend.append((name, color))
        for i, n in enumerate(c):
            if n == 0:
                continue
            x = frame.x(edges[i]) + j * bin_width
            y = frame.y(float(n))
            body.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(bin_width - 1, 1):.1f}" '
                f'height="{frame.y(0.0) - y:.1f}" fill="{color}" fill-opacity="0.8"/>'
            )
    return _svg(title, body, legend)
