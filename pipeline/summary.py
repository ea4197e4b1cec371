"""summary.json: rows by status, wall time, aggregate x-realtime, per-bucket figures, the first failed
and rejected rows with the files that list them all.

Runs are read from runs.jsonl, where each run writes a `start` event, a `shard` event per finished
shard and an `end` event: a run killed before its end still counts its time up to its last finished
shard, so the audio it produced is not counted without the time it took.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from pipeline.rows import STATUSES
from pipeline.store import JobDir

PROBLEM_EXAMPLES = 5  # failed and rejected rows named in the summary (all are in the results files)


def _rate(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


def realtime_text(x_realtime: float | None) -> str:
    """A summary's x-realtime as people read it: `6.7x realtime`, or `no audio timed yet`."""
    return "no audio timed yet" if x_realtime is None else f"{x_realtime:.1f}x realtime"


def fold_runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per run from runs.jsonl's events; a record without `event` (written before events
    existed) is one whole run. `state`: finished; stopped (by an exception or Ctrl-C, named in
    `stopped_by`); or unfinished (no end recorded: killed, or still running), whose `wall_seconds` reach
    its last event (ready, or a finished shard)."""
    runs: dict[str, dict[str, Any]] = {}
    for rec in records:
        event = rec.get("event")
        if event is None:
            runs[f"record-{len(runs)}"] = {**rec, "state": "finished"}
            continue
        run = runs.setdefault(rec["run"], {"run": rec["run"], "state": "unfinished", "shards_finished": 0})
        fields = {k: v for k, v in rec.items() if k not in ("event", "shard", "seconds")}
        if event == "start":
            run.update(fields, wall_seconds=rec.get("planning_seconds", 0.0))
        elif event == "ready":  # engines loaded and graphs captured: shards may start
            run.update(fields, ready_seconds=rec["seconds"])
            run["wall_seconds"] = max(run.get("wall_seconds", 0.0), rec["seconds"])
        elif event == "shard":
            run["shards_finished"] += 1
            run["wall_seconds"] = max(run.get("wall_seconds", 0.0), rec["seconds"])
        elif event == "end":
            run.update(fields, state="stopped" if rec.get("stopped_by") else "finished")
    return list(runs.values())


def counts_time(run: dict[str, Any]) -> bool:
    """A run that had no shard to run (a resume of a complete job) adds no time to the job's wall."""
    return run.get("shards", 1) > 0


def _result_file(job: JobDir, row: dict[str, Any]) -> str:
    """The results file that holds `row` (rows refused at planning have no shard)."""
    if row["shard"] is None:
        return str(job.results_dir / "rejected.parquet")
    return str(job.shard_result_path(row["shard"]))


def _problems(job: JobDir, results: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """The first rows of one status (a row refused in every variant for one reason is named once) and
    every results file holding rows of that status."""
    rows = [r for r in results if r["status"] == status]
    rows.sort(key=lambda r: (r["row_index"] if r["row_index"] is not None else -1, r["variant"]))
    examples: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["id"], r["error"] or "")
        if key not in examples and len(examples) < PROBLEM_EXAMPLES:
            examples[key] = {k: r[k] for k in ("id", "row_index", "variant", "error")}
    return {
        "count": len(rows),
        "distinct": len({(r["id"], r["error"] or "") for r in rows}),
        "examples": list(examples.values()),
        "files": sorted({_result_file(job, r) for r in rows}),
    }


PHASES = ("prepare", "prepare_ahead", "generate", "decode", "postprocess", "write", "generation_idle")
# Phases beside the engine's calls, not part of the engine's time in the wall: a batch's preparation while
# the batch before generates, the decode (on CUDA its own stream runs it while the next batch generates) and
# the writer threads' post-processing and writes.
BESIDE_ENGINE = ("prepare_ahead", "decode", "postprocess", "write")
# Measured inside the wall's other parts: on CUDA, the generation stream's idle before each batch (from the
# end of the batch before it), which holds any preparation in the engine's call and part of "other".
WITHIN_WALL = ("generation_idle",)


def _time_split(runs: list[dict[str, Any]], phases: dict[str, float], wall: float) -> dict[str, float]:
    timed = [run for run in runs if counts_time(run)]
    planning = sum(run.get("planning_seconds", 0.0) for run in timed)
    worker_start = sum(run.get("worker_start_seconds", 0.0) for run in timed)
    capture = sum(run.get("capture_seconds", 0.0) for run in timed)
    split = {"planning": planning, "worker_start": worker_start, "capture": capture, **phases}
    split["other"] = wall - sum(v for k, v in split.items() if k not in BESIDE_ENGINE + WITHIN_WALL)
    return {k: round(v, 3) for k, v in split.items()}


def summarize(job: JobDir) -> dict[str, Any]:
    plan = job.read_plan()
    results = job.read_results().to_pylist()
    runs = fold_runs(job.read_runs())
    finished = job.finished_shards()
    planned = {s.index for s in plan.shards}

    by_status: dict[str, int] = dict.fromkeys(STATUSES, 0)
    by_variant: dict[str, dict[str, int]] = {v: dict.fromkeys(STATUSES, 0) for v in plan.variants}
    buckets: dict[tuple[str, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    audio = synth = 0.0
    phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    for r in results:
        by_status[r["status"]] += 1
        by_variant.setdefault(r["variant"], dict.fromkeys(STATUSES, 0))[r["status"]] += 1
        if r["status"] != "ok":
            continue
        audio += r["audio_seconds"]
        synth += r["synth_seconds"]
        for phase in PHASES:
            phases[phase] += r[f"{phase}_seconds"] or 0.0
        b = buckets[(r["variant"], r["bucket"])]
        b["rows"] += 1
        b["audio_seconds"] += r["audio_seconds"]
        b["synth_seconds"] += r["synth_seconds"]
    planned_rows = sum(len(s.rows) for s in plan.shards) + len(plan.rejected) * len(plan.variants)
    pending = planned_rows - len(results)
    wall = sum(run.get("wall_seconds", 0.0) for run in runs if counts_time(run))
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
        # where the job's wall time went: planning, then each phase of the rows' batches (summed over the
        # rows, so over actors when several ran at once), and the rest (idle engines, scheduling). The
        # phases in BESIDE_ENGINE ran beside the engine's calls and are not subtracted: "other" is then the
        # time the engines spent neither preparing in their calls nor generating (on CUDA: the generation
        # stream idle between batches, e.g. waiting for the next batch's preparation; generation_idle
        # measures that idle on the device)
        "time": _time_split(runs, phases, wall),
        "per_bucket": per_bucket,
        "problems": {status: _problems(job, results, status) for status in ("rejected", "failed")},
        "runs": runs,
    }
