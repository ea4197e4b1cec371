"""`ovbatch demo`: the tiny checkpoint, a manifest over the repo's real speech clips (espeak-ng, with
transcripts in tests/data/clips.json), and the job run through a local Ray with two CPU actors.
`ovbatch demo --ab` runs the same rows through the float32 and the W4A4 tiny model (quantized once,
beside the tiny checkpoint) and writes the A/B report; the two demos have their own job directories
(DEMO_OUT, DEMO_AB_OUT), so that either can run after the other."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.errors import OVBatchError

CLIPS_DIR = Path(__file__).resolve().parents[1] / "tests" / "data"

# Short, medium and long lines, so the rows fall into several graph buckets.
DEMO_TEXTS = (
    "Hello there.",
    "Good morning, how are you today?",
    "The train to the coast leaves at nine, so please do not be late.",
    "Batch synthesis turns a long list of sentences into speech, one clean file for every row of the "
    "manifest, while the graphs stay warm on the device.",
    "Thank you.",
    "We tested the voices on a quiet afternoon and wrote down every number we saw.",
)
DEMO_ROWS = 24
DEMO_OUT = "out/demo"
DEMO_AB_OUT = "out/demo-ab"
# Buckets sized for the tiny checkpoint's short sequences; two CPU actors on local Ray.
DEMO_OVERRIDES = (
    "engine.device=cpu",
    "engine.buckets=[128,256,512,1024]",
    "engine.max_batch_tokens=1024",
    "shard_tokens=1536",
    "ray.num_actors=2",
    "ray.num_cpus=2",
    "report=always",
)


def demo_clips() -> dict[str, str]:
    """Clip file name -> transcript, from tests/data/clips.json."""
    index = CLIPS_DIR / "clips.json"
    if not index.is_file():
        raise OVBatchError(f"{index} not found: the demo needs the speech clips of a repo checkout.")
    return {name: meta["transcript"] for name, meta in json.loads(index.read_text()).items()}


def write_demo_manifest(path: Path, rows: int = DEMO_ROWS) -> Path:
    """A manifest of `rows` rows cycling over the clips and texts (ref_audio: absolute paths)."""
    clips = sorted(demo_clips().items())
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "id": [f"demo-{i:03d}" for i in range(rows)],
            "text": [DEMO_TEXTS[i % len(DEMO_TEXTS)] for i in range(rows)],
            "ref_audio": [str(CLIPS_DIR / clips[i % len(clips)][0]) for i in range(rows)],
            "ref_text": [clips[i % len(clips)][1] for i in range(rows)],
            "language": ["en"] * rows,
        }
    )
    pq.write_table(table, path)
    return path


def tiny_w4a4_checkpoint(checkpoint: Path) -> Path:
    """The tiny checkpoint quantized to W4A4, made on first use beside it (about 20 s on 2 cores)."""
    from engine.errors import QuantError
    from engine.quantizer.quantize import QuantizeOptions, quantize_checkpoint

    target = checkpoint.parent / f"{checkpoint.name}-w4a4"
    if not (target / "config.json").is_file():
        print(f"ovbatch: quantizing the tiny checkpoint to W4A4 (once) -> {target}")
        try:
            quantize_checkpoint(
                checkpoint, target, QuantizeOptions(samples=16, device="cpu"), show_progress=False
            )
        except QuantError:
            if not (target / "config.json").is_file():  # not a concurrent run that finished first
                raise
    return target


def ab_settings(checkpoint: Path) -> dict[str, str]:
    """Two variants over the same rows and seeds: float32 and W4A4."""
    return {
        "variants.fp32.checkpoint": str(checkpoint),
        "variants.fp32.precision": "fp32",
        "variants.w4a4.checkpoint": str(tiny_w4a4_checkpoint(checkpoint)),
        "variants.w4a4.precision": "w4a4",
    }


def run_demo(out: str | Path, local: bool = False, overrides: list[str] | None = None, ab: bool = False):
    from engine.tiny import ensure_tiny_checkpoint
    from pipeline.config import load_job_config
    from pipeline.job import submit
    from pipeline.sizing import frontend_sizer

    out = Path(out).absolute()
    checkpoint = ensure_tiny_checkpoint()
    manifest = write_demo_manifest(out.parent / f"{out.name}-manifest.parquet")
    paths = {"manifest": str(manifest), "engine.checkpoint": str(checkpoint)}  # taken literally
    cfg = load_job_config(
        None,
        [*DEMO_OVERRIDES, *(overrides or [])],
        {**paths, "local": local, **(ab_settings(checkpoint) if ab else {})},
    )
    print(f"demo: tiny checkpoint {checkpoint}; manifest {manifest} ({DEMO_ROWS} rows)")
    return submit(cfg, out, frontend_sizer)
