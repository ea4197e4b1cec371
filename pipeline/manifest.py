"""Read and validate a Parquet manifest.

Whole-manifest problems (unreadable file, missing required column, wrong column type) raise
ManifestError. Row problems do not stop the job: the row becomes a Rejection with a reason a person
can act on, and the other rows run.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from engine.config import EngineConfig
from engine.errors import AudioError, InputError, OVBatchError
from engine.frontend.audio import ReferenceSettings, decode, rms
from pipeline import clip_pool
from pipeline.atomic import write_bytes_atomic
from pipeline.messages import first_line


class ManifestError(OVBatchError):
    """The manifest cannot be used as a whole (unreadable, missing columns, wrong types)."""


REQUIRED = ("id", "text", "ref_audio", "ref_text")
OPTIONAL = ("language", "instruct", "duration", "speed", "seed")
# Pairs of the longest texts that reference_pairs puts first: about a first shard's first two batches.
LONGEST_TEXTS_FIRST = 64
_STRING_COLUMNS = {"id", "text", "ref_audio", "ref_text", "language", "instruct"}
_FLOAT_COLUMNS = {"duration", "speed"}
_INT_COLUMNS = {"seed"}
MAX_ID_LENGTH = 200  # the wav name adds ".wav"; file systems stop at 255 bytes
# Engine settings that change how a row is run but not what comes out: left out of the row key.
_RUN_ONLY_SETTINGS = ("device", "attention", "cuda_graphs", "buckets", "max_batch_tokens", "prompt_cache_dir")


@dataclass
class ManifestRow:
    row_index: int  # 0-based position in the manifest
    id: str
    text: str
    ref_audio: str | None  # local path the engine reads (remote clips are copied first)
    ref_text: str | None
    language: str | None = None
    instruct: str | None = None
    duration: float | None = None
    speed: float | None = None
    seed: int = 0
    ref_audio_source: str | None = None  # as written in the manifest
    clip_sha256: str | None = None
    ref_seconds: float = 0.0


@dataclass
class Rejection:
    row_index: int
    id: str
    reason: str


@dataclass
class Manifest:
    source: str
    num_rows: int
    rows: list[ManifestRow] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)


# ---------------------------------------------------------------- locations (local paths and URIs)


def _is_uri(s: str) -> bool:
    head = s.split("://", 1)[0]
    return "://" in s and head.isalnum() and len(head) > 1  # "C://x" is not a URI scheme we mean


def resolve_location(location: str, base: str | None) -> str:
    """An absolute local path or a URI. Relative locations are resolved against `base` (a dir or URI)."""
    if _is_uri(location):
        return location
    if location.startswith("~"):
        return str(Path(location).expanduser())
    if Path(location).is_absolute() or base is None:
        return str(Path(location).absolute())
    if _is_uri(base):
        scheme, rest = base.split("://", 1)
        return f"{scheme}://{posixpath.normpath(posixpath.join(rest, location))}"
    return str((Path(base) / location).absolute())


def parent_location(location: str) -> str:
    if _is_uri(location):
        scheme, rest = location.split("://", 1)
        return f"{scheme}://{posixpath.dirname(rest)}"
    return str(Path(location).absolute().parent)


def open_location(location: str) -> tuple[pafs.FileSystem, str]:
    """(file system, path inside it) for a local path or any pyarrow.fs URI (file://, s3://, gs://...)."""
    if _is_uri(location):
        return pafs.FileSystem.from_uri(location)
    return pafs.LocalFileSystem(), str(Path(location).absolute())


def read_bytes(location: str) -> bytes:
    fs, path = open_location(location)
    with fs.open_input_stream(path) as f:
        return f.read()


# ---------------------------------------------------------------- the table


def _read_table(source: str) -> pa.Table:
    try:
        fs, path = open_location(source)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise ManifestError(f"manifest {source!r} not found: check the path or URI.")
        if info.type == pafs.FileType.Directory:
            raise ManifestError(f"manifest {source!r} is a directory: pass the .parquet file itself.")
        return pq.read_table(path, filesystem=fs)
    except ManifestError:
        raise
    except (pa.ArrowException, OSError, ValueError) as e:
        reason = first_line(e)
        raise ManifestError(f"manifest {source!r} is not a readable Parquet file ({reason}).") from None


def _check_schema(table: pa.Table, source: str) -> None:
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise ManifestError(
            f"manifest {source!r} lacks required column(s) {missing}; it has {table.column_names}. "
            f"Required: {list(REQUIRED)}; optional: {list(OPTIONAL)}."
        )
    for name in table.column_names:
        t = table.schema.field(name).type
        if name in _STRING_COLUMNS and not (_is_string_type(t) or pa.types.is_null(t)):
            raise ManifestError(
                f"manifest column {name!r} has type {t}; it must hold strings, null where unset "
                f"(e.g. df[{name!r}] = df[{name!r}].astype('string'))."
            )
        if name in _FLOAT_COLUMNS and not (
            pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_null(t)
        ):
            raise ManifestError(
                f"manifest column {name!r} has type {t}; it must hold integers or floats (seconds or a "
                f"speed factor), null where unset (e.g. df[{name!r}] = df[{name!r}].astype('float64'))."
            )
        if name in _INT_COLUMNS and not (
            pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)
        ):  # floats: pandas stores an integer column with missing values as float64 (checked per row)
            raise ManifestError(
                f"manifest column {name!r} has type {t}; it must hold integers, null where unset "
                f"(e.g. df[{name!r}] = df[{name!r}].astype('Int64'))."
            )


def _is_string_type(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


# ---------------------------------------------------------------- row checks


def check_id(value: Any) -> str | None:
    """Why an id cannot name an output file, or None when it can."""
    if value is None or not isinstance(value, str) or value.strip() == "":
        return "id is empty: give every row a unique, non-empty id"
    bad = [c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")]
    if bad:
        return (
            f"id {value!r} holds the invisible character U+{ord(bad[0]):04X} (a control, format or line "
            "separator character, e.g. a zero-width joiner): use visible characters only"
        )
    if "/" in value or "\\" in value:
        return f"id {value!r} holds a path separator; ids name files inside the job dir: drop '/' and '\\'"
    if value in (".", "..") or value.startswith("."):
        return f"id {value!r} starts with '.', which would escape or hide the output file: rename the row"
    if value != value.strip():
        return f"id {value!r} has leading or trailing spaces: strip them"
    if len(value.encode()) > MAX_ID_LENGTH:
        return f"id {value[:40]!r}... is {len(value.encode())} bytes; keep ids under {MAX_ID_LENGTH} bytes"
    return None


def default_seed(row_id: str) -> int:
    """The seed of a row without one: the same in every variant and every run."""
    return int.from_bytes(hashlib.sha256(row_id.encode()).digest()[:4], "little") & 0x7FFFFFFF


def _optional_positive(name: str, value: Any) -> tuple[float | None, str | None]:
    if value is None:
        return None, None
    v = float(value)
    if math.isnan(v):
        return None, None
    if not math.isfinite(v) or v <= 0:
        hint = "seconds of audio to produce" if name == "duration" else "a factor such as 0.8 or 1.2"
        return None, f"{name}={value!r} must be a positive number ({hint}), or null to leave it unset"
    return v, None


@dataclass
class Clip:
    """What the manifest records of a reference clip, or why the clip cannot be used (error)."""

    local_path: str | None
    sha256: str | None
    seconds: float
    error: str | None


def probe_clip(location: str, clip_dir: Path | None, max_seconds: float) -> Clip:
    """Read a reference clip once: content hash, duration, and whether libsndfile can decode it."""
    local = not _is_uri(location) or location.startswith("file://")
    try:
        data = read_bytes(location)
    except (FileNotFoundError, pa.ArrowException, OSError) as e:
        missing = isinstance(e, FileNotFoundError) or "not found" in str(e).lower()
        kind = "not found" if missing else f"unreadable ({first_line(e)})"
        return Clip(
            None,
            None,
            0.0,
            f"ref_audio {location!r} {kind}: fix the path (relative paths are "
            "resolved against the manifest's folder) or its permissions",
        )
    digest = hashlib.sha256(data).hexdigest()
    try:
        audio, rate = decode(data, repr(location), max_seconds)
    except AudioError as e:
        return Clip(None, digest, 0.0, str(e))
    seconds = len(audio) / float(rate)
    if not np.isfinite(audio).all() or not rms(audio) >= ReferenceSettings.silence_floor_rms:
        return Clip(
            None,
            digest,
            seconds,
            f"reference clip {location!r} is silent or holds NaN/Inf "
            "samples: pass a clip with audible speech",
        )
    if local:  # a file:// URI's path as pyarrow reads it (percent-decoded)
        path = open_location(location)[1] if location.startswith("file://") else location
        return Clip(path, digest, seconds, None)
    if clip_dir is None:  # the row keeps the URI (the engine reads local paths: submit passes a clip_dir)
        return Clip(location, digest, seconds, None)
    target = clip_dir / f"{digest[:24]}{Path(location).suffix.lower()}"
    if not target.exists():
        write_bytes_atomic(target, data)
    return Clip(str(target), digest, seconds, None)


def _probe_clips(locations: list[str], clip_dir: Path | None, max_seconds: float) -> dict[str, Clip]:
    """Each distinct clip probed once, in worker processes when there are many (pipeline.clip_pool)."""
    task = {"task": "probe", "clip_dir": clip_dir and str(clip_dir), "max_seconds": max_seconds}
    answers = clip_pool.map_clips(task, locations, clip_pool.worker_count())
    clips = {}
    for location in locations:
        answer = answers.get(location)
        clips[location] = Clip(**answer) if answer else probe_clip(location, clip_dir, max_seconds)
    return clips


def _language_problem(value: str | None) -> tuple[str | None, str | None]:
    if value is None or value.strip() == "":
        return None, None
    from engine.frontend.text import resolve_language

    try:
        return resolve_language(value.strip()), None
    except InputError as e:
        return None, f"language {value!r} is unknown: {e}"


def _instruct_problem(value: str | None, text: str) -> tuple[str | None, str | None]:
    from engine.frontend.text import has_chinese, resolve_instruct

    try:
        return resolve_instruct(_clean(value), has_chinese(text)), None
    except InputError as e:
        return None, f"instruct {value!r} is not usable: {e}"


# ---------------------------------------------------------------- load


def load(
    source: str | Path,
    clip_dir: str | Path | None = None,
    max_ref_seconds: float = EngineConfig.max_ref_seconds,
    read: tuple[str, pa.Table] | None = None,
) -> Manifest:
    """Read and validate a manifest. Remote reference clips are copied into `clip_dir` when given; clips
    longer than `max_ref_seconds` (the engine's limit) are rejected. `read`: read_table(source), when the
    caller has it already."""
    source, table = read or read_table(source)
    base = parent_location(source)
    records = table.to_pylist()
    manifest = Manifest(source=source, num_rows=len(records))

    counts: dict[str, list[int]] = {}
    for i, rec in enumerate(records):
        if isinstance(rec.get("id"), str):
            counts.setdefault(rec["id"], []).append(i)
    clip_root = Path(clip_dir) if clip_dir is not None else None
    references = (_clean(rec.get("ref_audio")) for rec in records)
    locations = sorted({resolve_location(ref, base) for ref in references if ref is not None})
    clips = _probe_clips(locations, clip_root, max_ref_seconds)

    for i, rec in enumerate(records):
        rid = rec.get("id")
        shown_id = rid if isinstance(rid, str) else ""
        reason = check_id(rid)
        if reason is None and len(counts[rid]) > 1:
            rows = ", ".join(str(r) for r in counts[rid][:5])
            reason = f"id {rid!r} appears {len(counts[rid])} times (rows {rows}): ids must be unique"
        row, why = (None, reason) if reason else _normalise(i, rec, base, clips)
        if why is not None:
            manifest.rejected.append(Rejection(i, shown_id, why))
        else:
            manifest.rows.append(row)
    return manifest


def read_table(source: str | Path) -> tuple[str, pa.Table]:
    """A manifest's location (absolute for a local path) and its table, columns checked; no clip opened."""
    source = str(source)
    if not _is_uri(source):
        source = str(Path(source).expanduser().absolute())
    table = _read_table(source)
    _check_schema(table, source)
    return source, _row_columns(table)


def _row_columns(table: pa.Table) -> pa.Table:
    """The columns a row reads, and nothing else (other columns may be large, or of types that do not convert
    to Python), their strings as plain strings: pandas' categoricals read back as dictionaries, and polars
    may write string views."""
    names = [c for c in (*REQUIRED, *OPTIONAL) if c in table.column_names]
    table = table.select(names)
    for i, name in enumerate(names):
        if name in _STRING_COLUMNS and not pa.types.is_null(table.schema.field(name).type):
            table = table.set_column(i, name, table.column(name).cast(pa.string()))
    return table


def reference_pairs(read: tuple[str, pa.Table]) -> list[tuple[str, str]]:
    """The (local reference clip, transcript) pairs of a read manifest's rows (read_table), each once, in the
    order the workers make their voice prompts while the job plans (nothing here is checked: the planner
    rejects bad rows, and warming skips what it cannot use): the clips of the LONGEST_TEXTS_FIRST longest
    texts, whose rows open the plan, then the rest from the shortest text up. Short rows run last and bring
    the most clips per second of speech: their preparation, more than the device, paced the end of the FP8
    job in e2e-h200.json (by_bucket)."""
    source, table = read
    base = parent_location(source)
    texts, clips, transcripts = (table.column(c).to_pylist() for c in ("text", "ref_audio", "ref_text"))
    lengths: dict[tuple[str, str], list[int]] = {}
    for text, clip, transcript in zip(texts, clips, transcripts, strict=True):
        clip, transcript = _clean(clip), _clean(transcript)
        location = resolve_location(clip, base) if clip is not None else None
        if location is None or transcript is None or _is_uri(location):  # remote: copied into the job later
            continue
        lengths.setdefault((location, transcript), []).append(len(text or ""))
    first = sorted(lengths, key=lambda pair: -max(lengths[pair]))[:LONGEST_TEXTS_FIRST]
    chosen = set(first)
    rest = sorted((pair for pair in lengths if pair not in chosen), key=lambda pair: min(lengths[pair]))
    return first + rest


def _clean(value: Any) -> str | None:
    if value is None:
        return None
    value = str(value).strip()
    return value or None


def _normalise(
    i: int,
    rec: dict[str, Any],
    base: str,
    clips: dict[str, Clip],
) -> tuple[ManifestRow | None, str | None]:
    text = _clean(rec.get("text"))
    if text is None:
        return None, "text is empty: give the words to speak"
    ref_text = _clean(rec.get("ref_text"))
    ref_source = _clean(rec.get("ref_audio"))
    if ref_source is None and ref_text is not None:
        return None, "ref_text is set but ref_audio is empty: give the reference clip, or clear ref_text"
    if ref_source is not None and ref_text is None:
        return None, "ref_text is empty: give the transcript of the reference clip"
    language, why = _language_problem(rec.get("language"))
    if why:
        return None, why
    instruct, why = _instruct_problem(rec.get("instruct"), text)
    if why:
        return None, why
    duration, why = _optional_positive("duration", rec.get("duration"))
    if why:
        return None, why
    speed, why = _optional_positive("speed", rec.get("speed"))
    if why:
        return None, why
    seed = rec.get("seed")
    if isinstance(seed, float):  # a float column: pandas' integers with missing values (NaN)
        seed = None if math.isnan(seed) else int(seed) if seed.is_integer() else seed
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**63):
        return None, f"seed={seed} must be a non-negative integer below 2**63, or null"
    clip = Clip(None, None, 0.0, None)
    if ref_source is not None:
        clip = clips[resolve_location(ref_source, base)]
        if clip.error:
            return None, clip.error
    return ManifestRow(
        row_index=i,
        id=rec["id"],
        text=text,
        ref_audio=clip.local_path,
        ref_text=ref_text,
        language=language,
        instruct=instruct,
        duration=duration,
        speed=speed,
        seed=int(seed) if seed is not None else default_seed(rec["id"]),
        ref_audio_source=ref_source,
        clip_sha256=clip.sha256,
        ref_seconds=clip.seconds,
    ), None


# ---------------------------------------------------------------- row key


def engine_settings(cfg: EngineConfig) -> dict[str, Any]:
    """The engine settings that decide what a row sounds like (run-only settings left out)."""
    d = asdict(cfg)
    for k in _RUN_ONLY_SETTINGS:
        d.pop(k, None)
    return d


def row_key(row: ManifestRow, settings: dict[str, Any]) -> str:
    """Stable hash of a row's inputs (the clip by content) and the engine settings (engine_settings, made
    once for all the rows of a variant)."""
    inputs = {
        "text": row.text,
        "ref_audio_sha256": row.clip_sha256,
        "ref_text": row.ref_text,
        "language": row.language,
        "instruct": row.instruct,
        "duration": row.duration,
        "speed": row.speed,
        "seed": row.seed,
        "engine": settings,
    }
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]
