"""A job's time over interrupted, resumed and idle runs (issue 44, item 7), and the rejected and failed
rows that submit and status name, with the files listing them (item 5).

The engine is a stand-in that takes a fixed time per batch, so that a job's wall time can be compared
with its engine time: every second of audio the job produced was produced within some run's time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from engine.api import SynthResult
from engine.errors import InputError
from pipeline import cli
from pipeline.config import load_job_config
from pipeline.job import submit
from pipeline.plan import RowSize
from pipeline.store import JobDir
from pipeline.summary import realtime_text

DATA = Path(__file__).parent / "data"
CLIPS = json.loads((DATA / "clips.json").read_text())
BATCH_SECONDS = 0.15


class TimedEngine:
    """A tone per row after BATCH_SECONDS a batch; raises KeyboardInterrupt (Ctrl-C) on the batch
    after `interrupt_after` batches, and refuses texts holding BADINPUT as an engine would."""

    sample_rate = 8000
    model_id = "timed@000000000000"
    precision = "fp32"
    device = torch.device("cpu")
    interrupt_after: int | None = None
    batches = 0

    def __init__(self, cfg):
        self.cfg = cfg

    def synthesize(self, reqs):
        if TimedEngine.interrupt_after is not None and TimedEngine.batches >= TimedEngine.interrupt_after:
            raise KeyboardInterrupt
        TimedEngine.batches += 1
        if any("BADINPUT" in r.text for r in reqs):
            raise InputError("text holds BADINPUT, which the engine refuses")
        time.sleep(BATCH_SECONDS)
        frames = 25
        audio = np.zeros(frames * 320, np.float32)
        audio[::50] = 0.5
        return [SynthResult(audio, self.sample_rate, frames, token_work=frames, timings={}) for _ in reqs]


@pytest.fixture(autouse=True)
def reset_engine():
    TimedEngine.interrupt_after, TimedEngine.batches = None, 0
    yield


def _manifest(path: Path, texts: list[str]) -> Path:
    clip = "en_24k_mono.wav"
    pq.write_table(
        pa.table(
            {
                "id": [f"r{i:02d}" for i in range(len(texts))],
                "text": texts,
                "ref_audio": [str(DATA / clip)] * len(texts),
                "ref_text": [CLIPS[clip]["transcript"]] * len(texts),
            }
        ),
        path,
    )
    return path


def _cfg(manifest: Path):
    # one row a shard and a batch: 6 rows are 6 shards of BATCH_SECONDS each
    return load_job_config(
        None,
        [
            f"manifest={manifest}",
            "local=true",
            f"engine_factory={__name__}:TimedEngine",
            "progress=false",
            "engine.buckets=[64]",
            "engine.max_batch_tokens=64",
            "shard_tokens=1",
        ],
    )


def _sizer(cfg, rows):
    return lambda row: RowSize(text_tokens=10, ref_frames=10, target_frames=10)


def _submit(tmp_path: Path, texts: list[str]):
    return submit(_cfg(_manifest(tmp_path / "m.parquet", texts)), tmp_path / "job", _sizer)


def _drop_end_events(monkeypatch) -> None:
    """A driver killed outright (SIGKILL) writes no end event."""
    append = JobDir.append_run
    monkeypatch.setattr(
        JobDir, "append_run", lambda self, rec: None if rec.get("event") == "end" else append(self, rec)
    )


@pytest.mark.parametrize("how", ["ctrl-c", "killed"])
def test_an_interrupted_run_counts_its_time_so_the_job_is_not_faster_than_its_engine(
    tmp_path: Path, monkeypatch, capsys, how: str
):
    TimedEngine.interrupt_after = 4
    with monkeypatch.context() as m:
        if how == "killed":
            _drop_end_events(m)
        with pytest.raises(KeyboardInterrupt):
            _submit(tmp_path, [f"row {i}" for i in range(6)])
    job = JobDir(tmp_path / "job")
    assert len(job.finished_shards()) == 4

    assert cli.main(["status", str(job.path)]) == 0
    out = capsys.readouterr().out
    assert "over 1 run(s)" in out and "no audio timed yet" not in out
    if how == "ctrl-c":
        assert "run submit started" in out and "stopped by KeyboardInterrupt" in out
    else:
        assert "no end recorded (killed, or still running)" in out and "4 of 6 shard(s)" in out
    assert f"2 shard(s) not run yet: `ovbatch rerun {job.path}` runs them" in out
    interrupted = json.loads(cli_json(job, capsys))["wall_seconds"]
    assert interrupted >= 4 * BATCH_SECONDS

    TimedEngine.interrupt_after = None
    s = _submit(tmp_path, [f"row {i}" for i in range(6)]).summary
    assert s["complete"] and [r["kind"] for r in s["runs"]] == ["submit", "resume"]
    assert s["wall_seconds"] >= s["synth_seconds"] >= 6 * BATCH_SECONDS
    assert s["x_realtime"] <= s["engine_x_realtime"]


def cli_json(job: JobDir, capsys) -> str:
    assert cli.main(["status", str(job.path), "--json"]) == 0
    return capsys.readouterr().out


def test_a_resume_with_nothing_to_run_adds_no_time(tmp_path: Path, capsys):
    first = _submit(tmp_path, ["row 0", "row 1"]).summary
    again = _submit(tmp_path, ["row 0", "row 1"])
    assert again.shards_run == []
    assert again.summary["wall_seconds"] == first["wall_seconds"]
    assert [r["shards"] for r in again.summary["runs"]] == [2, 0]
    assert cli.main(["status", str(again.job.path)]) == 0
    assert "over 1 run(s) (+1 that had nothing to run)" in capsys.readouterr().out


def test_runs_recorded_before_events_still_count(tmp_path: Path):
    s = _submit(tmp_path, ["row 0"]).summary
    job = JobDir(tmp_path / "job")
    job.runs_path.write_text(json.dumps({"kind": "submit", "wall_seconds": 7.5, "shards": 1}) + "\n")
    from pipeline.summary import summarize

    again = summarize(job)
    assert again["wall_seconds"] == 7.5 and again["runs"][0]["state"] == "finished"
    assert again["audio_seconds"] == s["audio_seconds"]


def test_submit_and_status_name_the_rejected_rows_and_their_files(tmp_path: Path, capsys):
    texts = ["row 0", "", "row 2", "BADINPUT row 3", "", "row 5", "", "", "", ""]
    outcome = _submit(tmp_path, texts)
    assert cli._print_outcome(outcome) == 0
    printed = capsys.readouterr().out
    assert cli.main(["status", str(outcome.job.path)]) == 0
    status = capsys.readouterr().out
    rejected = outcome.job.results_dir / "rejected.parquet"
    at_run = outcome.job.shard_result_path(
        next(r["shard"] for r in outcome.job.read_results().to_pylist() if r["id"] == "r03")
    )
    for out in (printed, status):
        assert "7 row(s) rejected (not run: fix their inputs and submit them to a new --out):" in out
        assert "  row 1 id='r01': text is empty: give the words to speak" in out
        assert "  row 3 id='r03': InputError: text holds BADINPUT, which the engine refuses" in out
        assert "  ... and 2 more" in out  # five are named
        assert f"listed with status='rejected' and the reason in `error` in: {rejected}, {at_run}" in out
    summary = json.loads(outcome.job.summary_path.read_text())
    assert summary["problems"]["rejected"]["count"] == 7 and summary["problems"]["failed"]["count"] == 0


def test_status_says_a_job_is_running_instead_of_advising_a_rerun(tmp_path: Path, capsys):
    outcome = _submit(tmp_path, ["row 0", "row 1"])
    job = outcome.job
    for index in job.finished_shards():
        job.shard_result_path(index).unlink()
    assert cli.main(["status", str(job.path)]) == 0
    assert "shard(s) not run yet: `ovbatch rerun" in capsys.readouterr().out
    held = job.hold_for_run()  # as a run still going holds it
    assert cli.main(["status", str(job.path)]) == 0
    out = capsys.readouterr().out
    assert "running now (pid " in out and "shard(s) not finished yet." in out and "ovbatch rerun" not in out
    held.close()
    assert job.running_by() is None


def test_x_realtime_reads_as_people_write_it():
    assert realtime_text(6.7051) == "6.7x realtime"
    assert realtime_text(None) == "no audio timed yet"
