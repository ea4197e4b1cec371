"""report/index.html: the job's figures, plots (inline SVG) and audio players.

With two or more variants, each variant is compared with the first: wave and token metrics per row
(pipeline.compare, report/compare.parquet), summarised per pair in report/ab.json. With the models
configured (compare.asr_model, compare.speaker_model), every variant's rows get WER/CER and speaker
similarity (pipeline.quality, report/quality.parquet). The page names each metric it could not measure
and how to get it. The players' audio is placed under report/ (pipeline.media): the folder opens anywhere.
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
from pipeline.quality import Quality, measure
from pipeline.store import JobDir
from pipeline.summary import realtime_text, summarize
from pipeline.wer import ErrorCounts, pooled

PLAYERS = 12
LISTED_PROBLEMS = 200
PAIR_METRICS = (*METRICS, "token_agreement")
_CSS = """body{font-family:system-ui,sans-serif;margin:24px;max-width:1200px}
table{border-collapse:collapse;margin:8px 0 20px}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}audio{height:28px;width:180px}
.plots{display:flex;flex-wrap:wrap;gap:16px}
.missing{background:#fff6e0;border:1px solid #e0c080;padding:4px 12px}"""
HOW_TO = {
    "asr_model": (
        "intelligibility (WER/CER)",
        "set compare.asr_model to a transformers speech-recognition model, a directory or hub id "
        "(e.g. openai/whisper-small)",
    ),
    "speaker_model": (
        "speaker similarity",
        "set compare.speaker_model to a transformers x-vector model, a directory or hub id "
        "(e.g. microsoft/wavlm-base-plus-sv)",
    ),
}


def _cell(v: Any) -> str:
    if isinstance(v, float):
        text = "" if math.isnan(v) else f"{v:.4g}"  # inf and -inf as such (a silent wav's SNR is -inf)
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


def _counts(rec: dict[str, Any]) -> ErrorCounts:
    return ErrorCounts(rec["word_errors"], rec["ref_words"], rec["char_errors"], rec["ref_chars"])


def _rates(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled WER/CER and speaker similarity of some rows of one variant."""
    scored = [r for r in records if r.get("wer") is not None]
    sims = [r["speaker_sim"] for r in records if r.get("speaker_sim") is not None]
    total = pooled([_counts(r) for r in scored])
    return {
        "wer_rows": len(scored),
        "wer": total.wer,
        "cer": total.cer,
        "median_row_wer": statistics.median([r["wer"] for r in scored]) if scored else None,
        "sim_rows": len(sims),
        "speaker_sim": statistics.fmean(sims) if sims else None,
        "min_speaker_sim": min(sims) if sims else None,
    }


def _models_missing(quality: Quality) -> list[str]:
    notes = [
        f"{what}: not measured; {how}, then `ovbatch report JOB compare.{key}=MODEL`."
        for key, (what, how) in HOW_TO.items()
        if getattr(quality, key) is None
    ]
    return notes + quality.notes


def _tokens_missing(pair: dict[str, Any]) -> list[str]:
    missing = pair["rows"] - pair["token_rows"]
    if not missing:
        return []
    return [
        f"token agreement, {pair['variant_b']} against {pair['variant_a']}: {missing} of {pair['rows']} "
        "rows have no kept codes in both variants (JOB/tokens/ holds them for rows run since codes are "
        "kept, by an engine whose results carry `tokens`)."
    ]


def _pair(job: JobDir, a: str, b: str, quality: Quality, audio: ReportAudio) -> tuple[str, dict[str, Any]]:
    rows = compare_variants(job, a, b)
    compared = [r for r in rows if r["comparable"]]
    skipped = [r for r in rows if not r["comparable"]]
    for r in rows:
        qa, qb = quality.rows.get((a, r["id"]), {}), quality.rows.get((b, r["id"]), {})
        r.update(wer_a=qa.get("wer"), wer_b=qb.get("wer"), sim_a=qa.get("speaker_sim"))
        r.update(sim_b=qb.get("speaker_sim"))
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
        "quality": {
            v: _rates([quality.rows[(v, r["id"])] for r in rows if (v, r["id"]) in quality.rows])
            for v in (a, b)
        },
    }
    worst = sorted(compared, key=lambda r: -r["mel_lsd_db"])[:PLAYERS]
    for r in worst:
        r["A"], r["B"] = _player(audio, r["wav_a"]), _player(audio, r["wav_b"])
    columns = ["id", "bucket", "seconds_a", "seconds_b", "mel_lsd_db", "snr_db", "token_agreement"]
    if quality.asr_model:
        columns += ["wer_a", "wer_b"]
    if quality.speaker_model:
        columns += ["sim_a", "sim_b"]
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


def _overview(variants: list[str], pairs: list[dict[str, Any]], quality: Quality) -> str:
    by_variant = {p["variant_b"]: p for p in pairs}
    rates = _rates_by_variant(variants, quality)
    rows = []
    for v in variants:
        pair = by_variant.get(v, {})
        metrics = pair.get("metrics", {})
        tokens = pair.get("token_agreement") or {}
        rows.append(
            {
                "variant": v,
                "wer": rates[v]["wer"],
                "cer": rates[v]["cer"],
                "speaker_sim": rates[v]["speaker_sim"],
                "median mel_lsd_db": metrics.get("mel_lsd_db", {}).get("median"),
                "median snr_db": metrics.get("snr_db", {}).get("median"),
                "median duration_ratio": metrics.get("duration_ratio", {}).get("median"),
                "token_agreement": tokens.get("all"),
            }
        )
    columns = ["variant", "wer", "cer", "speaker_sim", "median mel_lsd_db", "median snr_db"]
    columns += ["median duration_ratio", "token_agreement"]
    return f"<h2>Each variant against {escape(variants[0])}</h2>{table(rows, columns)}"


def _rates_by_variant(variants: list[str], quality: Quality) -> dict[str, dict[str, Any]]:
    return {v: _rates([rec for (rv, _), rec in quality.rows.items() if rv == v]) for v in variants}


def _by_variant(records: list[dict[str, Any]], variants: list[str], key: str) -> dict[str, list[float]]:
    return {v: [r[key] for r in records if r["variant"] == v and r[key] is not None] for v in variants}


def _quality_section(variants: list[str], quality: Quality, audio: ReportAudio, text: dict[str, str]) -> str:
    if not quality.rows or (quality.asr_model is None and quality.speaker_model is None):
        return ""
    rates = _rates_by_variant(variants, quality)
    rows = [{"variant": v, **rates[v]} for v in variants]
    columns = ["variant", "wer_rows", "wer", "cer", "median_row_wer", "sim_rows", "speaker_sim"]
    columns.append("min_speaker_sim")
    models = ", ".join(f"{k} {getattr(quality, k)}" for k in HOW_TO if getattr(quality, k))
    html = [f"<h2>Intelligibility and speaker similarity</h2><p>{escape(models)}</p>", table(rows, columns)]
    records = list(quality.rows.values())
    plots = []
    if quality.asr_model:
        wer = _by_variant(records, variants, "wer")
        plots.append(svgplot.histogram(wer, "Word error rate per row", "WER"))
    if quality.speaker_model:
        sim = _by_variant(records, variants, "speaker_sim")
        plots.append(
            svgplot.histogram(sim, "Speaker similarity to the reference clip", "cosine of x-vectors")
        )
    html.append(f'<div class="plots">{"".join(plots)}</div>')
    hardest = sorted((r for r in records if r["wer"]), key=lambda r: -r["wer"])[:PLAYERS]
    if hardest:
        shown = [{**r, "text": text.get(r["id"]), "listen": _player(audio, r["wav_path"])} for r in hardest]
        html += [
            "<h3>Hardest to understand (listen)</h3>",
            table(shown, ["id", "variant", "wer", "cer", "text", "transcript"], markup=("listen",)),
        ]
    problems = [r for r in records if r["problem"]][:LISTED_PROBLEMS]
    if problems:
        html += [
            f"<h3>Rows not measured (first {LISTED_PROBLEMS})</h3>",
            table(problems, ["id", "variant", "problem"]),
        ]
    return "".join(html)


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
    quality = measure(job, cmp, ok)
    wav_of = {(r["variant"], r["id"]): r["wav_path"] for r in ok}
    for key, rec in quality.rows.items():
        rec["wav_path"] = wav_of.get(key)
    text = {i: row.text for i, row in job.read_rows().items()} if quality.rows else {}

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
        f"{realtime_text(summary['x_realtime'])} (job wall) / {realtime_text(summary['engine_x_realtime'])} "
        "(engine time)</p>",
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
        html, figures = _pair(job, variants[0], other, quality, audio)
        sections.append(html)
        ab.append(figures)
    notes = _models_missing(quality) + [n for pair in ab for n in _tokens_missing(pair)]
    if notes:
        items = "".join(f"<li>{escape(n)}</li>" for n in notes)
        parts.append(f'<div class="missing"><h2>Not measured</h2><ul>{items}</ul></div>')
    if ab:
        parts.append(_overview(variants, ab, quality))
    parts += sections
    parts.append(_quality_section(variants, quality, audio, text))
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
            figures["not_measured"] = _models_missing(quality) + _tokens_missing(figures)
        write_json_atomic(job.report_dir / "ab.json", ab)
    return out
