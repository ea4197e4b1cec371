"""Job directory: atomic writes leave either the old or the new file, results keep their schema."""

import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from pipeline import atomic, store
from pipeline.atomic import TMP_MARK
from pipeline.manifest import ManifestRow, Rejection
from pipeline.plan import Plan, PlannedRow, Shard
from pipeline.rows import RESULT_SCHEMA, ResultRow, results_table
from pipeline.store import JobDir


def _plan() -> Plan:
    rows = [PlannedRow("a", "ka", 100, 30), PlannedRow("b", "kb", 90, 25)]
    return Plan(["default"], [128], 1000, [Shard(0, "default", 128, 190, rows)], [Rejection(2, "c", "empty")])


def test_write_bytes_atomic_replaces_whole_files(tmp_path: Path):
    p = tmp_path / "sub" / "x.json"
    atomic.write_json_atomic(p, {"a": 1})
    atomic.write_json_atomic(p, {"a": 2})
    assert p.read_text().strip().endswith("}") and '"a": 2' in p.read_text()
    assert [q.name for q in p.parent.iterdir()] == ["x.json"]


def test_written_files_are_readable_by_others(tmp_path: Path):
    atomic.write_bytes_atomic(tmp_path / "x.json", b"{}")
    atomic.write_wav_atomic(tmp_path / "x.wav", np.zeros(240, dtype=np.float32), 24000)
    for name in ("x.json", "x.wav"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path, monkeypatch):
    p = tmp_path / "x.wav"
    atomic.write_wav_atomic(p, np.zeros(800, np.float32), 8000)
    before = p.read_bytes()

    def broken_write(path, *a, **k):
        Path(path).write_bytes(b"RIFF-half")
        raise OSError("disk full")

    monkeypatch.setattr(atomic.sf, "write", broken_write)
    with pytest.raises(OSError, match="disk full"):
        atomic.write_wav_atomic(p, np.ones(800, np.float32), 8000)
    assert p.read_bytes() == before
    assert [q.name for q in tmp_path.iterdir()] == ["x.wav"]


def test_a_wav_that_cannot_be_written_is_named(tmp_path: Path, monkeypatch):
    def failing_write(path, *a, **k):
        raise atomic.sf.LibsndfileError(2)  # libsndfile's "System error.", which names no file

    monkeypatch.setattr(atomic.sf, "write", failing_write)
    with pytest.raises(OSError, match=r"cannot write .*x\.wav: System error"):
        atomic.write_wav_atomic(tmp_path / "x.wav", np.ones(800, np.float32), 8000)
    assert list(tmp_path.iterdir()) == []


def test_a_file_is_on_disk_before_it_takes_its_name_and_the_name_after(tmp_path: Path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    for write in (
        lambda p: atomic.write_wav_atomic(p, np.zeros(800, np.float32), 8000),
        lambda p: atomic.write_bytes_atomic(p, b"{}"),
        lambda p: atomic.write_parquet_atomic(p, results_table([])),
    ):
        events.clear()
        target = tmp_path / "sub" / "x"
        write(target)
        [(_, temp), replaced, (_, folder)] = events
        assert Path(temp).name.startswith(f".x{TMP_MARK}") and replaced == ("replace", str(target))
        assert folder == str(target.parent)


def test_wav_round_trip(tmp_path: Path):
    audio = (0.5 * np.sin(np.linspace(0, 60, 2400))).astype(np.float32)
    p = tmp_path / "w" / "a.wav"
    atomic.write_wav_atomic(p, audio, 24000)
    back, sr = sf.read(p, dtype="float32")
    assert sr == 24000 and np.abs(back - audio).max() < 1e-4


def test_results_schema_and_shard_files(tmp_path: Path):
    job = JobDir(tmp_path / "job")
    plan = _plan()
    job.write_plan(plan)
    job.write_rejected(plan)
    assert job.exists() and job.finished_shards() == set()
    job.write_shard_results(0, [ResultRow("a", "default", "ok", audio_seconds=1.5, shard=0, attempt=1)])
    assert job.finished_shards() == {0}
    assert job.shard_result_path(0).name == "shard-00000.parquet"
    t = job.read_results()
    assert t.schema == RESULT_SCHEMA
    rows = {r["id"]: r for r in t.to_pylist()}
    assert rows["a"]["status"] == "ok" and rows["a"]["audio_seconds"] == 1.5
    assert rows["c"]["status"] == "rejected" and rows["c"]["error"] == "empty"
    assert pq.read_schema(job.shard_result_path(0)) == RESULT_SCHEMA
    assert job.read_plan().to_json() == plan.to_json()


def test_results_written_before_a_column_existed_read_with_it_null(tmp_path: Path):
    job = JobDir(tmp_path)
    old = results_table([ResultRow("a", "default", "ok", audio_seconds=1.5, shard=0)]).drop_columns(
        ["write_seconds", "decode_seconds"]
    )
    job.results_dir.mkdir(parents=True)
    pq.write_table(old, job.shard_result_path(0))
    (row,) = job.read_results().to_pylist()
    assert row["audio_seconds"] == 1.5 and row["write_seconds"] is None and row["decode_seconds"] is None


def test_empty_results_and_rows(tmp_path: Path):
    job = JobDir(tmp_path)
    assert job.read_results().num_rows == 0
    assert results_table([]).schema == RESULT_SCHEMA
    job.write_rows([])
    assert job.read_rows() == {}
    row = ManifestRow(0, "a", "t", "/x.wav", "r", seed=3, ref_seconds=2.0)
    job.write_rows([row])
    assert job.read_rows() == {"a": row}


def test_remove_temp_files_and_torn_run_log(tmp_path: Path):
    job = JobDir(tmp_path)
    wavs = tmp_path / "wavs" / "v"
    wavs.mkdir(parents=True)
    (wavs / f".a.wav{TMP_MARK}123").write_bytes(b"partial")
    (wavs / "b.wav").write_bytes(b"whole")
    (wavs / f"take{TMP_MARK}1.wav").write_bytes(b"a row whose id holds the mark")
    (tmp_path / "wavs" / f"v{TMP_MARK}2").mkdir()  # a variant named so
    assert job.remove_temp_files() == 1
    assert sorted(os.listdir(wavs)) == ["b.wav", f"take{TMP_MARK}1.wav"]
    assert (tmp_path / "wavs" / f"v{TMP_MARK}2").is_dir()
    job.append_run({"kind": "submit", "wall_seconds": 2.0})
    with open(job.runs_path, "a") as f:
        f.write('{"kind": "resu')  # a driver killed mid-line
    assert job.read_runs() == [{"kind": "submit", "wall_seconds": 2.0}]
    job.append_run({"kind": "resume", "wall_seconds": 1.0})
    assert [r["kind"] for r in job.read_runs()] == ["submit", "resume"]


def test_one_run_at_a_time_holds_a_job(tmp_path: Path):
    job = JobDir(tmp_path / "job")
    held = job.hold_for_run()
    with pytest.raises(store.JobDirError, match=rf"is being run by pid {os.getpid()} on .*: wait for that"):
        JobDir(tmp_path / "job").hold_for_run()
    held.close()
    job.hold_for_run().close()  # given back
    assert job.foreign_entries() == []


def test_require_names_the_missing_job(tmp_path: Path):
    with pytest.raises(store.JobDirError, match="not a job directory"):
        JobDir(tmp_path / "nothing").require()


def test_foreign_entries_protect_folders_that_are_not_jobs(tmp_path: Path):
    job = JobDir(tmp_path / "job")
    assert job.foreign_entries() == []
    job.write_plan(_plan())
    (job.path / "clips").mkdir()
    assert job.foreign_entries() == []
    (job.path / "thesis.tex").write_text("mine")
    assert job.foreign_entries() == ["thesis.tex"]
