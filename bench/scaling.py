"""Scaling of one W4A4 batch job over N GPUs of one host, through the Ray pipeline (ray.num_actors=N,
one GPU actor per GPU), with NVLink multicast off (NCCL_NVLS_ENABLE=0).

The job: full-size OmniVoice dimensions with random weights (bench/pipeline.py's checkpoint), its backbone
Linears in W4A4 by round-to-nearest + rank-16 low-rank (bench/generate.py's speed copy, written as a
W4A4 checkpoint: no calibration, speed only), run on the CUDA kernels
(engine.fast_paths.w4a4_backend=cuda-sm90, so a missing kernel fails the rows instead of falling back).
The manifest has --rows rows (2,000) whose texts are drawn, seeded, for a log-normal spread of speech
lengths (median 4 s, 1 to 20 s; the JSON records the drawn spread and the audio the engine made),
cycling over the repo's speech clips.

Per N, in a fresh job directory: wall seconds (planning included and excluded), audio seconds,
x-realtime, scaling efficiency x_N / (N x_1), engine busy fraction (summed batch time / execution time,
per GPU as well), nvidia-smi utilisation per GPU, the per-worker load and the slowest shard. Shard wall
times come from the result rows (first batch start to last batch end of the shard; the job records no
per-shard timer), so the engine load an actor does before its first batch is not in them.

One device command is limited to 10 minutes, so run one N per invocation; each merges into --out (keyed
by N, replacing an earlier run of the same N) and the efficiencies are recomputed:

    python bench/scaling.py --gpus 1 && python bench/scaling.py --gpus 2
    python bench/scaling.py --merge a.json b.json        # merge reports made elsewhere into --out
    python bench/scaling.py --size tiny --rows 6 --gpus 1 --out /tmp/scaling-tiny.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, results_path  # noqa: E402
from bench.generate import w4a4_copy  # noqa: E402
from bench.manifests import LENGTHS, manifest_texts  # noqa: E402
from bench.pipeline import full_size_checkpoint, run_mode, write_clip_manifest  # noqa: E402
from engine.checkpoint import checkpoint_fingerprint, read_config  # noqa: E402
from engine.config import FastPaths  # noqa: E402
from engine.errors import InputError  # noqa: E402
from engine.loading import load_model  # noqa: E402
from engine.quantizer.quantize import write_w4a4_checkpoint  # noqa: E402
from engine.tiny import ensure_tiny_checkpoint  # noqa: E402
from engine.w4a4.format import QuantMeta  # noqa: E402
from engine.w4a4.linear import W4A4Linear  # noqa: E402
from pipeline.store import JobDir  # noqa: E402

RANK = 16
# Shards of half the default packed tokens: the 2,000 rows make 25 shards (two full 16,384-token
# batches each), so that up to 8 GPUs get several shards each and the job's tail stays short.
FULL_OVERRIDES = ("engine.device=cuda", "engine.fast_paths.w4a4_backend=cuda-sm90", "shard_tokens=32768")
# Bucket sizes for the tiny checkpoint on the CPU (rows up to 20 s fit one bucket).
TINY_OVERRIDES = (
    "engine.device=cpu",
    "engine.buckets=[256,512,1024,2048,4096]",
    "engine.max_batch_tokens=4096",
    "shard_tokens=4096",
)


def spread(values: list[float]) -> dict[str, float]:
    """min, p10, p50, p90, max and mean of a list of numbers, rounded."""
    if not values:
        return {}
    deciles = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else [values[0]] * 9
    return {
        "min": round(min(values), 3),
        "p10": round(deciles[0], 3),
        "p50": round(statistics.median(values), 3),
        "p90": round(deciles[8], 3),
        "max": round(max(values), 3),
        "mean": round(statistics.fmean(values), 3),
    }


def write_manifest(path: Path, rows: int, seed: int) -> dict:
    """The manifest (clips cycled as in bench/pipeline.py); returns the drawn length distribution."""
    texts, seconds = manifest_texts(rows, seed)
    write_clip_manifest(path, texts, "s")
    return {
        "kind": "log-normal speech seconds, clipped",
        **LENGTHS,
        "seed": seed,
        "drawn_speech_seconds": spread(seconds),
        "text_chars": spread([float(len(t)) for t in texts]),
    }


def rtn_w4a4_checkpoint(source: Path, out: Path) -> Path:
    """`source` with its backbone Linears in W4A4 (bench/generate.py's round-to-nearest + low-rank speed
    copy), written in the W4A4 checkpoint layout the engine loads (the quantizer's own writer)."""
    _, raw = read_config(source)
    # the Linears under their own names, as the checkpoint stores them (not merged for inference)
    apart = FastPaths(grouped_projections=False)
    _, model = load_model(source, device="cpu", dtype=torch.float32, fast_paths=apart)
    layers = {
        name: module.tensors().to("cpu")
        for name, module in w4a4_copy(model, RANK).named_modules()
        if isinstance(module, W4A4Linear)
    }
    meta = QuantMeta(
        rank=RANK,
        source_hash=checkpoint_fingerprint(source),
        layers=tuple(layers),
        settings={"method": f"round-to-nearest + rank-{RANK} low-rank, no calibration (bench speed copy)"},
    )
    out.mkdir(parents=True)
    write_w4a4_checkpoint(out, source, raw, layers, meta)
    return out


def _span(rows: list[dict]) -> float:
    start = min(datetime.fromisoformat(r["started_at"]) for r in rows)
    end = max(datetime.fromisoformat(r["finished_at"]) for r in rows)
    return (end - start).total_seconds()


def shard_timings(results: list[dict]) -> list[dict]:
    """Per shard, from its ok result rows: rows, wall seconds (first batch start to last batch end),
    summed engine seconds, audio seconds, bucket and the worker that ran it."""
    by_shard: dict[int, list[dict]] = {}
    for r in results:
        if r["status"] == "ok":
            by_shard.setdefault(r["shard"], []).append(r)
    return [
        {
            "shard": index,
            "rows": len(rows),
            "wall_seconds": round(_span(rows), 3),
            "synth_seconds": round(sum(r["synth_seconds"] for r in rows), 3),
            "audio_seconds": round(sum(r["audio_seconds"] for r in rows), 3),
            "bucket": rows[0]["bucket"],
            "worker": rows[0]["worker"],
        }
        for index, rows in sorted(by_shard.items())
    ]


def worker_load(shards: list[dict], execution_seconds: float) -> list[dict]:
    """Per worker (one actor, one GPU): shards, rows, engine seconds and its busy fraction."""
    by_worker: dict[str, list[dict]] = {}
    for s in shards:
        by_worker.setdefault(s["worker"], []).append(s)
    return [
        {
            "worker": worker,
            "shards": len(own),
            "rows": sum(s["rows"] for s in own),
            "synth_seconds": round(sum(s["synth_seconds"] for s in own), 3),
            "busy_fraction": round(sum(s["synth_seconds"] for s in own) / execution_seconds, 4)
            if execution_seconds > 0
            else None,
        }
        for worker, own in sorted(by_worker.items())
    ]


def run_gpus(gpus: int, manifest: Path, job_dir: Path, overrides: list[str]) -> dict:
    """The whole job on `gpus` Ray actors in a fresh job directory, with its measurements."""
    run = run_mode("ray", manifest, job_dir, [*overrides, f"ray.num_actors={gpus}"], gpus)
    results = JobDir(job_dir).read_results().to_pylist()
    shards = shard_timings(results)
    busy = run["engine_busy_fraction"]
    return {
        "gpus": gpus,
        **run,
        "engine_busy_fraction_per_gpu": round(busy / gpus, 4) if busy is not None else None,
        "audio_seconds_per_row": spread([r["audio_seconds"] for r in results if r["status"] == "ok"]),
        "shards": len(shards),
        "slowest_shard": max(shards, key=lambda s: s["wall_seconds"], default=None),
        "workers": worker_load(shards, run["execution_seconds"]),
        "environment": environment("ray"),
        "visible_gpus": torch.cuda.device_count(),
    }


# scaling efficiency figure -> the throughput it compares (execution only; whole wall, planning included)
EFFICIENCY_OF = {"scaling_efficiency": "x_realtime_execution", "scaling_efficiency_wall": "x_realtime"}


def with_efficiency(runs: list[dict]) -> list[dict]:
    """Runs ordered by GPU count, each with x_N / (N x_1) on execution time and on whole wall time
    (None while no 1-GPU run is there)."""
    runs = sorted(runs, key=lambda r: r["gpus"])
    base = next((r for r in runs if r["gpus"] == 1), None)
    out = []
    for r in runs:
        eff = {}
        for key, rate in EFFICIENCY_OF.items():
            one = base[rate] if base else None
            eff[key] = round(r[rate] / (r["gpus"] * one), 4) if one and r[rate] is not None else None
        out.append({**r, **eff})
    return out


def merge_reports(old: dict | None, new: dict) -> dict:
    """`new`'s runs into `old` (same job only), a run of the same GPU count replacing the earlier one."""
    if old is not None and old.get("job") != new["job"]:
        a, b = old.get("job") or {}, new["job"]
        keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise InputError(
            f"the existing report measured another job (differs in {', '.join(keys)}): pass another --out, "
            "or the same --size, --rows, --seed and --set as before."
        )
    by_gpus = {r["gpus"]: r for r in (old or {}).get("runs", [])}
    by_gpus.update({r["gpus"]: r for r in new["runs"]})
    return {**new, "runs": with_efficiency(list(by_gpus.values()))}


def read_report(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path} is not a scaling report ({e}): pass another --out or remove it.") from None


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, path)


def parse_gpus(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise InputError(f"--gpus {text!r}: give GPU counts of at least 1, comma-separated (e.g. 1,2).")
    return counts


def job_overrides(size: str, extra: list[str]) -> list[str]:
    """The job settings of every run (no paths: they go into the report's job key)."""
    device = list(TINY_OVERRIDES) if size == "tiny" else list(FULL_OVERRIDES)
    return ["progress=false", "engine.precision=w4a4", *device, *extra]


def prepare_device(size: str, counts: list[int]) -> dict:
    """Environment of the runs: NVLink multicast off, and on CUDA the W4A4 kernels built before timing
    and required in every actor. Returns what it found."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # Ray starts its workers with this process's environment
    if size == "tiny":
        return {"device": "cpu", "w4a4_backend": "reference"}
    if not torch.cuda.is_available():
        sys.exit("bench/scaling.py --size full needs CUDA GPUs (use --size tiny for a CPU smoke run)")
    visible = torch.cuda.device_count()
    if max(counts) > visible:
        raise InputError(
            f"--gpus {max(counts)}: this host shows {visible} GPU(s); ask for at most that many."
        )
    from engine.kernels.build import load_extension

    start = time.perf_counter()
    ok, reason = load_extension()
    if not ok:
        sys.exit(f"the W4A4 CUDA kernels are unavailable: {reason}")
    return {
        "device": "cuda",
        "w4a4_backend": "cuda-sm90",
        "kernel_build_seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="", help="GPU counts to run, comma-separated (e.g. 1 or 1,2)")
    p.add_argument("--out", type=Path, default=results_path("scaling"))
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0, help="seed of the text lengths")
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra job config")
    p.add_argument("--merge", nargs="*", default=[], help="reports to merge into --out (no run needed)")
    p.add_argument("--work", help="new scratch folder, kept (default: a temp dir, removed at the end)")
    args = p.parse_args(argv)
    out = Path(args.out)
    report = read_report(out)
    for other in args.merge:
        found = read_report(Path(other))
        if found is None:
            raise InputError(f"--merge {other}: no such report; pass files written by bench/scaling.py.")
        report = merge_reports(report, found)
    if not args.gpus:
        if not args.merge:
            p.error("give --gpus to run, or --merge to merge reports")
        write_report(out, report)
        print(f"wrote {out}")
        return report
    counts = parse_gpus(args.gpus)
    if args.rows < 1:
        raise InputError(f"--rows {args.rows}: the job needs at least one row.")
    device = prepare_device(args.size, counts)
    if args.work and Path(args.work).exists() and any(Path(args.work).iterdir()):
        raise InputError(f"--work {args.work} is not empty: give a new folder (every run needs a fresh job).")
    work = Path(args.work or tempfile.mkdtemp(prefix="ovbatch-scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        distribution = write_manifest(work / "manifest.parquet", args.rows, args.seed)
        overrides = job_overrides(args.size, args.set)
        job = {"size": args.size, "rows": args.rows, "precision": "w4a4", "config": overrides,
               "distribution": distribution}  # fmt: skip
        merge_reports(report, {"job": job, "runs": []})  # another job in --out: refuse before the work
        start = time.perf_counter()
        source = ensure_tiny_checkpoint() if args.size == "tiny" else full_size_checkpoint(work / "ckpt")
        ckpt = rtn_w4a4_checkpoint(source, work / "ckpt-w4a4")
        build_s = round(time.perf_counter() - start, 1)
        for n in counts:
            run_overrides = [f"engine.checkpoint={ckpt}", *overrides]
            run = run_gpus(n, work / "manifest.parquet", work / f"job-{n}gpu", run_overrides)
            run["setup"] = {**device, "checkpoint_build_seconds": build_s}
            new = {"bench": "scaling", "job": job, "runs": [run]}
            report = merge_reports(report, new)
            write_report(out, report)
            if run["rows"]["failed"]:
                print(f"warning: {run['rows']['failed']} row(s) failed on {n} GPU(s)", file=sys.stderr)
            shown = ("gpus", "wall_seconds", "execution_seconds", "x_realtime_execution",
                     "engine_busy_fraction_per_gpu", "slowest_shard")  # fmt: skip
            print(json.dumps({k: run[k] for k in shown}), flush=True)
        print(f"wrote {out}")
        return report
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
