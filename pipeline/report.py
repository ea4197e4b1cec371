"""report/index.html: the job's figures, plots (inline SVG) and audio players.

With two or more variants, each variant is compared with the first: wave and token metrics per row
(pipeline.compare, report/compare.parquet), summarised per pair in report/ab.json. The page names each
metric it could not measure and why. The players' audio is placed under report/ (pipeline.media): the
folder opens anywhere.
"""

from __future__ import annotations

import math
import statistics
from html import escape
from pathlib import Path
from typing import Any

from pipeline import svgplot
from pipeline.atomic import write_bytes_atomic, write_json_atomic
from pipeline.compare import METRICS, compare_variants
from pipeline.config import CompareConfig, load_job_config
from pipeline.media import ReportAudio
from pipeline.store import JobDir
from pipeline.summary import summarize

PLAYERS = 12
LISTED_PROBLEMS = 200
PAIR_METRICS = (*METRICS, "token_agreement")
_CSS = """body{font-family:system-ui,sans-serif;margin:24px;max-width:1200px}
table{border-collapse:collapse;margin:8px 0 20px}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}audio{height:28px;width:180px}
.plots{display:flex;flex-wrap:wrap;gap:16px}
.missing{background:#fff6e0;border:1px solid #e0c080;padding:4px 12px}"""


def _cell(v: Any) -> str:
    if isinstance(v, float):
        text = "inf" if math.isinf(v) else ("" if math.isnan(v) else f"{v:.4g}")
        return f'<td class="n">{text}</td>'
    if isinstance(v, int):
        return f'<td class="n">{v}</td>'
    return f"<td>{escape('' if v is None else str(v))}</td>"


def table(rows: list[dict[str, Any]], columns: list[str], markup: tuple[str, ...] = ()) -> str:
    """An HTML table; values are escaped except in the `markup` columns (players built here)."""
    head = "".join(f"<th>{escape(c)}</th>" for c in (*columns, *markup))
    body = "".join(
        "<tr>"
        + "".join(_cell(r.get(c)) for c in columns)
        + "".join(f"<td>{r.get(c, '')}</td>" for c in markup)
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _player(audio: ReportAudio, wav_path: str | None) -> str:
    src = audio.src(wav_path) if wav_path else None
    if src is None:
        return "(wav missing)" if wav_path else ""
    return f'<audio controls preload="metadata" src="{escape(src)}"></audio>'


def _stats(values: list[float | None]) -> dict[str, float]:
    """Over the rows measured (None: not measured); an infinite value (identical wavs' SNR) counts as a
    row but stays out of the figures."""
    measured = [v for v in values if v is not None]
    finite = [v for v in measured if math.isfinite(v)]
    if not finite:
        return {"rows": len(measured)}
    return {
        "rows": len(measured),
        "median": statistics.median(finite),
        "mean": statistics.fmean(finite),
        "min": min(finite),
        "max": max(finite),
    }


def _tokens_missing(pair: dict[str, Any]) -> list[str]:
    missing = pair["rows"] - pair["token_rows"]
    if not missing:
        return []
    return [
        f"token agreement, {pair['variant_b']} against {pair['variant_a']}: {missing} of {pair['rows']} "
        "rows have no kept codes in both variants (JOB/tokens/ holds them for rows run since codes are "
        "kept, by an engine whose results carry `tokens`)."
    ]


def _pair(job: JobDir, a: str, b: str, audio: ReportAudio) -> tuple[str, dict[str, Any]]:
    rows = compare_variants(job, a, b)
    compared = [r for r in rows if r["comparable"]]
    skipped = [r for r in rows if not r["comparable"]]
    stats = {m: _stats([r[m] for r in (compared if m in METRICS else rows)]) for m in PAIR_METRICS}
    with_tokens = [r for r in rows if r["token_same"] is not None]
    frames = sum(r["token_frames"] for r in with_tokens)
    codebooks = [sum(col) / frames for col in zip(*(r["token_same"] for r in with_tokens))] if frames else []
    tokens = {"all": statistics.fmean(codebooks), "per_codebook": codebooks} if codebooks else None
    figures: dict[str, Any] = {
        "variant_a": a,
        "variant_b": b,
        "rows": len(rows),
        "metrics": stats,
        "not_comparable": [{"id": r["id"], "reason": r["reason"]} for r in skipped],
        "token_rows": len(with_tokens),
        "token_agreement": tokens,
    }
    worst = sorted(compared, key=lambda r: -r["mel_lsd_db"])[:PLAYERS]
    for r in worst:
        r["A"], r["B"] = _player(audio, r["wav_a"]), _player(audio, r["wav_b"])
    columns = ["id", "bucket", "seconds_a", "seconds_b", "mel_lsd_db", "snr_db", "token_agreement"]
    plots = [
        svgplot.histogram(
            {"rows": [r["mel_lsd_db"] for r in compared]},
            f"Spectral distance, {b} against {a}",
            "log-mel LSD (dB)",
        ),
        svgplot.scatter(
            {"rows": [(r["seconds_a"], r["seconds_b"]) for r in compared]},
            f"Duration, {b} against {a}",
            f"{a} seconds",
            f"{b} seconds",
        ),
    ]
    counts = f"{len(rows)} rows ok in both" + (f", {len(skipped)} not comparable" if skipped else "")
    html = [
        f"<h2>A/B: {escape(b)} against {escape(a)} ({counts})</h2>",
        table(
            [{"metric": m, **s} for m, s in stats.items()], ["metric", "rows", "median", "mean", "min", "max"]
        ),
    ]
    if codebooks:
        html += [
            f"<h3>Token agreement per codebook ({len(with_tokens)} rows, {frames} frames)</h3>",
            table(
                [{"codebook": i, "agreement": v} for i, v in enumerate(codebooks)], ["codebook", "agreement"]
            ),
        ]
    html += [
        f'<div class="plots">{"".join(plots)}</div>',
        f"<h3>Largest spectral differences (listen)</h3>{table(worst, columns, markup=('A', 'B'))}",
    ]
    if skipped:
        html.append(
            f"<h3>Not comparable (first {LISTED_PROBLEMS})</h3>"
            + table(skipped[:LISTED_PROBLEMS], ["id", "reason"])
        )
    return "".join(html), figures


def stored_compare(job: JobDir) -> CompareConfig:
    """The job's own compare settings (JOB/config.yaml), or the defaults for a job dir without one."""
    return load_job_config(job.config_path).compare if job.config_path.is_file() else CompareConfig()


def write_report(job: JobDir, compare: CompareConfig | None = None) -> Path:
    """Write JOB/report/index.html (and report/ab.json when there are two or more variants). `compare`
    defaults to the job's stored settings."""
    cmp = compare if compare is not None else stored_compare(job)
    summary = summarize(job)
    results = job.read_results().to_pylist()
    ok = [r for r in results if r["status"] == "ok"]
    problems = [r for r in results if r["status"] != "ok"][:LISTED_PROBLEMS]
    variants = summary["variants"]
    job.report_dir.mkdir(parents=True, exist_ok=True)
    audio = ReportAudio(job, cmp.audio)

    status_rows = [{"variant": v, **c} for v, c in summary["rows_by_variant"].items()]
    plots = [
        svgplot.scatter(
            {v: [(r["packed_tokens"], r["rtf"]) for r in ok if r["variant"] == v] for v in variants},
            "Real-time factor against packed length",
            "packed tokens (cond + uncond)",
            "RTF (synth s / audio s)",
        ),
        svgplot.histogram(
            {v: [r["audio_seconds"] for r in ok if r["variant"] == v] for v in variants},
            "Audio length per row",
            "audio seconds",
        ),
    ]
    parts = [
        f"<h1>OVBatch job {escape(job.path.name)}</h1>",
        f"<p>{escape(str(job.path))} &middot; complete: {summary['complete']} &middot; wall "
        f"{summary['wall_seconds']:.1f} s &middot; audio {summary['audio_seconds']:.1f} s &middot; "
        f"x-realtime {summary['x_realtime']} (job wall) / {summary['engine_x_realtime']} (engine time)</p>",
        "<h2>Rows</h2>",
        table(status_rows, ["variant", "ok", "failed", "rejected"]),
        "<h2>Per bucket</h2>",
        table(
            summary["per_bucket"],
            ["variant", "bucket", "rows", "audio_seconds", "synth_seconds", "x_realtime", "rows_per_s"],
        ),
        f'<div class="plots">{"".join(plots)}</div>',
    ]
    sections, ab = [], []
    for other in variants[1:]:
        html, figures = _pair(job, variants[0], other, audio)
        sections.append(html)
        ab.append(figures)
    notes = [n for pair in ab for n in _tokens_missing(pair)]
    if notes:
        items = "".join(f"<li>{escape(n)}</li>" for n in notes)
        parts.append(f'<div class="missing"><h2>Not measured</h2><ul>{items}</ul></div>')
    parts += sections
    if len(variants) == 1 and ok:
        sample = sorted(ok, key=lambda r: r["id"])[:PLAYERS]
        for r in sample:
            r["listen"] = _player(audio, r["wav_path"])
        parts += [
            "<h2>Samples</h2>",
            table(sample, ["id", "bucket", "audio_seconds", "rtf"], markup=("listen",)),
        ]
    if problems:
        parts += [
            f"<h2>Failed and rejected rows (first {LISTED_PROBLEMS})</h2>",
            table(problems, ["id", "variant", "status", "error"]),
        ]
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>OVBatch {escape(job.path.name)}</title>"
        f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>"
    )
    out = job.report_dir / "index.html"
    write_bytes_atomic(out, page.encode())
    audio.finish()
    if ab:
        for figures in ab:
            figures["not_measured"] = _tokens_missing(figures)
        write_json_atomic(job.report_dir / "ab.json", ab)
    return out
