"""Faults: a bad row in a batch fails alone, OOM splits batches, rerun runs only failed rows, a killed
driver resumes with only the unfinished shards (a killed actor: tests/test_pipeline_e2e.py).

The shard-runner unit tests use FakeEngine (a deterministic stand-in defined here); the driver-kill test
runs the real engine on the tiny checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf
import torch

from engine.api import SynthResult
from engine.errors import ClipReadError, InputError
from pipeline.atomic import TMP_MARK
from pipeline.config import load_job_config
from pipeline.job import rerun, submit
from pipeline.manifest import ManifestRow
from pipeline.plan import PlannedRow, RowSize
from pipeline.rows import RequestRow
from pipeline.shard_runner import ShardRunner, ShardTask
from pipeline.store import JobDir, JobDirError

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
CLIPS = json.loads((DATA / "clips.json").read_text())


class FakeEngine:
    """Stand-in engine: a tone whose length follows the text. Fails as the class attributes say."""

    sample_rate = 8000
    model_id = "fake@000000000000"
    precision = "fp32"
    device = torch.device("cpu")
    fail_ids: set[str] = set()  # texts "row <id>" of these ids raise RuntimeError in any batch
    oom_above: int | None = None  # a call with more requests raises CUDA out of memory
    calls: list[list[str]] = []  # texts of every synthesize call, all instances
    dead_writer_temp: Path | None = None  # a temp file to leave, as a writer killed mid-write would

    def __init__(self, cfg):
        self.cfg = cfg

    def synthesize(self, reqs):
        if self.dead_writer_temp is not None:
            self.dead_writer_temp.parent.mkdir(parents=True, exist_ok=True)
            self.dead_writer_temp.write_bytes(b"RIFF, cut off")
        FakeEngine.calls.append([r.text for r in reqs])
        for r in reqs:
            if any(r.text == f"row {i}" for i in self.fail_ids):
                raise RuntimeError(f"injected failure on {r.text!r}")
            if "BADINPUT" in r.text:
                raise InputError(f"text {r.text!r} is refused by the fake engine")
            if "UNREADABLE" in r.text:
                raise ClipReadError("reference clip /nfs/v.wav cannot be read (Input/output error)")
        if self.oom_above is not None and len(reqs) > self.oom_above:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        out = []
        for r in reqs:
            frames = 5 + len(r.text)
            t = np.arange(frames * 320) / self.sample_rate
            audio = (0.3 * np.sin(2 * np.pi * (200 + r.seed % 300) * t)).astype(np.float32)
            # every other call as if prepared beside the call before (Engine.generate's `then`), the others
            # with their preparation in the call, the generation stream idle meanwhile
            in_call = {"prepare": 0.5, "generation_idle": 0.5}
            ahead = {"prepare": 0.0, "prepare_ahead": 0.5} if len(FakeEngine.calls) % 2 else in_call
            timings = {**ahead, "generate": 2.0, "decode": 1.0, "postprocess": 0.01 * frames}
            out.append(SynthResult(audio, self.sample_rate, frames, token_work=frames * 32, timings=timings))
        return out


@pytest.fixture(autouse=True)
def reset_fake():
    FakeEngine.fail_ids, FakeEngine.oom_above, FakeEngine.calls = set(), None, []
    FakeEngine.dead_writer_temp = None
    yield


def _fake_cfg(manifest: Path | None = None, *extra: str):
    return load_job_config(
        None,
        [
            f"manifest={manifest}" if manifest else "manifest=null",
            "local=true",
            f"engine_factory={__name__}:FakeEngine",
            "progress=false",
            "engine.buckets=[64,128,256]",
            "engine.max_batch_tokens=256",
            "shard_tokens=300",
            *extra,
        ],
    )


def _row(i: int, text: str | None = None, tokens: int = 40) -> RequestRow:
    row = ManifestRow(
        row_index=i, id=f"r{i:02d}", text=text or f"row r{i:02d}", ref_audio=None, ref_text=None, seed=i
    )
    return RequestRow.of(row, PlannedRow(row.id, f"k{i}", tokens, 10))


def test_a_failing_row_fails_alone_and_its_batch_mates_finish(tmp_path: Path):
    FakeEngine.fail_ids = {"r03"}
    runner = ShardRunner(tmp_path, _fake_cfg())
    rows = [_row(i) for i in range(6)]  # 6 x 40 tokens: one batch of 6 under 256
    results = runner.run_shard(ShardTask(0, "default", 64, 1, rows))
    by_id = {r.id: r for r in results}
    assert sorted(by_id) == [r.id for r in rows]
    assert by_id["r03"].status == "failed" and "injected failure" in by_id["r03"].error
    assert by_id["r03"].wav_path is None and not (tmp_path / "wavs" / "default" / "r03.wav").exists()
    for rid, r in by_id.items():
        if rid != "r03":
            assert r.status == "ok" and (tmp_path / r.wav_path).is_file()
    assert len(FakeEngine.calls[0]) == 6  # the whole batch first, then halves down to the bad row


def test_out_of_memory_splits_the_batch_until_it_fits(tmp_path: Path):
    FakeEngine.oom_above = 2
    runner = ShardRunner(tmp_path, _fake_cfg())
    results = runner.run_shard(ShardTask(4, "default", 64, 1, [_row(i) for i in range(6)]))
    assert [r.status for r in results] == ["ok"] * 6
    assert max(r.batch_size for r in results) <= 2
    assert max(len(c) for c in FakeEngine.calls) == 6  # it was tried whole first


def test_an_input_the_engine_refuses_is_rejected_not_failed(tmp_path: Path):
    runner = ShardRunner(tmp_path, _fake_cfg())
    results = runner.run_shard(ShardTask(0, "default", 64, 1, [_row(0), _row(1, "BADINPUT here")]))
    assert [r.status for r in results] == ["ok", "rejected"]
    assert "refused by the fake engine" in results[1].error


def test_a_clip_that_cannot_be_read_at_run_time_fails_the_row_for_a_rerun(tmp_path: Path):
    runner = ShardRunner(tmp_path, _fake_cfg())
    results = runner.run_shard(ShardTask(0, "default", 64, 1, [_row(0), _row(1, "UNREADABLE clip")]))
    assert [r.status for r in results] == ["ok", "failed"]
    assert "cannot be read" in results[1].error


def test_per_row_time_is_a_share_of_the_batch_by_token_work(tmp_path: Path):
    runner = ShardRunner(tmp_path, _fake_cfg())
    rows = [_row(0, "short"), _row(1, "a much longer text for this row"), _row(2, "mid length")]
    results = runner.run_shard(ShardTask(0, "default", 64, 1, rows))
    assert len({r.started_at for r in results}) == 1  # one batch
    work = np.array([r.token_work for r in results], float)
    synth = np.array([r.synth_seconds for r in results])
    assert np.allclose(synth / synth.sum(), work / work.sum())
    for r in results:
        audio, sr = sf.read(tmp_path / r.wav_path)
        assert r.audio_seconds == pytest.approx(len(audio) / sr)
        assert r.rtf == pytest.approx(r.synth_seconds / r.audio_seconds)
    # each batch-wide phase is shared by token work like synth_seconds; post-processing is the row's own
    assert sum(r.generate_seconds for r in results) == pytest.approx(2.0)
    assert [r.decode_seconds / r.token_work for r in results] == pytest.approx([1.0 / work.sum()] * 3)
    assert [r.postprocess_seconds for r in results] == pytest.approx(
        [0.01 * r.target_frames for r in results]
    )
    assert all(r.write_seconds > 0 for r in results)


def _manifest(path: Path, n: int, texts: list[str] | None = None) -> Path:
    names = sorted(CLIPS)
    pq.write_table(
        pa.table(
            {
                "id": [f"r{i:02d}" for i in range(n)],
                "text": texts or [f"row r{i:02d}" for i in range(n)],
                "ref_audio": [str(DATA / names[i % len(names)]) for i in range(n)],
                "ref_text": [CLIPS[names[i % len(names)]]["transcript"] for i in range(n)],
            }
        ),
        path,
    )
    return path


def _fake_sizer(row) -> RowSize:
    return RowSize(text_tokens=10, ref_frames=20, target_frames=15 + 5 * (row.row_index % 3) ** 3)


def test_rerun_runs_only_the_failed_rows_and_never_rewrites_an_ok_row(tmp_path: Path):
    cfg = _fake_cfg(_manifest(tmp_path / "m.parquet", 18))
    FakeEngine.fail_ids = {"r04", "r11"}
    job = JobDir(tmp_path / "job")
    stale = job.wav_path("default", "r04")  # as left by an earlier attempt whose worker died
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"RIFF from a dead attempt")
    first = submit(cfg, job.path, lambda cfg, rows: _fake_sizer)
    assert first.summary["rows"]["failed"] == 2 and first.summary["rows"]["ok"] == 16
    assert not stale.exists(), "a failed row keeps no wav"
    plan = job.read_plan()
    assert len({s.bucket for s in plan.shards}) == 3
    failed_shards = {r["shard"] for r in job.read_results().to_pylist() if r["status"] == "failed"}
    stamps = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (job.path / "wavs").rglob("*.wav")}
    shard_files = {i: job.shard_result_path(i).read_bytes() for i in job.finished_shards() - failed_shards}

    FakeEngine.fail_ids, FakeEngine.calls = set(), []
    again = rerun(job.path)
    assert sorted(again.shards_run) == sorted(failed_shards)
    assert sorted(t for call in FakeEngine.calls for t in call) == ["row r04", "row r11"]
    results = job.read_results().to_pylist()
    assert sorted(r["id"] for r in results) == [f"r{i:02d}" for i in range(18)]  # each row exactly once
    assert all(r["status"] == "ok" for r in results)
    assert {r["id"]: r["attempt"] for r in results if r["id"] in ("r04", "r11")} == {"r04": 2, "r11": 2}
    for p, stamp in stamps.items():
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == stamp, f"{p} was rewritten"
    for i, data in shard_files.items():
        assert job.shard_result_path(i).read_bytes() == data
    assert again.summary["complete"] and len(again.summary["runs"]) == 2
    assert rerun(job.path, ["engine.max_batch_tokens=128"]).shards_run == []  # nothing left to do
    with pytest.raises(JobDirError, match=r"rerun cannot change what variant\(s\) \['default'\] sound like"):
        rerun(job.path, ["engine.generation.num_step=8"])


def test_a_shard_whose_rows_all_failed_reruns_as_its_next_attempt(tmp_path: Path):
    FakeEngine.fail_ids = {"r00", "r01"}
    cfg = _fake_cfg(_manifest(tmp_path / "m.parquet", 2))
    job = submit(cfg, tmp_path / "job", lambda cfg, rows: _fake_sizer).job
    assert {r["status"] for r in job.read_results().to_pylist()} == {"failed"}
    FakeEngine.fail_ids = set()
    rerun(job.path)
    assert [(r["status"], r["attempt"]) for r in job.read_results().to_pylist()] == [("ok", 2), ("ok", 2)]


def test_a_writer_killed_during_a_run_leaves_no_temp_file_behind(tmp_path: Path):
    # A killed actor's half-written wav (tests/test_pipeline_e2e.py kills one) appears after the job
    # started, so the cleanup at the start cannot catch it; the run's end must.
    cfg = _fake_cfg(_manifest(tmp_path / "m.parquet", 6))
    job = JobDir(tmp_path / "job")
    FakeEngine.dead_writer_temp = job.wav_path("default", "r03").with_name(".r03.wav.ovtmp-dead")
    outcome = submit(cfg, job.path, lambda cfg, rows: _fake_sizer)
    assert FakeEngine.calls, "the engine ran"
    assert outcome.summary["rows"]["ok"] == 6
    split = outcome.summary["time"]  # where the wall time went, adding up to it
    # beside the engine's calls: on its thread, on its own CUDA stream and on writer threads; and the
    # generation stream's idle, measured inside prepare and other
    beside = {"prepare_ahead", "decode", "postprocess", "write", "generation_idle"}
    engine = {"prepare", "generate"}
    assert set(split) == {"planning", "worker_start", "capture", *engine, *beside, "other"}
    on_the_wall = sum(v for k, v in split.items() if k not in beside)
    assert on_the_wall == pytest.approx(outcome.summary["wall_seconds"], abs=1e-2)
    assert split["generate"] == pytest.approx(2.0 * len(FakeEngine.calls), abs=1e-2)
    calls = len(FakeEngine.calls)
    assert split["prepare_ahead"] == pytest.approx(0.5 * ((calls + 1) // 2), abs=1e-2)  # the odd calls
    assert split["prepare"] == split["generation_idle"] == pytest.approx(0.5 * (calls // 2), abs=1e-2)
    ahead = [r["prepare_ahead_seconds"] for r in job.read_results().to_pylist()]
    assert {a is None for a in ahead} == ({True, False} if calls > 1 else {False})
    assert not list(job.path.rglob("*.ovtmp-*"))
    assert {p.name for p in (job.path / "wavs" / "default").iterdir()} == {f"r{i:02d}.wav" for i in range(6)}


def test_a_row_whose_preparation_crashes_is_rejected_and_the_others_run(tmp_path: Path):
    def sizer(row) -> RowSize:
        if row.id == "r02":
            raise RuntimeError("codec exploded")
        return _fake_sizer(row)

    FakeEngine.fail_ids = set()
    outcome = submit(
        _fake_cfg(_manifest(tmp_path / "m.parquet", 5)), tmp_path / "job", lambda cfg, rows: sizer
    )
    results = {r["id"]: r for r in outcome.job.read_results().to_pylist()}
    assert [results[f"r{i:02d}"]["status"] for i in range(5)] == ["ok", "ok", "rejected", "ok", "ok"]
    assert "RuntimeError: codec exploded" in results["r02"]["error"]


def test_a_resubmitted_job_must_be_the_same_job(tmp_path: Path):
    m = _manifest(tmp_path / "m.parquet", 4)
    submit(_fake_cfg(m), tmp_path / "job", lambda cfg, rows: _fake_sizer)
    resumed = submit(_fake_cfg(m), tmp_path / "job", lambda cfg, rows: _fake_sizer)
    assert resumed.shards_run == []
    with pytest.raises(JobDirError, match=r"a different job: .*generation.num_step: 32 -> 8\)\. Submit"):
        submit(_fake_cfg(m, "engine.generation.num_step=8"), tmp_path / "job", lambda cfg, rows: _fake_sizer)
    with pytest.raises(JobDirError, match=r"1 row\(s\) have other inputs \(e.g. id 'r01'\)"):
        submit(
            _fake_cfg(_manifest(m, 4, ["row r00", "changed", "row r02", "row r03"])),
            tmp_path / "job",
            lambda cfg, rows: _fake_sizer,
        )


def test_rows_cut_to_fit_the_token_budget_keep_it_for_the_whole_job(tmp_path: Path):
    """Such rows sound as their chunks do, which the budget (a run setting) chose: every variant, resume and
    rerun must run them under that budget, and rows that fit whole under a budget that still holds them."""

    def sizer(row) -> RowSize:
        return replace(_fake_sizer(row), cut_to_budget=row.id == "r01")

    m = _manifest(tmp_path / "m.parquet", 4)
    job = JobDir(tmp_path / "job")
    ab = _fake_cfg(m, "variants.a.precision=fp32", "variants.b.max_batch_tokens=128")
    with pytest.raises(InputError, match=r"variants.b: rows were cut into chunks to fit a token budget of 2"):
        submit(ab, job.path, lambda cfg, rows: sizer)
    submit(_fake_cfg(m), job.path, lambda cfg, rows: sizer)
    assert json.loads(job.plan_path.read_text())["token_budget"] == 256
    job.shard_result_path(0).unlink()
    with pytest.raises(JobDirError, match="cannot run variant default under these batch limits: rows were"):
        rerun(job.path, ["engine.max_batch_tokens=128"])
    with pytest.raises(JobDirError, match="these settings give one of 128"):
        submit(_fake_cfg(m, "engine.max_batch_tokens=128"), job.path, lambda cfg, rows: sizer)
    assert rerun(job.path, ["engine.buckets=[64,128,256,512]"]).shards_run == [0]  # the same budget


def test_a_rerun_under_a_budget_too_small_for_a_row_is_refused(tmp_path: Path):
    job = JobDir(tmp_path / "job")
    submit(_fake_cfg(_manifest(tmp_path / "m.parquet", 4)), job.path, lambda cfg, rows: _fake_sizer)
    largest = max((r for s in job.read_plan().shards for r in s.rows), key=lambda r: r.packed_tokens)
    for shard in job.read_plan().shards:
        job.shard_result_path(shard.index).unlink()
    with pytest.raises(JobDirError, match=rf"row '{largest.id}' needs {largest.packed_tokens} packed tokens"):
        rerun(job.path, [f"engine.max_batch_tokens={largest.packed_tokens - 1}"])


def test_a_resubmitted_job_reads_its_clips_where_the_manifest_now_puts_them(tmp_path: Path):
    """The plan holds the clips' content, not their paths: moved clips resume the job, from the new paths."""
    voices = tmp_path / "voices"
    voices.mkdir()
    for name in CLIPS:
        (voices / name).write_bytes((DATA / name).read_bytes())
    m = _manifest(tmp_path / "m.parquet", 4)
    table = pq.read_table(m)
    paths = [str(voices / Path(p).name) for p in table["ref_audio"].to_pylist()]
    pq.write_table(table.set_column(2, "ref_audio", pa.array(paths)), m)
    job = JobDir(tmp_path / "job")
    submit(_fake_cfg(m), job.path, lambda cfg, rows: _fake_sizer)
    job.shard_result_path(0).unlink()  # as if the driver had been killed before that shard's end
    voices.rename(tmp_path / "moved")
    moved = [p.replace("voices", "moved") for p in paths]
    pq.write_table(table.set_column(2, "ref_audio", pa.array(moved)), m)
    resumed = submit(_fake_cfg(m), job.path, lambda cfg, rows: _fake_sizer)
    assert resumed.shards_run == [0] and resumed.summary["rows"]["ok"] == 4
    assert all("/moved/" in r.ref_audio for r in job.read_rows().values())


def test_an_unreadable_results_file_is_named_with_its_fix(tmp_path: Path):
    m = _manifest(tmp_path / "m.parquet", 4)
    job = JobDir(tmp_path / "job")
    submit(_fake_cfg(m), job.path, lambda cfg, rows: _fake_sizer)
    for broken in (job.shard_result_path(0), job.results_dir / "rejected.parquet"):
        broken.write_bytes(b"")  # as a disk that lost it might leave it
        with pytest.raises(JobDirError, match=rf"{broken.name} cannot be read .*: delete it, then submit"):
            job.read_results()
        broken.unlink()
        assert submit(_fake_cfg(m), job.path, lambda cfg, rows: _fake_sizer).summary["rows"]["ok"] == 4
        assert broken.is_file()


def test_a_submit_or_rerun_while_the_job_runs_is_refused_and_touches_nothing(tmp_path: Path):
    m = _manifest(tmp_path / "m.parquet", 4)
    job = JobDir(tmp_path / "job")
    submit(_fake_cfg(m), job.path, lambda cfg, rows: _fake_sizer)
    job.shard_result_path(0).unlink()
    running = job.hold_for_run()  # as a run still going would
    in_flight = job.wav_path("default", "r00").with_name(f".r00.wav{TMP_MARK}live")
    in_flight.write_bytes(b"RIFF, being written")
    files = {p: p.read_bytes() for p in (job.config_path, job.rows_path, job.plan_path)}
    with pytest.raises(JobDirError, match="is being run by pid"):
        rerun(job.path)
    with pytest.raises(JobDirError, match="is being run by pid"):
        submit(_fake_cfg(m, "writer_threads=1"), job.path, lambda cfg, rows: _fake_sizer)
    assert in_flight.exists() and 0 not in job.finished_shards()
    assert {p: p.read_bytes() for p in files} == files
    running.close()
    assert rerun(job.path).shards_run == [0]


def test_killing_the_driver_then_resubmitting_redoes_only_unfinished_shards(tmp_path: Path, tmp_path_factory):
    """The real engine on the tiny checkpoint, local mode, in a subprocess killed with SIGKILL mid-job."""
    from engine.tiny import ensure_tiny_checkpoint
    from pipeline.sizing import frontend_sizer

    texts = ["Hi there.", "Thank you.", "Good night, see you soon.", "Yes, please."] * 2
    manifest = _manifest(tmp_path / "m.parquet", len(texts), texts)
    overrides = [
        f"engine.checkpoint={ensure_tiny_checkpoint()}",
        "engine.device=cpu",
        "engine.generation.num_step=4",
        f"engine.prompt_cache_dir={tmp_path_factory.getbasetemp() / 'ovbatch-prompts'}",
        "engine.buckets=[128,256,512,1024]",
        "engine.max_batch_tokens=1024",
        "shard_tokens=500",
        "progress=false",
    ]
    job = JobDir(tmp_path / "job")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "submit",
            str(manifest),
            "--out",
            str(job.path),
            "--local",
            *overrides,
        ],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    def logged_shards() -> int:
        return sum(r.get("event") == "shard" for r in job.read_runs())

    deadline = time.monotonic() + 240
    while not logged_shards() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver's own process group (start_new_session)
    stderr = proc.communicate()[1].decode(errors="replace")
    finished = job.finished_shards()
    planned = {s.index for s in job.read_plan().shards}
    assert finished, f"no shard finished before the deadline: {stderr[-2000:]}"
    assert len(planned) >= 3 and finished < planned, "the job finished before the driver could be killed"
    kept = {i: job.shard_result_path(i).read_bytes() for i in finished}
    kept_ids = {r.id for i in finished for r in job.read_shard_results(i)}
    stamps = {
        p: (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in (job.path / "wavs").rglob("*.wav")
        if p.stem in kept_ids
    }

    cfg = load_job_config(None, [f"manifest={manifest}", "local=true", *overrides])
    outcome = submit(cfg, job.path, frontend_sizer)
    assert sorted(outcome.shards_run) == sorted(planned - finished)
    for i, data in kept.items():
        assert job.shard_result_path(i).read_bytes() == data
    for p, stamp in stamps.items():
        assert (p.stat().st_ino, p.stat().st_mtime_ns) == stamp, f"{p} of a finished shard was rewritten"
    results = job.read_results().to_pylist()
    assert sorted(r["id"] for r in results) == [f"r{i:02d}" for i in range(len(texts))]
    assert all(r["status"] == "ok" for r in results)
    assert {p.stem for p in (job.path / "wavs" / "default").iterdir()} == {r["id"] for r in results}
    assert not list(job.path.rglob("*.ovtmp-*"))
    assert outcome.summary["complete"]
    runs = outcome.summary["runs"]  # the killed run counts, up to its last logged shard
    assert [(r["kind"], r["state"]) for r in runs] == [("submit", "unfinished"), ("resume", "finished")]
    # A shard's log line follows its result file, so a kill between the two loses the count, not the rows.
    assert 1 <= runs[0]["shards_finished"] <= len(finished) and runs[0]["wall_seconds"] > 0


def test_submit_never_writes_into_a_folder_that_is_not_a_job(tmp_path: Path):
    m = _manifest(tmp_path / "m.parquet", 2)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    with pytest.raises(JobDirError, match=r"already holds other files \(notes.txt\)"):
        submit(_fake_cfg(m), tmp_path / "busy", lambda cfg, rows: _fake_sizer)
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["notes.txt"]


def test_a_finished_run_does_not_wait_for_rays_teardown_and_a_stopped_one_does(tmp_path, monkeypatch):
    """Once every shard has returned nothing of the job runs on Ray; a run stopped half-way may still have
    actors writing until Ray is down, and the temp files are removed only after that."""
    import pipeline.job as job_mod

    waits = []

    class RecordingWorkers(job_mod.Workers):
        stop_after_ready = False

        def run(self, tasks, on_batch):
            if self.stop_after_ready:
                raise KeyboardInterrupt
            yield from super().run(tasks, on_batch)

        def shutdown(self, wait_for_ray=True):
            waits.append(wait_for_ray)
            super().shutdown(wait_for_ray)

    monkeypatch.setattr(job_mod, "Workers", RecordingWorkers)
    cfg = _fake_cfg(_manifest(tmp_path / "m.parquet", 6))
    assert submit(cfg, tmp_path / "done", lambda cfg, rows: _fake_sizer).summary["complete"]
    RecordingWorkers.stop_after_ready = True
    with pytest.raises(KeyboardInterrupt):
        submit(cfg, tmp_path / "stopped", lambda cfg, rows: _fake_sizer)
    assert waits == [False, True]


@pytest.mark.parametrize("local", [True, False])
def test_ray_starts_before_the_planning_and_a_failed_planning_stops_the_workers(tmp_path, monkeypatch, local):
    """Ray's start goes first (the actors wait for it); the local engines load beside the planning. A
    planning that fails stops the workers either way."""
    import pipeline.job as job_mod

    events, warmed = [], []

    class RecordingWorkers:
        def __init__(self, job, cfg, ray_head=None, warm=None):
            events.append("workers")
            warmed.append(warm)

        def shutdown(self):
            events.append("shutdown")

    def failing_plan(*args):
        events.append("plan")
        raise RuntimeError("planning failed")

    monkeypatch.setattr(job_mod, "Workers", RecordingWorkers)
    monkeypatch.setattr(job_mod, "_read_and_plan", failing_plan)
    cfg = _fake_cfg(_manifest(tmp_path / "m.parquet", 4), f"local={str(local).lower()}")
    with pytest.raises(RuntimeError, match="planning failed"):
        submit(cfg, tmp_path / "job", lambda cfg, rows: _fake_sizer)
    assert events[-1] == "shutdown" and sorted(events[:-1]) == ["plan", "workers"]
    # a new job's Ray actors get its reference clips to encode while it plans; local workers none (they
    # would share the planner's interpreter)
    pairs = job_mod.manifest_mod.reference_pairs(job_mod.manifest_mod.read_table(cfg.manifest))
    assert pairs and warmed == [None if local else pairs]
    if not local:
        assert events[:2] == ["workers", "plan"]
