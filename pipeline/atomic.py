"""Atomic, durable writes: a temp file in the target's folder (its name carries TMP_MARK), flushed to disk,
then os.replace and the folder flushed, so a reader sees the old file or the new one, never half of one,
and a shard's results, written after its wavs, never outlive them in a power cut. Temp files of killed
writers are found by their mark and deleted when a run starts and when it ends (JobDir.remove_temp_files)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

from engine.fsmodes import chmod_as_created

TMP_MARK = ".ovtmp-"


def is_temp_name(name: str) -> bool:
    """Whether a file name is one of our temp files: `.` + the final name + TMP_MARK + a suffix. Final names
    never start with `.` (row ids and variant names cannot), so a row id holding the mark is still a row's."""
    return name.startswith(".") and TMP_MARK in name


@contextmanager
def _replacing(path: Path) -> Iterator[str]:
    """A temp file beside `path` to write; it replaces `path` when the block ends, or is deleted if the
    block raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent)
    os.close(fd)
    chmod_as_created(tmp)  # mkstemp makes owner-only files; outputs are read by other users and containers
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # the new name; some file systems cannot flush a folder
        _fsync(path.parent)


def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with _replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=1, default=str) + "\n").encode())


def write_parquet_atomic(path: Path, table: pa.Table) -> None:
    with _replacing(path) as tmp:
        pq.write_table(table, tmp)


def write_wav_atomic(path: Path, audio: np.ndarray, sample_rate: int) -> None:
    with _replacing(path) as tmp:
        try:
            sf.write(tmp, audio, sample_rate, subtype="PCM_16", format="WAV")
        except sf.LibsndfileError as e:  # its message names no file ("System error.")
            raise OSError(f"cannot write {path}: {e}") from e
