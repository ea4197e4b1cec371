"""Two tiny inline-SVG plots for the HTML report (no plotting library needed): scatter and histogram."""

from __future__ import annotations

import math
from html import escape

import numpy as np

W, H = 520, 300
LEFT, RIGHT, TOP, BOTTOM = 66, 12, 14, 42
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def _ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    if hi <= lo:
        return [lo]
    if integer:
        step = max(1, int(np.ceil((hi - lo) / (n - 1))))
        return list(np.arange(lo, hi + 0.5, step))
    return list(np.linspace(lo, hi, n))


def _padded(lo: float, hi: float) -> tuple[float, float]:
    """A range with 5% room on each side, so points on the edges stay whole; one value gets +-1 (or 5%)."""
    if hi <= lo:
        pad = abs(lo) * 0.05 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return (lo - pad if lo < 0 or lo - pad >= 0 else 0.0), hi + pad  # never below 0 for data that is not


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def _text(x: float, y: float, size: int, anchor: str, label: str, extra: str = "") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
        f"{escape(label)}</text>"
    )


def _frame(
    xlo: float, xhi: float, ylo: float, yhi: float, xlabel: str, ylabel: str, integer_y: bool = False
) -> list[str]:
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    out = [f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>']
    for t in _ticks(xlo, xhi):
        x = LEFT + (t - xlo) / ((xhi - xlo) or 1) * pw
        out.append(_text(x, H - BOTTOM + 16, 11, "middle", _fmt(t)))
    for t in _ticks(ylo, yhi, integer=integer_y):
        y = TOP + ph - (t - ylo) / ((yhi - ylo) or 1) * ph
        out.append(_text(LEFT - 6, y + 4, 11, "end", _fmt(t)))
    out.append(_text(LEFT + pw / 2, H - 6, 12, "middle", xlabel))
    out.append(_text(14, TOP + ph / 2, 12, "middle", ylabel, f' transform="rotate(-90 14 {TOP + ph / 2})"'))
    return out


def _svg(body: list[str], legend: list[tuple[str, str]]) -> str:
    x = W - RIGHT - 110  # legend in the top right corner
    items = [
        f'<rect x="{x}" y="{TOP + 6 + 16 * i}" width="10" height="10" fill="{c}"/>'
        + _text(x + 14, TOP + 15 + 16 * i, 11, "start", name)
        for i, (name, c) in enumerate(legend)
    ]
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">'
        + "".join(body + items)
        + "</svg>"
    )


def scatter(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str) -> str:
    pts = [p for ps in series.values() for p in ps if all(math.isfinite(v) for v in p)]
    if not pts:
        return "<p>(no data to plot)</p>"
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    (xlo, xhi), (ylo, yhi) = _padded(min(xs), max(xs)), _padded(min(0.0, min(ys)), max(ys))
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    body = _frame(xlo, xhi, ylo, yhi, xlabel, ylabel)
    legend = []
    for (name, ps), color in zip(series.items(), COLORS * 8):
        legend.append((name, color))
        for x, y in ps:
            if not (math.isfinite(x) and math.isfinite(y)):
                continue
            cx = LEFT + (x - xlo) / ((xhi - xlo) or 1) * pw
            cy = TOP + ph - (y - ylo) / ((yhi - ylo) or 1) * ph
            body.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{color}" fill-opacity="0.7"/>')
    return _svg(body, legend)


def histogram(series: dict[str, list[float]], xlabel: str, bins: int = 20) -> str:
    values = [v for vs in series.values() for v in vs if math.isfinite(v)]
    if not values:
        return "<p>(no data to plot)</p>"
    lo, hi = min(values), max(values)
    if hi <= lo:
        hi = lo + 1.0
    edges = np.linspace(lo, hi, bins + 1)
    counts = {k: np.histogram([v for v in vs if math.isfinite(v)], edges)[0] for k, vs in series.items()}
    top = max(int(c.max()) for c in counts.values()) or 1
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    body = _frame(lo, hi, 0, top, xlabel, "rows", integer_y=True)
    legend = []
    width = pw / bins / max(1, len(series))
    for j, ((name, c), color) in enumerate(zip(counts.items(), COLORS * 8)):
        legend.append((name, color))
        for i, n in enumerate(c):
            if n == 0:
                continue
            x = LEFT + i * pw / bins + j * width
            h = n / top * ph
            body.append(
                f'<rect x="{x:.1f}" y="{TOP + ph - h:.1f}" width="{max(width - 1, 1):.1f}" '
                f'height="{h:.1f}" fill="{color}" fill-opacity="0.8"/>'
            )
    return _svg(body, legend)
