"""Atomic writes: a temp file in the target's folder (its name carries TMP_MARK), then os.replace, so a
reader sees the old file or the new one, never half of one. Temp files of killed writers are found by
their mark and deleted when a job starts (JobDir.remove_temp_files)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

TMP_MARK = ".ovtmp-"


def _atomic_target(path: Path) -> tuple[int, str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    return tempfile.mkstemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    fd, tmp = _atomic_target(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=1, default=str) + "\n").encode())


def write_parquet_atomic(path: Path, table: pa.Table) -> None:
    fd, tmp = _atomic_target(path)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_wav_atomic(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    fd, tmp = _atomic_target(path)
    os.close(fd)
    try:
        sf.write(tmp, audio, sample_rate, subtype="PCM_16", format="WAV")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
