"""The job directory: resolved config, plan, per-shard results, wavs, summary. Every file is written
atomically (pipeline.atomic), so a reader never sees half a file, but runs.jsonl, appended a line a run.

    JOB/config.yaml                 resolved job config
    JOB/plan.json                   shards and their rows (pipeline.plan)
    JOB/rows.parquet                the manifest's accepted rows, normalised (what rerun needs)
    JOB/results/shard-NNNNN.parquet one per finished shard
    JOB/results/rejected.parquet    rows refused before running
    JOB/wavs/<variant>/<id>.wav
    JOB/tokens/<variant>/<id>.npy   the row's generated audio codes (pipeline.tokens)
    JOB/runs.jsonl                  one line per run of the job (submit, resume, rerun)
    JOB/summary.json
    JOB/.run-lock                   held by the run writing into the job, if any (who it is, inside)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from engine.errors import OVBatchError
from pipeline.atomic import TMP_MARK, is_temp_name, write_json_atomic, write_parquet_atomic
from pipeline.manifest import ManifestRow
from pipeline.messages import first_line
from pipeline.plan import Plan
from pipeline.rows import RESULT_SCHEMA, ResultRow, results_table


class JobDirError(OVBatchError):
    """A job directory is missing, incomplete, or holds a different job."""


def _with_schema(table: pa.Table) -> pa.Table:
    """A results file in RESULT_SCHEMA; columns added since it was written are null."""
    columns = [
        table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
        for f in RESULT_SCHEMA
    ]
    return pa.Table.from_arrays(columns, schema=RESULT_SCHEMA)


def _read_results_file(path: Path, columns: list[str] | None = None) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowInvalid, OSError) as e:
        raise JobDirError(
            f"{path} cannot be read ({first_line(e)}): delete it, then submit the same manifest to this "
            "--out again; the job resumes and writes it anew."
        ) from None


class JobDir:
    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().absolute()
        self.config_path = self.path / "config.yaml"
        self.plan_path = self.path / "plan.json"
        self.rows_path = self.path / "rows.parquet"
        self.results_dir = self.path / "results"
        self.summary_path = self.path / "summary.json"
        self.runs_path = self.path / "runs.jsonl"
        self.report_dir = self.path / "report"
        self.clip_dir = self.path / "clips"
        self.lock_path = self.path / ".run-lock"

    def foreign_entries(self) -> list[str]:
        """Names in the directory that a job does not write (a job never writes into such a folder)."""
        if not self.path.is_dir():
            return []
        ours = {
            "config.yaml",
            "plan.json",
            "rows.parquet",
            "results",
            "wavs",
            "tokens",
            "clips",
            "cache",
            "runs.jsonl",
            "summary.json",
            "report",
            ".run-lock",
        }
        return sorted(p.name for p in self.path.iterdir() if p.name not in ours and not is_temp_name(p.name))

    def hold_for_run(self) -> IO[str]:
        """The job's run lock, taken: closing the file returned gives it back (so does the process's end).
        A second submit or rerun while one runs is refused: its start would delete the running one's temp
        files mid-write."""
        self.path.mkdir(parents=True, exist_ok=True)
        f = open(self.lock_path, "a+")  # noqa: SIM115 - held open as long as the run
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise self._busy(holder) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        return f

    def refuse_if_running(self) -> None:
        """Before a submit or rerun starts anything (Ray, planning, a write): refused while a run holds the
        job (hold_for_run, taken when shards start, refuses it again then)."""
        holder = self.running_by()
        if holder:
            raise self._busy(holder)

    def _busy(self, holder: str) -> JobDirError:
        return JobDirError(
            f"{self.path} is being run by {holder}: wait for that run to end (`ovbatch status {self.path}` "
            "shows its progress) or stop it, then run this again."
        )

    def running_by(self) -> str | None:
        """Who runs the job now (the run lock's holder), or None."""
        try:
            f = open(self.lock_path)  # noqa: SIM115 - closed below, after the lock test
        except (FileNotFoundError, NotADirectoryError):
            return None
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return f.read().strip() or "another process"
            fcntl.flock(f, fcntl.LOCK_UN)
        return None

    def exists(self) -> bool:
        return self.plan_path.is_file()

    def require(self) -> None:
        if not self.exists():
            raise JobDirError(
                f"{self.path} is not a job directory (no plan.json): "
                "run `ovbatch submit MANIFEST --out JOB` first."
            )

    def wav_path(self, variant: str, row_id: str) -> Path:
        return self.path / "wavs" / variant / f"{row_id}.wav"

    def relative(self, path: Path) -> str:
        return str(path.relative_to(self.path))

    def shard_result_path(self, index: int) -> Path:
        return self.results_dir / f"shard-{index:05d}.parquet"

    # ------------------------------------------------------------ plan and rows

    def write_plan(self, plan: Plan) -> None:
        write_json_atomic(self.plan_path, plan.to_json())

    def read_plan(self) -> Plan:
        self.require()
        try:
            return Plan.from_json(json.loads(self.plan_path.read_text()))
        except (ValueError, KeyError, TypeError) as e:
            raise JobDirError(f"{self.plan_path} is unreadable ({e}): submit to a new --out.") from None

    def write_rows(self, rows: list[ManifestRow]) -> None:
        fields = list(ManifestRow.__dataclass_fields__)
        table = (
            pa.table({f: [getattr(r, f) for r in rows] for f in fields})
            if rows
            else pa.table({f: pa.array([], pa.string()) for f in fields})
        )
        write_parquet_atomic(self.rows_path, table)

    def read_rows(self) -> dict[str, ManifestRow]:
        if not self.rows_path.is_file():
            raise JobDirError(f"{self.rows_path} is missing: the job dir is incomplete; submit again.")
        return {r["id"]: ManifestRow(**r) for r in pq.read_table(self.rows_path).to_pylist()}

    # ------------------------------------------------------------ results

    def write_shard_results(self, index: int, rows: list[ResultRow]) -> None:
        write_parquet_atomic(self.shard_result_path(index), results_table(rows))

    def write_rejected(self, plan: Plan) -> None:
        rows = [ResultRow.of(r, v, "rejected", r.reason) for r in plan.rejected for v in plan.variants]
        write_parquet_atomic(self.results_dir / "rejected.parquet", results_table(rows))

    def finished_shards(self) -> set[int]:
        if not self.results_dir.is_dir():
            return set()
        return {int(p.stem.split("-")[1]) for p in self.results_dir.glob("shard-*.parquet")}

    def read_shard_results(self, index: int) -> list[ResultRow]:
        return [ResultRow.from_dict(d) for d in _read_results_file(self.shard_result_path(index)).to_pylist()]

    def has_failed_rows(self, index: int) -> bool:
        """Whether a finished shard holds failed rows (its status column alone is read)."""
        return "failed" in _read_results_file(self.shard_result_path(index), ["status"]).column(0).to_pylist()

    def read_results(self) -> pa.Table:
        files = sorted(self.results_dir.glob("*.parquet")) if self.results_dir.is_dir() else []
        tables = [_with_schema(_read_results_file(f)) for f in files]
        return pa.concat_tables(tables) if tables else results_table([])

    # ------------------------------------------------------------ housekeeping

    def remove_temp_files(self) -> int:
        """Delete temp files left by a process killed mid-write (they never carry a final name)."""
        n = 0
        for p in self.path.rglob(f".*{TMP_MARK}*"):
            if is_temp_name(p.name) and p.is_file():
                p.unlink(missing_ok=True)
                n += 1
        return n

    def append_run(self, record: dict[str, Any]) -> None:
        # One line per run. A driver killed mid-write leaves a torn last line: end it so this one stands
        # alone (read_runs skips the torn one).
        torn = self.runs_path.is_file() and not self.runs_path.read_bytes().endswith(b"\n")
        with open(self.runs_path, "a") as f:
            f.write(("\n" if torn else "") + json.dumps(record) + "\n")

    def read_runs(self) -> list[dict[str, Any]]:
        if not self.runs_path.is_file():
            return []
        runs = []
        for line in self.runs_path.read_text().splitlines():
            try:
                runs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return runs
