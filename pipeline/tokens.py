"""The audio codes each row generated, kept beside its wav so that an A/B report can say how often two
variants (same text, reference and seed) chose the same code, codebook by codebook.

    JOB/tokens/<variant>/<id>.npy   [codebooks, frames] integers, a long text's chunks joined in order

One small .npy per row (8 codebooks x 25 frames/s as int16: 400 bytes per second of audio) follows the
wav's life: written with it by the shard runner, never rewritten for a row that is ok.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from pipeline.atomic import write_bytes_atomic
from pipeline.store import JobDir


def tokens_path(job: JobDir, variant: str, row_id: str) -> Path:
    return job.path / "tokens" / variant / f"{row_id}.npy"


def write_tokens(job: JobDir, variant: str, row_id: str, codes: np.ndarray) -> None:
    codes = np.asarray(codes)
    if codes.ndim != 2 or not np.issubdtype(codes.dtype, np.integer):
        raise ValueError(f"audio codes must be integers [codebooks, frames], got {codes.dtype} {codes.shape}")
    small = np.iinfo(np.int16)
    fits16 = codes.size == 0 or (codes.min() >= small.min and codes.max() <= small.max)
    buf = io.BytesIO()
    np.save(buf, codes.astype(np.int16 if fits16 else np.int32), allow_pickle=False)
    write_bytes_atomic(tokens_path(job, variant, row_id), buf.getvalue())


def read_tokens(job: JobDir, variant: str, row_id: str) -> np.ndarray | None:
    """The row's codes, or None when the job holds none for it (a job run before codes were kept, or an
    engine whose results carry none)."""
    path = tokens_path(job, variant, row_id)
    if not path.is_file():
        return None
    return np.load(path, allow_pickle=False)


def agreement(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """(per-codebook count of frames where A and B chose the same code, frames compared): over the frames
    both have. ValueError when they do not have the same codebooks."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"codes {tuple(a.shape)} and {tuple(b.shape)} do not have the same codebooks")
    n = min(a.shape[1], b.shape[1])
    return (a[:, :n] == b[:, :n]).sum(axis=1), n
