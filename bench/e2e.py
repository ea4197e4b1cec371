"""End to end on one GPU: the official package, our engine alone, and `ovbatch submit` (local and Ray)
over the same manifest, every row with its own reference clip.

Full-size OmniVoice dimensions with random weights (bench/pipeline.py's checkpoint; W4A4 by bench/scaling.py's
round-to-nearest speed copy), 32 steps. The manifest (bench/manifests.py): --rows rows, each with its own
3-10 s clip at 16-48 kHz, speech lengths log-normal around 4 s (1-20 s). Entries, one per part and precision:

- official_fp16_b{8,16,32,64}: the official package's `_generate_iterative` (fp16, eager) on the sizes of the
  first --official-rows rows (their text, reference frames and target frames; random reference codes), in
  batches of 8, 16, 32 or 64: token generation only, as the anchors measured it (needs `omnivoice`; a batch
  size that runs out of GPU memory gives an entry with `skipped` and the peak memory);
- engine_<p>: our Engine.synthesize over the same rows (clips encoded, tokens generated, audio decoded and
  post-processed; nothing written), in the batches the job makes, after a warm-up on other clips;
- job_local_<p>, job_ray_<p>: `ovbatch submit` in a process of its own, from its start to its exit (its
  imports, planning, clip encoding and writes included; Ray with one GPU actor).

Each entry: variant, rows, audio_seconds, wall_seconds, x_realtime (audio / wall), gpu_busy (mean nvidia-smi
utilization over the entry; jobs also gpu_busy_execution, from the workers' ready on, and gpu_busy_generating,
from then until the last batch was queued, and gpu_busy_timeline, the same in tenths; last_generated_seconds,
from the process's start to then, and tail_seconds, from then until it exited (tail_in_run_seconds until the
run's end event, tail_after_run_seconds after it: the summary and the exit); launch_seconds, from its start
until submit() began), padding_fraction (token-weighted share of each batch's graph bucket that holds no row),
mean_sm_clock_mhz, attention_backend (the engine's; for jobs, what attention=auto picks in the bench's
process, whose environment the job's workers inherit), startup_seconds (jobs: the time to the engines loaded
and their CUDA graphs captured that the planning did not hide, ready minus planning, so a Ray job's start of
Ray before its planning counts in it; capture_seconds of it; the CUDA extension is built
before the first part, as a machine that has run a job before has it), planning_seconds (and planning_phases:
plan_job's manifest, clips, rows and cut); the engine's load by
phase (load_breakdown, Engine.load_timings: weights, merge, codec, ...; jobs: of the slowest actor, beside its
import_seconds, load_seconds and boot_seconds; worker_start_seconds: Ray's start, before the planning, and its
parts (worker_start_parts: import, ray_init (with the CLI's early Ray, pipeline.ray_head: the wait for it and
the connection), actors)); the engine's seconds per phase (phases_seconds: prepare, the clips read and
encoded; generate; decode; postprocess) and the job summary's time split (time_split: planning, start,
capture, phases, other) and generation_idle (jobs: the generation stream's measured idle before each batch,
split into before shards' first batches and the others, with the longest gaps) and by_bucket (jobs: per plan
bucket, the rows' shares of generation, preparation ahead and that idle), and session (the machine session
that measured it: $OVBATCH_SESSION, which bench/gpu_session.sh sets once per machine, else this run's start;
README's "vs engine" compares a job with the engine of its own session). Each part starts from an empty
prompt cache. A device command is limited to 10 minutes: run some parts or precisions per call; entries merge
into --out by variant name, each with the environment (machine, versions) that measured it.

    python bench/e2e.py [--parts official,engine,job_local,job_ray | setup] [--precisions bf16,w4a4,fp8]
                        [--rows 2000] [--official-rows 512] [--size full|tiny] [--device auto]
                        [--out bench/results/e2e-<gpu>.json] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, results_path, write_result  # noqa: E402
from bench.manifests import write_distinct_clip_manifest  # noqa: E402
from bench.pipeline import GpuSampler, full_size_checkpoint  # noqa: E402
from bench.scaling import rtn_w4a4_checkpoint  # noqa: E402
from engine.generate.batching import bucket_for  # noqa: E402
from engine.tiny import ensure_tiny_checkpoint  # noqa: E402
from pipeline.cli import EXIT_FAILED_ROWS  # noqa: E402
from pipeline.config import load_job_config  # noqa: E402
from pipeline.sizing import frontend_sizer  # noqa: E402
from pipeline.store import JobDir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

PARTS = ("official", "engine", "job_local", "job_ray")
# --parts setup measures nothing: it makes the checkpoints, manifests and CUDA extension that the timed parts
# use (a device call of its own, e.g. beside GPU tests, before the timed calls that reuse --work).
SETUP = "setup"
OFFICIAL_BATCHES = (8, 16, 32, 64)  # 16 is the largest that fits an H200, 8 an H100
# Graph buckets up to 32,768 packed tokens (the defaults, stepping on by 512): batches of ~30 rows.
BUCKETS = str(list(range(512, 32769, 512))).replace(" ", "")
SETTINGS = {
    "full": ["engine.device=cuda", f"engine.buckets={BUCKETS}", "engine.max_batch_tokens=32768"],
    "tiny": ["engine.buckets=[256,512,1024,2048,4096]", "engine.max_batch_tokens=4096"],
}


def gpu_fields(gpu: GpuSampler) -> dict:
    """gpu_busy and mean_sm_clock_mhz of the busiest GPU over an entry (None without nvidia-smi), and the
    nvidia-smi queries that gave no sample (the means are over the others)."""
    if not gpu.by_gpu:
        return {"gpu_busy": None, "mean_sm_clock_mhz": None, "gpu_samples_missed": gpu.missed}
    busiest = max(gpu.by_gpu, key=lambda i: statistics.fmean(gpu.by_gpu[i]))
    return {
        "gpu_busy": round(statistics.fmean(gpu.by_gpu[busiest]) / 100, 3),
        "mean_sm_clock_mhz": round(statistics.fmean(gpu.sm_mhz[busiest]), 1),
        "gpu_samples_missed": gpu.missed,
    }


def busy_since(gpu: GpuSampler, since: float, until: float = float("inf")) -> float | None:
    """The busiest GPU's mean utilization over the samples taken from `since` to `until` (perf_counter): a
    job's execution, once its workers were ready (None without samples then)."""
    return _busiest_mean(gpu, lambda t: since <= t <= until)


def busy_timeline(gpu: GpuSampler, since: float, until: float, parts: int = 10) -> list[float | None] | None:
    """busy_since over `parts` equal slices of [since, until] (each but the last open at its end): where in
    a job its GPU idled (its shards run from the longest rows to the shortest, which bring the most clips
    to encode a second of audio). None without nvidia-smi."""
    if not gpu.by_gpu:
        return None
    width = (until - since) / parts
    bounds = [since + i * width for i in range(parts)] + [until]
    return [
        _busiest_mean(gpu, lambda t, lo=lo, hi=hi, last=i == parts - 1: lo <= t < hi or (last and t == hi))
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))
    ]


def _busiest_mean(gpu: GpuSampler, keep) -> float | None:
    means = [
        statistics.fmean(inside)
        for i in gpu.by_gpu
        if (inside := [p for p, t in zip(gpu.by_gpu[i], gpu.times[i]) if keep(t)])
    ]
    return round(max(means) / 100, 3) if means else None


def by_bucket(rows: list[dict]) -> dict[str, dict] | None:
    """Per plan bucket (its packed-token bound): rows, audio seconds, and the rows' shares of their batches'
    generation, preparation ahead and generation-stream idle. None where no row has them (an engine
    factory's engine may time no phase)."""
    phases = ("generate_seconds", "prepare_ahead_seconds", "generation_idle_seconds")
    buckets: dict[int, dict[str, float]] = {}
    for r in rows:
        b = buckets.setdefault(r["bucket"], {"rows": 0, **dict.fromkeys(("audio_seconds", *phases), 0.0)})
        b["rows"] += 1
        b["audio_seconds"] += r["audio_seconds"] or 0.0
        for phase in phases:
            b[phase] += r.get(phase) or 0.0
    if not any(b["generate_seconds"] for b in buckets.values()):
        return None
    return {str(k): {n: round(v, 2) for n, v in b.items()} for k, b in sorted(buckets.items())}


def padding_fraction(batches: list[int], buckets: list[int]) -> float | None:
    """Share of the graph buckets the batches ran in (packed tokens each) that no row filled."""
    padded = sum(bucket_for(tokens, buckets) or tokens for tokens in batches)
    return round(1 - sum(batches) / padded, 4) if padded else None


def per_batch(rows: list[dict], column: str) -> dict[tuple, float]:
    """A results column summed per batch (the rows of a shard that started together), where it is set."""
    sums: dict[tuple, float] = {}
    for r in rows:
        if r.get(column) is not None:
            key = (r["shard"], r["started_at"])
            sums[key] = sums.get(key, 0) + r[column]
    return sums


def idle_by_batch(rows: list[dict]) -> dict | None:
    """Where the generation stream idled (results' generation_idle_seconds, summed per batch: the rows of
    a shard that started together): in all, before the first batch of each shard (waiting for its clips or
    for the device's turn) and before the others (waiting for the batch's preparation), and the longest
    gaps. None where no batch measured it (CPU)."""
    first_start: dict[int, str] = {}
    for r in rows:
        first_start[r["shard"]] = min(first_start.get(r["shard"], r["started_at"]), r["started_at"])
    batches = per_batch(rows, "generation_idle_seconds")
    if not batches:
        return None
    first = {k for k in batches if k[1] == first_start[k[0]]}
    longest = sorted(batches.items(), key=lambda kv: -kv[1])[:5]
    return {
        "batches": len(batches),
        "seconds": round(sum(batches.values()), 3),
        "shard_first_batches_seconds": round(sum(batches[k] for k in first), 3),
        "other_batches_seconds": round(sum(v for k, v in batches.items() if k not in first), 3),
        "longest": [
            {"shard": shard, "first_of_shard": (shard, start) in first, "seconds": round(v, 3)}
            for (shard, start), v in longest
        ],
    }


def entry(variant: str, rows: int, audio: float, wall: float, gpu: GpuSampler, **extra) -> dict:
    return {
        "variant": variant,
        "rows": rows,
        "audio_seconds": round(audio, 2),
        "wall_seconds": round(wall, 2),
        "x_realtime": round(audio / wall, 2) if wall > 0 else None,
        **gpu_fields(gpu),
        **extra,
    }


def attention_here(device: str) -> str:
    """The attention backend attention=auto picks for bf16 on `device` (auto, cpu, cuda) in this process."""
    import torch

    from engine.devices import resolve_device
    from engine.model.attention import choose_attention

    return choose_attention("auto", resolve_device(device), torch.bfloat16).name


def job_entry(variant: str, mode: str, manifest: Path, work: Path, settings: list[str]) -> dict:
    """`ovbatch submit` in a process of its own, as a user runs it: its imports (torch, Ray, flash-attn-4)
    and the engines' load are in its time, none left over from the bench's earlier parts."""
    overrides = [f"local={str(mode == 'local').lower()}", "ray.num_actors=1", *settings]
    cfg = load_job_config(None, overrides)
    job_dir = work / f"job-{variant}"
    shutil.rmtree(job_dir, ignore_errors=True)  # a fresh job, never a resume of an earlier call's
    command = [sys.executable, "-m", "pipeline.cli", "submit", str(manifest), "--out", str(job_dir)]
    command += overrides
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    start, start_epoch = time.perf_counter(), time.time()
    with GpuSampler() as gpu:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode not in (0, EXIT_FAILED_ROWS):
        raise RuntimeError(f"{variant}: submit exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    job = JobDir(job_dir)
    summary = json.loads(job.summary_path.read_text())
    results = job.read_results().to_pylist()
    ok = [r for r in results if r["status"] == "ok"]
    run = summary["runs"][-1]
    # the run's clock starts in submit(), after the process started and imported the CLI
    launch = datetime.fromisoformat(run["started_at"]).timestamp() - start_epoch
    # a row's finished_at: when its batch's generate() returned, the batch queued on the device (its
    # generation, decode and writes follow)
    generated = [datetime.fromisoformat(r["finished_at"]).timestamp() for r in results if r["finished_at"]]
    last = max(generated) - start_epoch if generated else wall
    ready = start + launch + run["ready_seconds"]
    return entry(
        variant,
        len(ok),
        sum(r["audio_seconds"] for r in ok),
        wall,
        gpu,
        padding_fraction=padding_fraction([*per_batch(ok, "packed_tokens").values()], [*cfg.engine.buckets]),
        attention_backend=attention_here(cfg.engine.device),
        gpu_busy_execution=busy_since(gpu, ready),  # from the workers' ready on
        # the same until the last batch was queued, and what came after it (its generation, decode and writes,
        # the results and summary, the workers' stop)
        gpu_busy_generating=busy_since(gpu, ready, start + last),
        gpu_busy_timeline=busy_timeline(gpu, ready, start + last),
        last_generated_seconds=round(last, 2),
        tail_seconds=round(wall - last, 2),
        # the tail split where the run ended (its `end` event, after the last shard's results and the workers'
        # stop): before, the last batch's device work and writes; after, the summary and the process's exit
        tail_in_run_seconds=round(launch + run["wall_seconds"] - last, 2),
        tail_after_run_seconds=round(wall - launch - run["wall_seconds"], 2),
        launch_seconds=round(launch, 2),  # the process's start and its imports before submit() began
        planning_seconds=run["planning_seconds"],
        planning_phases=run.get("planning_phases") or None,  # plan_job's: manifest, clips, rows, cut
        # from the end of planning until the engines were loaded and their graphs captured
        startup_seconds=round(run["ready_seconds"] - run["planning_seconds"], 2),
        capture_seconds=run["capture_seconds"],
        warmed_clips=run.get("warmed_clips"),  # reference clips encoded while the job planned
        import_seconds=run.get("import_seconds"),  # the engine's modules imported in the worker
        load_seconds=run.get("load_seconds"),  # the engines' load in the worker (slowest actor)
        load_breakdown=run.get("load_breakdown"),  # its seconds by phase (Engine.load_timings)
        boot_seconds=run.get("boot_seconds"),  # Ray: until the actor's process was up
        worker_start_seconds=run.get("worker_start_seconds"),  # Ray's start, before the planning
        worker_start_parts=run.get("worker_start_parts") or None,  # import ray, ray.init, actors created
        graphs=run["graphs"],
        rows_not_ok=len(results) - len(ok),
        engine_x_realtime=summary["engine_x_realtime"],
        time_split=summary["time"],
        generation_idle=idle_by_batch(ok),
        by_bucket=by_bucket(ok),
    )


def engine_entry(precision: str, manifest: Path, warmup: Path, settings: list[str]) -> dict:
    """Our engine over the manifest's rows in the job's batches, after a warm-up over warmup's rows."""
    from engine.api import Engine
    from pipeline.job import plan_job
    from pipeline.rows import RequestRow
    from pipeline.shard_runner import pack_batches, synth_request

    cfg = load_job_config(None, settings)
    engine = Engine(cfg.engine_config(cfg.variant_names()[0]))

    def batches_of(path: Path):
        cfg.manifest = str(path)
        plan, rows = plan_job(cfg, frontend_sizer, clip_dir=None)
        by_id = {r.id: r for r in rows}
        for shard in plan.shards:
            requests = [RequestRow.of(by_id[p.id], p) for p in shard.rows]
            yield from pack_batches(requests, cfg.engine_config(cfg.variant_names()[0]))

    for batch in batches_of(warmup):
        engine.synthesize([synth_request(r) for r in batch])
    timed = list(batches_of(manifest))
    audio = 0.0
    phases = dict.fromkeys(("prepare", "generate", "decode", "postprocess"), 0.0)
    with GpuSampler() as gpu:
        start = time.perf_counter()
        for batch in timed:
            outputs = engine.synthesize([synth_request(r) for r in batch])
            audio += sum(len(o.audio) / o.sample_rate for o in outputs)
            for phase in ("prepare", "generate", "decode"):  # the batch's, on every output
                phases[phase] += outputs[0].timings[phase]
            phases["postprocess"] += sum(o.timings["postprocess"] for o in outputs)
        wall = time.perf_counter() - start
    tokens = [sum(r.packed_tokens for r in batch) for batch in timed]
    return entry(
        f"engine_{precision}",
        sum(len(b) for b in timed),
        audio,
        wall,
        gpu,
        padding_fraction=padding_fraction(tokens, list(cfg.engine.buckets)),
        attention_backend=engine.model.attention_backend(engine.device, engine.dtype).name,
        batches=len(timed),
        load_breakdown=engine.load_timings,  # the same load in this process, to set against the jobs'
        phases_seconds={k: round(v, 2) for k, v in phases.items()},
    )


def official_entries(manifest: Path, settings: list[str], limit: int):
    """The official package's token generation on the first `limit` rows' sizes, an entry for each batch of
    OFFICIAL_BATCHES as it finishes (a batch that runs out of GPU memory gives an entry saying so)."""
    import torch

    from bench.parity import Request, build_official, official_inputs
    from pipeline.manifest import load

    try:
        official = build_official("full", seed=0, device="cuda").half()
        from omnivoice.models.omnivoice import OmniVoiceGenerationConfig
    except ImportError as e:
        yield {"variant": "official_fp16", "skipped": f"the official package is not importable: {e}"}
        return
    rows = load(manifest).rows[:limit]
    sizer = frontend_sizer(load_job_config(None, settings), rows)
    requests = []
    for row in rows:
        size = sizer(row)
        requests.append(Request(row.text, size.ref_frames, size.target_frames))
    audio = sum(r.target_len for r in requests) / 25.0  # the codec's 25 frames a second
    for batch in OFFICIAL_BATCHES:
        variant = f"official_fp16_b{batch}"
        chunks = [requests[i : i + batch] for i in range(0, len(requests), batch)]
        torch.cuda.reset_peak_memory_stats()
        try:
            official._generate_iterative(
                official_inputs(official, chunks[0], seed=0)[0], OmniVoiceGenerationConfig()
            )
            with GpuSampler() as gpu:
                start = time.perf_counter()
                for i, chunk in enumerate(chunks):
                    task = official_inputs(official, chunk, seed=i)[0]
                    official._generate_iterative(task, OmniVoiceGenerationConfig())
                torch.cuda.synchronize()
                wall = time.perf_counter() - start
            result = entry(variant, len(requests), audio, wall, gpu, tokens_only=True)
        except torch.OutOfMemoryError as e:  # it pads a batch to its longest row
            result = {"variant": variant, "skipped": f"CUDA out of memory at batch {batch}: {str(e)[:120]}"}
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        torch.cuda.empty_cache()  # after the except block: its traceback no longer holds the batch's tensors
        yield result


def checkpoint_for(precision: str, ckpt: Path, work: Path) -> Path:
    """The checkpoint a precision loads: W4A4 its round-to-nearest copy of `ckpt` (made in `work` once), the
    others `ckpt` itself (fp8 quantizes at load)."""
    if precision != "w4a4":
        return ckpt
    copy = work / "ckpt-w4a4"
    return copy if copy.is_dir() else rtn_w4a4_checkpoint(ckpt, copy)


def checkpoint_and_manifest(work: Path, size: str, rows: int) -> tuple[Path, Path]:
    """The checkpoint of `size` and the manifest of `rows` distinct-clip rows (seed 1), made in `work`
    unless an earlier call left them there."""
    ckpt = ensure_tiny_checkpoint() if size == "tiny" else work / "ckpt"
    if size == "full" and not (ckpt / "audio_tokenizer" / "model.safetensors").is_file():
        full_size_checkpoint(ckpt)
    manifest = work / f"m-{rows}.parquet"
    if not manifest.is_file():
        write_distinct_clip_manifest(manifest, work / f"clips-{rows}", rows, seed=1)
    return ckpt, manifest


def merge(out: Path, new: list[dict], meta: dict) -> dict:
    report = json.loads(out.read_text()) if out.is_file() else {"bench": "e2e", "entries": []}
    names = {e["variant"] for e in new}
    if "environment" in meta:  # each entry keeps the machine and versions that measured it; the top level's
        new = [{**e, "environment": meta["environment"]} for e in new]  # are the last call's only
    report["entries"] = [e for e in report["entries"] if e["variant"] not in names] + new
    report.update(meta)
    return report


def parse_parts(text: str) -> list[str]:
    """--parts: a comma-separated subset of PARTS, or setup alone."""
    parts = text.split(",")
    if parts == [SETUP]:
        return []
    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown part(s) {', '.join(map(repr, unknown))}: "
            f"name some of {', '.join(PARTS)}, or {SETUP} alone"
        )
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=parse_parts, default=",".join(PARTS))
    p.add_argument("--precisions", default="bf16,w4a4,fp8")
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--official-rows", type=int, default=512, help="rows the official package runs")
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, default=results_path("e2e"))
    p.add_argument("--work", help="scratch folder (default: a temp dir, removed at the end)")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="ovbatch-e2e-")).resolve()  # manifests name clips by it
    work.mkdir(parents=True, exist_ok=True)
    try:
        ckpt, manifest = checkpoint_and_manifest(work, args.size, args.rows)
        warmup = work / "warmup.parquet"
        if not warmup.is_file():
            write_distinct_clip_manifest(warmup, work / "warmup-clips", 64, seed=2)
        if args.size == "full":  # a fresh machine builds the CUDA extension once: not in a timed part
            from engine.kernels.build import load_extension

            load_extension()
        base = [*SETTINGS[args.size], f"engine.device={args.device}", "progress=false"]
        meta = {"size": args.size, "rows": args.rows, "environment": environment("ray", "omnivoice")}

        # "vs engine" compares entries of one session (one machine, one lease): gpu_session.sh names it
        session = os.environ.get("OVBATCH_SESSION") or datetime.now().astimezone().strftime(
            "%Y-%m-%dT%H:%M%z"
        )

        def record(new: list[dict]) -> None:  # entry by entry: a call cut short keeps what it measured
            for e in new:
                e["session"] = session
                print(json.dumps(e), flush=True)
            write_result(args.out, merge(Path(args.out), new, meta))

        if "official" in args.parts:
            for e in official_entries(manifest, [f"engine.checkpoint={ckpt}", *base], args.official_rows):
                record([e])
        for precision in args.precisions.split(","):
            settings = [
                f"engine.checkpoint={checkpoint_for(precision, ckpt, work)}",
                f"engine.precision={precision}",
                f"engine.prompt_cache_dir={work / f'prompts-{precision}'}",
                *base,
            ]
            if "engine" in args.parts:
                shutil.rmtree(work / f"prompts-{precision}", ignore_errors=True)  # every clip encoded
                record([engine_entry(precision, manifest, warmup, settings)])
            for mode in ("local", "ray"):
                if f"job_{mode}" in args.parts:
                    shutil.rmtree(work / f"prompts-{precision}", ignore_errors=True)  # every clip encoded
                    record([job_entry(f"job_{mode}_{precision}", mode, manifest, work, settings)])
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
