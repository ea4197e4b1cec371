"""summary.json: rows by status, wall time, aggregate x-realtime, per-bucket figures."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pipeline.rows import STATUSES
from pipeline.store import JobDir


def _rate(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


def summarize(job: JobDir) -> dict[str, Any]:
    plan = job.read_plan()
    results = job.read_results().to_pylist()
    runs = job.read_runs()
    finished = job.finished_shards()
    planned = {s.index for s in plan.shards}

    by_status: dict[str, int] = dict.fromkeys(STATUSES, 0)
    by_variant: dict[str, dict[str, int]] = {v: dict.fromkeys(STATUSES, 0) for v in plan.variants}
    buckets: dict[tuple[str, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    audio = synth = 0.0
    for r in results:
        by_status[r["status"]] += 1
        by_variant.setdefault(r["variant"], dict.fromkeys(STATUSES, 0))[r["status"]] += 1
        if r["status"] != "ok":
            continue
        audio += r["audio_seconds"]
        synth += r["synth_seconds"]
        b = buckets[(r["variant"], r["bucket"])]
        b["rows"] += 1
        b["audio_seconds"] += r["audio_seconds"]
        b["synth_seconds"] += r["synth_seconds"]
    planned_rows = sum(len(s.rows) for s in plan.shards) + len(plan.rejected) * len(plan.variants)
    pending = planned_rows - len(results)
    wall = sum(run.get("wall_seconds", 0.0) for run in runs)
    per_bucket = [
        {
            "variant": v,
            "bucket": k,
            "rows": int(b["rows"]),
            "audio_seconds": round(b["audio_seconds"], 3),
            "synth_seconds": round(b["synth_seconds"], 3),
            "x_realtime": _rate(b["audio_seconds"], b["synth_seconds"]),
            "rows_per_s": _rate(b["rows"], b["synth_seconds"]),
        }
        for (v, k), b in sorted(buckets.items())
    ]
    return {
        "job": str(job.path),
        "variants": plan.variants,
        "complete": planned <= finished and pending == 0,
        "rows": {**by_status, "pending": pending, "total": planned_rows},
        "rows_by_variant": by_variant,
        "shards": {"planned": len(planned), "finished": len(planned & finished)},
        "wall_seconds": round(wall, 3),
        "audio_seconds": round(audio, 3),
        "synth_seconds": round(synth, 3),
        # audio produced per second of job wall time (all runs of the job, start-up included)
        "x_realtime": _rate(audio, wall),
        # audio per second of engine time (sum of per-row shares of batch time)
        "engine_x_realtime": _rate(audio, synth),
        "per_bucket": per_bucket,
        "runs": runs,
    }
