"""A job directory written by hand: variants of the same rows with known signals (no engine), and
optionally the rows' manifest fields and generated codes, for the A/B report's tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.atomic import write_wav_atomic
from pipeline.manifest import ManifestRow
from pipeline.plan import Plan, PlannedRow, Shard
from pipeline.rows import ResultRow
from pipeline.store import JobDir
from pipeline.tokens import write_tokens

SR = 24000
DATA = Path(__file__).parent / "data"
TEXTS = ("Hello there.", "Thank you very much.", "Good night, sleep well.", "See you soon.", "The end.")
CODEBOOKS = 8


def tone(seconds: float, freq: float, rng: np.random.Generator) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.3 * np.sin(2 * np.pi * freq * t) + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


def codes(row: int, frames: int) -> np.ndarray:
    return np.random.default_rng(100 + row).integers(0, 1024, (CODEBOOKS, frames))


def make_ab_job(
    root: Path,
    variants: tuple[str, ...] = ("fp16", "w4a4"),
    rows: int = 5,
    tokens: bool = False,
    ids: list[str] | None = None,
) -> JobDir:
    """Each variant after the first adds more noise to the same tones. With tokens, variant k > 0 keeps the
    first variant's codes except where changed_mask(k) says, so each codebook's agreement is known.
    rows.parquet holds the rows' texts, reference clip and language."""
    job = JobDir(root)
    rng = np.random.default_rng(7)
    ids = ids or [f"u{i}" for i in range(rows)]
    shards, results = [], []
    for k, variant in enumerate(variants):
        planned = [PlannedRow(i, f"{variant}-{i}", 200, 50) for i in ids]
        shards.append(Shard(len(shards), variant, 256, 1000, planned))
        for n, i in enumerate(ids):
            audio = tone(1.0 + 0.1 * n, 200 + 40 * n, np.random.default_rng(n))
            audio = audio + 0.02 * k * rng.standard_normal(len(audio)).astype(np.float32)
            path = job.wav_path(variant, i)
            write_wav_atomic(path, audio, SR)
            if tokens:
                grid = codes(n, 25 + n)
                if k:
                    grid = np.where(changed_mask(k, grid.shape), (grid + 1) % 1024, grid)
                write_tokens(job, variant, i, grid)
            results.append(
                ResultRow(
                    i,
                    variant,
                    "ok",
                    row_key=f"{variant}-{i}",
                    wav_path=job.relative(path),
                    audio_seconds=len(audio) / SR,
                    synth_seconds=0.1,
                    rtf=0.1 * SR / len(audio),
                    bucket=256,
                    shard=shards[-1].index,
                    packed_tokens=200,
                    attempt=1,
                )
            )
    job.write_plan(Plan(list(variants), [256], 1000, shards, []))
    job.write_rejected(job.read_plan())
    for s in shards:
        job.write_shard_results(s.index, [r for r in results if r.shard == s.index])
    clip = str(DATA / "en_16k_mono.wav")
    job.write_rows(
        [ManifestRow(n, i, TEXTS[n % len(TEXTS)], clip, "a reference", "en") for n, i in enumerate(ids)]
    )
    job.append_run({"kind": "submit", "wall_seconds": 2.0})
    return job


def changed_mask(k: int, shape: tuple[int, int]) -> np.ndarray:
    """Where variant k's codes differ from the first variant's: codebook c, frame f with (f + c) % (k + 1)
    == 0; so codebook c agrees on the frames where that does not hold."""
    c, f = np.indices(shape)
    return (f + c) % (k + 1) == 0
