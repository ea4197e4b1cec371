"""The two rows a job moves: a RequestRow (a manifest row as planned, what a shard runner synthesizes) and a
ResultRow (one line of the results table). Each has one constructor, so every result, whether ok, failed
or rejected before running, carries the same fields in the same meaning."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import pyarrow as pa

from pipeline.manifest import ManifestRow, Rejection
from pipeline.plan import PlannedRow


@dataclass
class RequestRow(ManifestRow):
    """A manifest row with what the plan decided for it (its key under the engine settings, its packed
    tokens and target frames)."""

    row_key: str = ""
    packed_tokens: int = 0
    target_frames: int = 0

    @classmethod
    def of(cls, row: ManifestRow, planned: PlannedRow) -> RequestRow:
        return cls(
            **asdict(row),
            row_key=planned.row_key,
            packed_tokens=planned.packed_tokens,
            target_frames=planned.target_frames,
        )


STATUSES = ("ok", "failed", "rejected")


@dataclass
class ResultRow:
    """One row's outcome in one variant. Fields a row did not reach stay None (a rejected row has no
    wav, a failed one no audio)."""

    id: str
    variant: str
    status: str  # one of STATUSES
    error: str | None = None
    row_key: str | None = None
    row_index: int | None = None
    ref_seconds: float | None = None
    packed_tokens: int | None = None
    bucket: int | None = None
    shard: int | None = None
    attempt: int = 0
    wav_path: str | None = None
    audio_seconds: float | None = None
    synth_seconds: float | None = None  # the row's share of its batch's engine time (by token work)
    prepare_seconds: float | None = None  # its share of the batch's request preparation in its engine call,
    prepare_ahead_seconds: float | None = None  # or beside the batch before (then prepare_seconds is ~0),
    generate_seconds: float | None = None  # of the 32-step generation,
    decode_seconds: float | None = None  # and of the codec decode;
    generation_idle_seconds: float | None = None  # of the generation stream's idle before the batch (CUDA);
    postprocess_seconds: float | None = None  # its own post-processing
    write_seconds: float | None = None  # and wav + codes writes
    rtf: float | None = None
    target_frames: int | None = None
    token_work: int | None = None
    batch_size: int | None = None
    precision: str | None = None
    model: str | None = None
    host: str | None = None
    gpu: str | None = None
    worker: str | None = None
    started_at: str | None = None
    finished_at: str | None = None

    @classmethod
    def of(
        cls,
        row: RequestRow | Rejection,
        variant: str,
        status: str,
        error: str | None = None,
        shard: Any = None,
        **measured: Any,
    ) -> ResultRow:
        """The result of `row` in `variant`: its identity from the row, where it ran from `shard` (a
        ShardTask; None for a row rejected before planning), what the run measured as keywords."""
        if status not in STATUSES:
            raise ValueError(f"status={status!r}: one of {STATUSES}")
        placed = {}
        if shard is not None:
            placed = {"bucket": shard.bucket, "shard": shard.index, "attempt": shard.attempt}
        planned = {}
        if isinstance(row, RequestRow):
            planned = {
                "row_key": row.row_key,
                "ref_seconds": row.ref_seconds,
                "packed_tokens": row.packed_tokens,
            }
        return cls(
            id=row.id,
            variant=variant,
            status=status,
            error=error,
            row_index=row.row_index,
            **planned,
            **placed,
            **measured,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ResultRow:
        """A row read back from a results file (columns this version does not know are ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


RESULT_TYPES = {  # the annotations of ResultRow's fields (strings: postponed evaluation)
    "str": pa.string(),
    "str | None": pa.string(),
    "int": pa.int64(),
    "int | None": pa.int64(),
    "float | None": pa.float64(),
}
RESULT_SCHEMA = pa.schema([(f.name, RESULT_TYPES[f.type]) for f in fields(ResultRow)])


def results_table(rows: list[ResultRow]) -> pa.Table:
    return pa.Table.from_pylist([asdict(r) for r in rows], schema=RESULT_SCHEMA)
