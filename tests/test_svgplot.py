"""The report's plots: every plot titled, every axis between round ticks (1, 2 or 5 x 10^k)."""

import math
import re

import pytest

from pipeline import svgplot


def _is_round(value: float) -> bool:
    """value is an integer multiple of 1, 2 or 5 x 10^k for the k of its own step."""
    if value == 0:
        return True
    mantissa = abs(value) / 10 ** math.floor(math.log10(abs(value)))
    return any(abs(mantissa * 10**d - round(mantissa * 10**d)) < 1e-6 for d in range(0, 4))


def _tick_labels(svg: str) -> list[float]:
    """The numbers written at the axes (11 px text), not the title, legend or axis labels."""
    return [
        float(t) for t in re.findall(r'font-size="11" text-anchor="(?:middle|end)">(-?[\d.e+]+)</text>', svg)
    ]


def _steps(ticks: list[float]) -> set[float]:
    return {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}


@pytest.mark.parametrize(
    ("lo", "hi"),
    [(169.0, 402.0), (0.0, 1.0), (0.0012, 0.0049), (-3.2, 7.9), (5.0, 5.0), (0.998, 1.0), (0, 37)],
)
def test_nice_axis_covers_the_range_with_one_round_step(lo: float, hi: float):
    ticks = svgplot.nice_axis(lo, hi)
    assert ticks[0] <= lo and ticks[-1] >= hi and 3 <= len(ticks) <= 7
    (step,) = _steps(ticks)
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert round(mantissa, 6) in (1.0, 2.0, 5.0)
    assert all(round(t / step, 6).is_integer() for t in ticks)


def test_the_odd_ticks_of_issue_44_are_gone():
    """The old axes split [min, max] in four: 169, 227.25, 286 ... for data from 169 to 402."""
    svg = svgplot.histogram({"a": [169.0, 250.0, 402.0]}, "Audio length per row", "audio seconds")
    labels = _tick_labels(svg)
    assert labels and all(_is_round(v) for v in labels), labels
    assert 169.0 not in labels and 402.0 not in labels
    assert labels[:7] == [150.0, 200.0, 250.0, 300.0, 350.0, 400.0, 450.0]


@pytest.mark.parametrize(
    "svg",
    [
        svgplot.scatter({"a": [(169.0, 0.12), (402.0, 0.31)]}, "RTF against length", "tokens", "RTF"),
        svgplot.histogram({"a": [0.1, 0.4, 0.45], "b": [0.2]}, "Per-row WER", "WER"),
        svgplot.histogram({"a": [3.0, 3.0]}, "All alike", "x"),
        svgplot.scatter({"a": []}, "Nothing yet", "x", "y"),
        svgplot.histogram({"a": [math.inf]}, "Only infinities", "x"),
    ],
)
def test_every_plot_has_its_title_and_round_ticks(svg: str):
    title = re.search(r"<title>(.+?)</title>", svg)
    assert svg.startswith("<svg") and title, svg[:200]
    assert f'font-weight="bold">{title.group(1)}</text>' in svg  # visible, not just a tooltip
    assert all(_is_round(v) for v in _tick_labels(svg))


def test_histogram_counts_are_whole_ticks_and_bars_stay_inside_the_frame():
    svg = svgplot.histogram({"a": [1.0] * 7 + [2.0]}, "Counts", "x")
    ys = [v for v in _tick_labels(svg) if v.is_integer()]
    assert 7.0 <= max(ys) and all(v.is_integer() for v in ys)
    for x, w in re.findall(r'<rect x="([\d.]+)" y="[\d.]+" width="([\d.]+)" height="[\d.]+" fill="#', svg):
        assert svgplot.LEFT <= float(x) and float(x) + float(w) <= svgplot.W - svgplot.RIGHT + 0.5


@pytest.mark.parametrize("values", ([0.8, 0.8000000000000002], [1e-300, 1.0000000000000002e-300], [5.0, 5.0]))
def test_values_equal_but_for_rounding_plot_on_a_padded_axis(values):
    """Values a float step or two apart (0.8 and 0.8000000000000002) raised a math domain error: the ticks
    rounded to one value and the label's step was 0."""
    ticks = svgplot.nice_axis(min(values), max(values))
    assert len(set(ticks)) >= 2 and ticks[0] <= min(values) and ticks[-1] >= max(values)
    svg = svgplot.scatter({"fp16 vs fp8": [(v, v) for v in values]}, "t", "x", "y")
    assert "<svg" in svg and len(_tick_labels(svg)) >= 4
    assert "<svg" in svgplot.histogram({"fp8": values}, "t", "x")
