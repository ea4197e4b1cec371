"""Where a local job's GPU waits: the shard runner (its preload thread, writer threads and the threads of the
shards in flight) over distinct-clip rows, under torch.profiler.

bench/e2e.py's full-size checkpoint (random weights), manifest and settings, one variant. After a warm-up over
the first --warmup-shards shards, 2 x --shards shards spread evenly over the rest of the plan (its buckets run
from long rows to short ones, and short rows bring more clips a second) go in turn to two sets: the first runs
unprofiled (wall, x realtime), the second profiled. From the profiled run: the window from the first shard
taking the device to the last one leaving it, the device's busy time in it (union of kernels, copies and
sets), and each idle gap put down to the innermost `ovbatch.*` range (pipeline/shard_runner.py, engine/api.py,
engine/frontend/prompt.py) open on the thread holding the device at the gap's middle ("shard loop" when only
the hold itself is open, "no shard on the device" between shards), with what the other threads were inside
meanwhile (idle_beside: the then thread's encode, the preload, writers). The profiler slows the host, so idle
seconds are an upper bound; their split is the point. nvidia-smi's mean utilization is sampled over both runs
too (gpu_busy_nvidia_smi), to set the e2e bench's figure, which comes from it, against the profiler's,
Python's garbage collections over the unprofiled run (each holds every thread of the process), and whether
the clips' encode waits on its host thread or on the device (encode_launches), and the device's peak
memory. --prepare-threads, --switch-interval-ms and --encode-batch-seconds are for A/B runs: a thread that
launches device work releases the interpreter's lock around each torch op, and taking it back from a thread
that runs Python can wait up to the switch interval; the codec's batch budget (ENCODE_BATCH_SECONDS) sets
how many codec batches, each ~800 kernels and one copy of its codes back to the host, an encode makes.

    python bench/profile_job.py [--rows 3000] [--shards 4] [--warmup-shards 2] [--precision bf16]
                                [--prepare-threads 2] [--switch-interval-ms 5] [--encode-batch-seconds 240]
                                [--work DIR] [--size full|tiny] [--out bench/results/profile-job-<gpu>.json]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.e2e import SETTINGS, attention_here, checkpoint_and_manifest, checkpoint_for, gpu_fields  # noqa: E402
from bench.environment import environment, results_path, write_result  # noqa: E402
from bench.pipeline import GpuSampler  # noqa: E402
from bench.profile_generate import busy_us  # noqa: E402
from engine.codec import model as codec_model  # noqa: E402
from pipeline.config import load_job_config  # noqa: E402
from pipeline.job import plan_job  # noqa: E402
from pipeline.rows import RequestRow  # noqa: E402
from pipeline.shard_runner import PREPARE_THREADS, ShardRunner, ShardTask, run_local  # noqa: E402
from pipeline.sizing import frontend_sizer  # noqa: E402

ON_DEVICE = "ovbatch.shard_on_device"
MIN_GAP_US = 20.0  # shorter gaps are kernel launch spacing, not waiting


def run(runner: ShardRunner, tasks: list[ShardTask]) -> tuple[float, float]:
    """(wall seconds, audio seconds) of the tasks through run_local."""
    start = time.perf_counter()
    audio = sum(r.audio_seconds or 0.0 for _, results in run_local(runner, tasks) for r in results)
    return time.perf_counter() - start, audio


class GcPauses:
    """Python's garbage collections while a run lasts: how many of each generation, the seconds they held
    the process (the collector holds the GIL: no thread launches work meanwhile) and the longest; after
    the run, the objects the collector walks and those the runner froze out of its walks
    (ShardRunner.capture), and what one full collection takes as the runner leaves it and with nothing
    frozen."""

    def __init__(self):
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = 0.0
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started
        self.collections[info["generation"]] += 1
        self.seconds[info["generation"]] += seconds
        self.longest = max(self.longest, seconds)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def report(self) -> dict:
        walked, frozen = len(gc.get_objects()), gc.get_freeze_count()
        full = _seconds(gc.collect)
        gc.unfreeze()
        full_unfrozen = _seconds(gc.collect)
        gc.freeze()
        return {
            "collections": dict(enumerate(self.collections)),
            "seconds": {g: round(s, 3) for g, s in enumerate(self.seconds)},
            "longest_s": round(self.longest, 4),
            "walked_objects": walked,
            "frozen_objects": frozen,
            "full_collection_s": round(full, 4),
            "full_collection_unfrozen_s": round(full_unfrozen, 4),
        }


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def spread_pair(tasks: list, count: int) -> tuple[list, list]:
    """Two disjoint sets of `count` tasks each, taken in turn from 2 x count evenly spaced over `tasks`."""
    spread = [tasks[i * len(tasks) // (2 * count)] for i in range(2 * count)]
    return spread[0::2], spread[1::2]


def idle_split(events) -> dict:
    """The window the shards held the device, its busy fraction and its idle gaps by open range, from the
    profiler's kineto events."""
    from torch.autograd import DeviceType

    device = sorted(
        (e.start_ns() / 1e3, e.end_ns() / 1e3) for e in events if e.device_type() == DeviceType.CUDA
    )
    ranges = [
        (e.start_thread_id(), e.start_ns() / 1e3, e.end_ns() / 1e3, e.name())
        for e in events
        if e.device_type() == DeviceType.CPU and e.name().startswith("ovbatch.")
    ]
    holds = [(thread, s, e) for thread, s, e, name in ranges if name == ON_DEVICE]
    if not holds:
        return {"skipped": "no shard held the device under the profiler"}
    start, end = min(s for _, s, _ in holds), max(e for _, _, e in holds)
    busy = busy_us([(max(s, start), min(e, end)) for s, e in device if e > start and s < end])
    gaps, cursor = [], start
    for s, e in device:
        if s > cursor + MIN_GAP_US and cursor < end:
            gaps.append((cursor, min(s, end)))
        cursor = max(cursor, e)
    if cursor + MIN_GAP_US < end:
        gaps.append((cursor, end))
    by_thread: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for thread, s, e, name in ranges:
        by_thread[thread].append((s, e, name))
    by_range: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    beside: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for gap_start, gap_end in gaps:
        middle = (gap_start + gap_end) / 2
        holder = next((t for t, s, e in holds if s <= middle < e), None)
        if holder is None:
            label = "no shard on the device"
        else:
            label = _innermost(by_thread[holder], middle) or "shard loop"
            label = "shard loop" if label == ON_DEVICE else label
        by_range[label][0] += gap_end - gap_start
        by_range[label][1] += 1
        for thread in by_thread.keys() - {holder}:
            other = _innermost(by_thread[thread], middle)
            if other is not None and other not in (ON_DEVICE, "ovbatch.wait_device"):
                beside[label][other] += gap_end - gap_start
    host: dict[str, float] = defaultdict(float)
    for _, s, e, name in ranges:
        host[name] += e - s
    window = end - start
    return {
        "window_s": round(window / 1e6, 3),
        "busy_fraction": round(busy / window, 4),
        "idle_s": round((window - busy) / 1e6, 3),
        "idle_by_range": {
            k: {"s": round(v[0] / 1e6, 3), "gaps": v[1]}
            for k, v in sorted(by_range.items(), key=lambda kv: -kv[1][0])
        },
        # what the other threads were inside meanwhile (the then thread's encode or prompt store, the
        # preload thread, writers), in seconds of those gaps: a gap counts once per thread
        "idle_beside": {
            k: {o: round(v / 1e6, 3) for o, v in sorted(others.items(), key=lambda kv: -kv[1])}
            for k, others in beside.items()
        },
        "host_range_s": {k: round(v / 1e6, 3) for k, v in sorted(host.items(), key=lambda kv: -kv[1])},
    }


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def encode_launches(events) -> dict:
    """Whether the clips' encode (`ovbatch.encode`) waits on its host thread or on the device: its kernels,
    matched to their launches by correlation id. launch_span_s: from each encode's first launch to its last,
    summed; beside host_s (the ranges' seconds) it says how long the host was still launching. device_s: the
    kernels' own seconds; queue_ms: from a kernel's launch to its start (the device busy with other work,
    or the kernels before it)."""
    from torch.autograd import DeviceType

    ranges: dict[int, list[tuple[float, float]]] = defaultdict(list)
    launched: dict[int, tuple[int, float]] = {}  # correlation id -> (launching thread, launch start)
    for e in events:
        if e.device_type() != DeviceType.CPU:
            continue
        if e.name() == "ovbatch.encode":
            ranges[e.start_thread_id()].append((e.start_ns() / 1e3, e.end_ns() / 1e3))
        elif e.name() in LAUNCHES:
            launched[e.correlation_id()] = (e.start_thread_id(), e.start_ns() / 1e3)
    per_range: dict[tuple[int, float, float], list[tuple[float, float, float]]] = defaultdict(list)
    for e in events:
        if e.device_type() != DeviceType.CUDA or e.correlation_id() not in launched:
            continue
        thread, at = launched[e.correlation_id()]
        inside = next(((s, end) for s, end in ranges.get(thread, []) if s <= at < end), None)
        if inside is not None:
            per_range[(thread, *inside)].append((at, e.start_ns() / 1e3, e.end_ns() / 1e3))
    kernels = [k for ks in per_range.values() for k in ks]
    if not kernels:
        return {"skipped": "no kernel launched inside ovbatch.encode matched its launch"}
    queue = sorted(start - at for at, start, _ in kernels)
    return {
        "encodes": len(per_range),
        "kernels": len(kernels),
        "host_s": round(sum(end - s for _, s, end in per_range) / 1e6, 4),
        "launch_span_s": round(
            sum(max(k[0] for k in ks) - min(k[0] for k in ks) for ks in per_range.values()) / 1e6, 4
        ),
        "device_s": round(sum(end - start for _, start, end in kernels) / 1e6, 4),
        "queue_ms_median": round(statistics.median(queue) / 1e3, 3),
        "queue_ms_p90": round(queue[int(len(queue) * 0.9)] / 1e3, 3),
    }


def _innermost(ranges: list[tuple[float, float, str]], at: float) -> str | None:
    """The innermost of one thread's (start, end, name) ranges open at time `at`: the latest to open, and of
    those the first to close."""
    open_here = [(s, -e, name) for s, e, name in ranges if s <= at < e]
    return max(open_here)[2] if open_here else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=3000, help="manifest rows (bench/e2e.py's manifest)")
    p.add_argument("--shards", type=int, default=4, help="shards run unprofiled, then profiled")
    p.add_argument("--warmup-shards", type=int, default=2)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--device", default="auto")
    p.add_argument("--prepare-threads", type=int, default=PREPARE_THREADS, help="preparing threads")
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        help="the interpreter's thread switch interval (sys.setswitchinterval; Python's default: 5 ms)",
    )
    p.add_argument(
        "--encode-batch-seconds",
        type=float,
        default=codec_model.ENCODE_BATCH_SECONDS,
        help="padded audio a codec encode batch may hold (engine.codec.model.ENCODE_BATCH_SECONDS)",
    )
    p.add_argument("--work", help="scratch folder (bench/e2e.py's --work is reused)")
    p.add_argument("--out", type=Path, default=results_path("profile-job"))
    args = p.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    codec_model.ENCODE_BATCH_SECONDS = args.encode_batch_seconds  # read by Codec.encode at each call
    work = Path(args.work or tempfile.mkdtemp(prefix="ovbatch-profile-job-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        ckpt, manifest = checkpoint_and_manifest(work, args.size, args.rows)
        prompts, job_dir = work / "profile-prompts", work / "profile-job"
        for folder in (prompts, job_dir):
            shutil.rmtree(folder, ignore_errors=True)  # every clip encoded, as in a fresh job
        settings = [
            *SETTINGS[args.size],
            f"engine.device={args.device}",
            f"engine.checkpoint={checkpoint_for(args.precision, ckpt, work)}",
            f"engine.precision={args.precision}",
            f"engine.prompt_cache_dir={prompts}",
            "local=true",
            "progress=false",
        ]
        cfg = load_job_config(None, settings, {"manifest": str(manifest)})
        plan, rows = plan_job(cfg, frontend_sizer, clip_dir=None)
        by_id = {r.id: r for r in rows}
        tasks = [
            ShardTask(s.index, s.variant, s.bucket, 1, [RequestRow.of(by_id[p.id], p) for p in s.rows])
            for s in plan.shards
        ]
        warm, timed = args.warmup_shards, args.shards
        if len(tasks) < warm + 2 * timed:
            sys.exit(f"--rows {args.rows} plans {len(tasks)} shards; {warm + 2 * timed} are needed.")
        unprofiled, profiled = spread_pair(tasks[warm:], timed)
        runner = ShardRunner(job_dir, cfg, prepare_threads=args.prepare_threads)
        runner.load_engines(cfg.variant_names())
        runner.capture(tasks)
        run(runner, tasks[:warm])
        with GpuSampler() as gpu, GcPauses() as collections:
            wall, audio = run(runner, unprofiled)
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerActivity, profile

        every_thread = _ExperimentalConfig(profile_all_threads=True)  # the shards run on their own threads
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with (
            GpuSampler() as profiled_gpu,
            profile(activities=activities, experimental_config=every_thread) as prof,
        ):
            profiled_wall, profiled_audio = run(runner, profiled)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        events = prof.profiler.kineto_results.events()  # raw events: far quicker than events()
        split = idle_split(events)
        report = {
            "bench": "profile_job",
            "environment": environment(),
            "size": args.size,
            "precision": args.precision,
            "prepare_threads": args.prepare_threads,
            "switch_interval_ms": round(sys.getswitchinterval() * 1000, 3),
            "encode_batch_seconds": codec_model.ENCODE_BATCH_SECONDS,
            "attention_backend": attention_here(args.device),
            "shards": timed,
            "unprofiled": {
                "shards": [t.index for t in unprofiled],
                "rows": sum(len(t.rows) for t in unprofiled),
                "wall_s": round(wall, 3),
                "audio_s": round(audio, 2),
                "x_realtime": round(audio / wall, 2),
                "gpu_busy_nvidia_smi": gpu_fields(gpu)["gpu_busy"],
                "garbage_collections": collections.report(),
            },
            "profiled": {
                "shards": [t.index for t in profiled],
                "rows": sum(len(t.rows) for t in profiled),
                "wall_s": round(profiled_wall, 3),
                "audio_s": round(profiled_audio, 2),
                **split,
                "encode_launches": encode_launches(events),
                "gpu_busy_nvidia_smi": gpu_fields(profiled_gpu)["gpu_busy"],  # over the run, not the window
            },
            # both runs and the warm-up: the engine, the graphs, two batches' encodes at once
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if torch.cuda.is_available()
            else None,
        }
        print(report)
        write_result(args.out, report)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
