"""The batch job on one GPU: the same manifest through a Ray GPU actor and in local mode (no Ray).

Full-size OmniVoice dimensions with random weights (model and codec; the tiny checkpoint's tokenizer) by
default, or the tiny checkpoint (--size tiny). The manifest cycles over the repo's speech clips with
short, medium and long texts, so rows fall into several graph buckets. Reported per mode: rows, wall
seconds (planning included and excluded), audio seconds, x-realtime, engine busy fraction (sum of batch
wall times / execution wall time), GPU utilisation sampled with nvidia-smi, per-bucket rows/s.

    python bench/pipeline.py [--out bench/results/pipeline-<gpu>.json] [--rows 512] [--size full|tiny]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import save_file  # noqa: E402

from bench.environment import environment, results_path, write_result  # noqa: E402
from engine.codec import Codec  # noqa: E402
from engine.codec.checkpoint import OMNIVOICE_CODEC_CONFIG, read_codec_config  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.tiny import ensure_tiny_checkpoint, tiny_state_dict  # noqa: E402
from engine.tiny.codec import preprocessor_config, random_codec_weights  # noqa: E402
from pipeline.config import load_job_config  # noqa: E402
from pipeline.demo import CLIPS_DIR, demo_clips  # noqa: E402
from pipeline.job import submit  # noqa: E402
from pipeline.sizing import frontend_sizer  # noqa: E402

TEXTS = (
    "Hello there.",
    "Good morning, how are you today?",
    "The train to the coast leaves at nine, so please do not be late for it this time.",
    "Batch synthesis turns a long list of sentences into speech, one clean file for every row of the "
    "manifest, while the graphs stay warm on the device and the queue keeps moving along.",
)


def full_size_configs(out: Path) -> Path:
    """OmniVoice's real configs (model and codec) and the tiny tokenizer, no weights: what a planner
    reads of a full-size checkpoint."""
    tiny = ensure_tiny_checkpoint()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, out / name)
    (out / "config.json").write_text(json.dumps(ModelConfig().to_dict(), indent=2) + "\n")
    codec_dir = out / "audio_tokenizer"
    codec_dir.mkdir(exist_ok=True)
    (codec_dir / "config.json").write_text(json.dumps(OMNIVOICE_CODEC_CONFIG, indent=2) + "\n")
    codec_cfg = read_codec_config(codec_dir / "config.json")
    (codec_dir / "preprocessor_config.json").write_text(
        json.dumps(preprocessor_config(codec_cfg.hop_length, codec_cfg.sample_rate), indent=2) + "\n"
    )
    return out


def full_size_checkpoint(out: Path) -> Path:
    """OmniVoice's real dimensions with seeded random weights (model and codec), tiny tokenizer."""
    full_size_configs(out)
    weights = {k: v.to(torch.bfloat16) for k, v in tiny_state_dict(ModelConfig()).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    codec_dir = out / "audio_tokenizer"
    codec_cfg = read_codec_config(codec_dir / "config.json")
    torch.manual_seed(0)
    save_file(random_codec_weights(Codec(codec_cfg), codec_cfg), str(codec_dir / "model.safetensors"))
    return out


def write_clip_manifest(path: Path, texts: list[str], id_prefix: str) -> Path:
    """A manifest with one row per text, cycling over the repo's speech clips as references."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    clips = sorted(demo_clips().items())
    rows = len(texts)
    pq.write_table(
        pa.table(
            {
                "id": [f"{id_prefix}{i:05d}" for i in range(rows)],
                "text": texts,
                "ref_audio": [str(CLIPS_DIR / clips[i % len(clips)][0]) for i in range(rows)],
                "ref_text": [clips[i % len(clips)][1] for i in range(rows)],
                "language": ["en"] * rows,
            }
        ),
        path,
    )
    return path


def write_manifest(path: Path, rows: int) -> Path:
    return write_clip_manifest(path, [TEXTS[i % len(TEXTS)] for i in range(rows)], "b")


def parse_gpu_samples(text: str) -> dict[int, tuple[float, float]]:
    """`nvidia-smi --query-gpu=index,utilization.gpu,clocks.sm --format=csv,noheader,nounits` ->
    {index: (utilization percent, SM clock MHz)}."""
    samples = {}
    for line in text.strip().splitlines():
        index, percent, mhz = line.split(",")
        samples[int(index)] = (float(percent), float(mhz))
    return samples


SAMPLE_SECONDS = 0.5


class GpuSampler:
    """nvidia-smi utilization.gpu and SM clock of every GPU every SAMPLE_SECONDS while a run lasts (empty
    without nvidia-smi), and when each sample was taken (time.perf_counter); `missed`: queries that timed out
    or read as no sample, each skipped."""

    def __init__(self):
        self.by_gpu: dict[int, list[float]] = {}  # utilization percent
        self.sm_mhz: dict[int, list[float]] = {}
        self.times: dict[int, list[float]] = {}
        self.missed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        query = ["nvidia-smi", "--query-gpu=index,utilization.gpu,clocks.sm", "--format=csv,noheader,nounits"]
        while not self._stop.wait(SAMPLE_SECONDS):
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout
                samples = parse_gpu_samples(out)
            except OSError:  # no nvidia-smi here
                return
            except (ValueError, subprocess.TimeoutExpired):
                self.missed += 1
                continue
            now = time.perf_counter()
            for index, (percent, mhz) in samples.items():
                self.by_gpu.setdefault(index, []).append(percent)
                self.sm_mhz.setdefault(index, []).append(mhz)
                self.times.setdefault(index, []).append(now)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def gpu_utilization(by_gpu: dict[int, list[float]], used: int) -> dict:
    """Mean utilisation per GPU, and over the `used` busiest GPUs (which GPUs Ray gave the actors is
    not recorded; the idle ones of the host read near 0)."""
    means = {str(i): round(statistics.fmean(s), 1) for i, s in sorted(by_gpu.items()) if s}
    busiest = sorted(means.values(), reverse=True)[:used]
    return {
        "mean_pct_by_gpu": means,
        "mean_pct_used_gpus": round(statistics.fmean(busiest), 1) if busiest else None,
        "samples": max((len(s) for s in by_gpu.values()), default=0),
    }


def run_mode(mode: str, manifest: Path, job_dir: Path, overrides: list[str], gpus: int = 1) -> dict:
    """The job in one mode ("ray" or "local") with its measurements; `gpus`: how many GPUs it uses."""
    settings = [f"local={str(mode == 'local').lower()}", *overrides]
    cfg = load_job_config(None, settings, {"manifest": str(manifest)})
    with GpuSampler() as gpu:
        outcome = submit(cfg, job_dir, frontend_sizer)
    s = outcome.summary
    run = s["runs"][-1]
    execution = run["wall_seconds"] - run["planning_seconds"]
    ok = [r for r in outcome.job.read_results().to_pylist() if r["status"] == "ok"]
    return {
        "mode": mode,
        "rows": s["rows"],
        "wall_seconds": run["wall_seconds"],
        "planning_seconds": run["planning_seconds"],
        "execution_seconds": round(execution, 3),
        "audio_seconds": s["audio_seconds"],
        "x_realtime": s["x_realtime"],
        "x_realtime_execution": round(s["audio_seconds"] / execution, 3) if execution > 0 else None,
        "engine_x_realtime": s["engine_x_realtime"],
        "engine_busy_fraction": round(s["synth_seconds"] / execution, 4) if execution > 0 else None,
        "gpu_util": gpu_utilization(gpu.by_gpu, gpus),
        "gpu": sorted({r["gpu"] for r in ok}),
        "precision": sorted({r["precision"] for r in ok}),
        "mean_batch_size": round(statistics.fmean(r["batch_size"] for r in ok), 2) if ok else None,
        "per_bucket": s["per_bucket"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=results_path("pipeline"))
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--modes", default="ray,local", help="comma-separated: ray, local")
    p.add_argument("--device", default="auto")
    p.add_argument("--work", help="scratch folder (default: a temp dir, removed at the end)")
    args = p.parse_args()

    work = Path(args.work or tempfile.mkdtemp(prefix="ovbatch-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        ckpt = full_size_checkpoint(work / "ckpt") if args.size == "full" else ensure_tiny_checkpoint()
        build_s = time.perf_counter() - t0
        manifest = write_manifest(work / "manifest.parquet", args.rows)
        overrides = [
            f"engine.checkpoint={ckpt}",
            f"engine.device={args.device}",
            "progress=false",
            f"engine.prompt_cache_dir={work / 'prompts'}",
            "ray.num_actors=1",
        ]
        report = {
            "bench": "pipeline",
            "size": args.size,
            "rows": args.rows,
            "checkpoint_build_seconds": round(build_s, 1),
            "environment": environment("ray"),
            "config": overrides[1:],
            "modes": [],
        }
        for mode in args.modes.split(","):
            result = run_mode(mode, manifest, work / f"job-{mode}", overrides)
            report["modes"].append(result)
            shown = (
                "mode",
                "wall_seconds",
                "execution_seconds",
                "x_realtime",
                "engine_busy_fraction",
                "gpu_util",
            )
            print(json.dumps({k: result[k] for k in shown}), flush=True)
        out = Path(args.out)
        write_result(out, report)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
