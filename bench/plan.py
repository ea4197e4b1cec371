"""Planning a job whose rows each bring their own reference clip, on this machine's CPUs.

`plan_job` (manifest read and checked, every clip prepared and counted in codec frames, every row sized,
shards cut) on manifests of 1,000 and 10,000 rows with distinct clips (bench/manifests.py), timed from
the manifest to the plan. The clip files are written just before, so they are read from the page cache.
Baseline, in the same run: the planner before this one prepared each row through the engine on the CPU,
which encoded every distinct clip with the full-size codec (OmniVoice's architecture, random weights:
its speed does not depend on their values); its cost per clip is the median over a few clips, and the
baseline for N rows is N times that (an estimate, printed as such). Target (issue 42): 10,000 rows in
at most 60 s on a 2-core driver, linear in rows.

    python bench/plan.py [--rows 1000 10000] [--baseline-clips 9] [--out bench/results/plan-cpu.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, write_result  # noqa: E402
from bench.manifests import write_distinct_clip_manifest  # noqa: E402
from engine.codec import Codec  # noqa: E402
from engine.codec.checkpoint import OMNIVOICE_CODEC_CONFIG  # noqa: E402
from engine.frontend.audio import prepare_reference  # noqa: E402
from pipeline.config import load_job_config  # noqa: E402
from pipeline.job import plan_job  # noqa: E402
from pipeline.manifest import load as load_manifest  # noqa: E402
from pipeline.sizing import frontend_sizer  # noqa: E402

TARGET_SECONDS_10K = 60.0


def timed_plan(manifest: Path) -> dict:
    """plan_job on the manifest, with the time of its phases (clips: the sizer's clip preparation)."""
    cfg = load_job_config(None, ["engine.device=cpu"], {"manifest": str(manifest)})
    phases: dict[str, float] = {}
    start = time.perf_counter()
    plan, rows = plan_job(cfg, frontend_sizer, clip_dir=None, phases=phases)
    seconds = time.perf_counter() - start
    return {
        "rows": len(rows) + len(plan.rejected),
        "planned": len(rows),
        "rejected": len(plan.rejected),
        "shards": len(plan.shards),
        "seconds": round(seconds, 2),
        "seconds_per_1000_rows": round(seconds / (len(rows) + len(plan.rejected)) * 1000, 3),
        "phases_seconds": {
            "manifest_and_cut": round(phases["manifest"] + phases["cut"], 2),
            "clips": round(phases["clips"], 2),
            "rows": round(phases["rows"], 2),
        },
    }


def baseline_seconds_per_clip(manifest: Path, clips: int) -> dict:
    """The previous planner's work per distinct clip: prepare it and encode it with the full-size codec
    on the CPU, one clip per call (as it prepared one row at a time)."""
    from transformers import HiggsAudioV2TokenizerConfig

    torch.manual_seed(0)
    codec = Codec(HiggsAudioV2TokenizerConfig.from_dict(OMNIVOICE_CODEC_CONFIG)).eval()
    rows = load_manifest(manifest).rows[: clips + 1]
    times, clip_seconds = [], []
    for i, row in enumerate(rows):
        start = time.perf_counter()
        ref = prepare_reference(row.ref_audio, codec.sample_rate, codec.hop_length)
        codec.encode([torch.from_numpy(ref.audio)])
        if i:  # the first call warms up
            times.append(time.perf_counter() - start)
            clip_seconds.append(len(ref.audio) / codec.sample_rate)
    return {
        "clips_timed": len(times),
        "median_seconds_per_clip": round(statistics.median(times), 3),
        "mean_prepared_clip_seconds": round(statistics.fmean(clip_seconds), 2),
    }


def run(sizes: list[int], baseline_clips: int, folder: Path) -> dict:
    entries = []
    for rows in sizes:
        manifest = write_distinct_clip_manifest(
            folder / f"m{rows}.parquet", folder / f"clips{rows}", rows, rows
        )
        entries.append(timed_plan(manifest))
    baseline = baseline_seconds_per_clip(manifest, baseline_clips)
    for e in entries:
        e["baseline_seconds_estimated"] = round(e["rows"] * baseline["median_seconds_per_clip"], 1)
        e["speedup_vs_baseline"] = round(e["baseline_seconds_estimated"] / e["seconds"], 1)
    small, large = entries[0], entries[-1]
    return {
        "what": "plan_job on manifests whose rows each bring their own reference clip (3-10 s, mixed rates)",
        "cpu": platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "checkpoint": "embedded tiny (planning reads only a checkpoint's tokenizer and codec config)",
        "entries": entries,
        "baseline_previous_planner": baseline,
        "linearity_seconds_per_row_ratio": round(
            large["seconds_per_1000_rows"] / small["seconds_per_1000_rows"], 3
        ),
        "target_seconds_10000_rows": TARGET_SECONDS_10K,
        "environment": environment("numpy", "soxr", "soundfile", "tokenizers"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--baseline-clips", type=int, default=9)
    parser.add_argument("--out", default="bench/results/plan-cpu.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ovbatch-plan-bench-") as folder:
        result = run(sorted(args.rows), args.baseline_clips, Path(folder))
    for e in result["entries"]:
        print(
            f"{e['rows']:>6} rows: {e['seconds']:7.2f} s ({e['seconds_per_1000_rows']:.2f} s per 1,000 rows; "
            f"phases {e['phases_seconds']}), baseline ~{e['baseline_seconds_estimated']:.0f} s"
        )
    write_result(args.out, result)


if __name__ == "__main__":
    main()
