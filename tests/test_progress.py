"""The job's progress bar moves per finished batch in local mode, rows with audio seconds beside them, and
never counts a row twice: not when a batch is split after an out-of-memory error, not at shard end
(issue 44, item 6)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from engine.api import SynthResult
from pipeline import job as job_mod
from pipeline.config import load_job_config
from pipeline.job import Progress, submit
from pipeline.plan import RowSize
from pipeline.shard_runner import BatchDone

DATA = Path(__file__).parent / "data"
CLIPS = json.loads((DATA / "clips.json").read_text())
ROW_SECONDS = 0.5


class RecordingBar:
    """Stands in for tqdm: keeps the count and postfix it is given."""

    made: list[RecordingBar] = []

    def __init__(self, total: int, **_):
        self.total, self.n, self.postfix = total, 0, ""
        self.steps: list[int] = []  # every update's rows
        RecordingBar.made.append(self)

    def update(self, n: int) -> None:
        self.n += n
        self.steps.append(n)

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def close(self) -> None:
        pass


class CountingEngine:
    """Half a second of silence a row. With `oom`, a batch of more than one row raises CUDA's
    out-of-memory error (the runner splits it)."""

    sample_rate = 8000
    model_id = "counting@000000000000"
    precision = "fp32"
    device = torch.device("cpu")
    oom = False

    def __init__(self, cfg):
        self.cfg = cfg

    def synthesize(self, reqs):
        if CountingEngine.oom and len(reqs) > 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        audio = np.zeros(int(ROW_SECONDS * self.sample_rate), np.float32)
        return [SynthResult(audio, self.sample_rate, 12, token_work=12, timings={}) for _ in reqs]


@pytest.fixture(autouse=True)
def recording(monkeypatch):
    monkeypatch.setattr(job_mod, "tqdm", RecordingBar)
    RecordingBar.made, CountingEngine.oom = [], False


def _submit(tmp_path: Path, rows: int):
    clip = "en_24k_mono.wav"
    manifest = tmp_path / "m.parquet"
    pq.write_table(
        pa.table(
            {
                "id": [f"r{i:02d}" for i in range(rows)],
                "text": [f"row {i}" for i in range(rows)],
                "ref_audio": [str(DATA / clip)] * rows,
                "ref_text": [CLIPS[clip]["transcript"]] * rows,
            }
        ),
        manifest,
    )
    # every row 40 packed tokens: two rows a batch, all rows in one shard
    cfg = load_job_config(
        None,
        [
            f"manifest={manifest}",
            "local=true",
            f"engine_factory={__name__}:CountingEngine",
            "engine.buckets=[80]",
            "engine.max_batch_tokens=80",
            "shard_tokens=100000",
        ],
    )
    return submit(cfg, tmp_path / "job", lambda cfg, rows: lambda row: RowSize(10, 10, 10))


def test_the_bar_moves_per_batch_with_audio_seconds_and_counts_each_row_once(tmp_path: Path):
    outcome = _submit(tmp_path, 6)
    assert outcome.shards_run == [0]  # one shard of three batches
    (bar,) = RecordingBar.made
    assert [n for n in bar.steps if n] == [2, 2, 2]  # as each batch's rows are written; none at shard end
    assert bar.n == bar.total == 6
    assert bar.postfix == f"{6 * ROW_SECONDS:.1f} s audio"


def test_a_batch_split_after_out_of_memory_counts_its_rows_once(tmp_path: Path):
    CountingEngine.oom = True
    outcome = _submit(tmp_path, 5)
    assert outcome.summary["complete"]
    (bar,) = RecordingBar.made
    assert [n for n in bar.steps if n] == [1, 1, 1, 1, 1]  # every row alone, each counted as it ends
    assert bar.n == bar.total == 5
    assert bar.postfix == f"{5 * ROW_SECONDS:.1f} s audio"


def test_a_shard_end_adds_only_what_its_batches_did_not_report():
    bar = RecordingBar(total=7)
    progress = Progress(bar)
    progress.batch(BatchDone(shard=3, attempt=1, rows=2, audio_seconds=1.0))
    progress.shard_done(3, rows=4, audio_seconds=2.5)  # two rows were already counted
    assert (bar.n, bar.postfix) == (4, "2.5 s audio")
    progress.shard_done(5, rows=3, audio_seconds=1.5)  # a shard that reported no batch
    assert (bar.n, bar.postfix) == (7, "4.0 s audio")


def test_a_shard_run_again_after_its_actor_died_counts_its_rows_once():
    bar = RecordingBar(total=4)
    progress = Progress(bar)
    progress.batch(BatchDone(shard=2, attempt=1, rows=2, audio_seconds=1.0))  # then the actor dies
    progress.batch(BatchDone(shard=2, attempt=2, rows=1, audio_seconds=0.5))  # the same rows again
    assert bar.n == 2
    progress.batch(BatchDone(shard=2, attempt=2, rows=2, audio_seconds=1.0))
    assert (bar.n, bar.postfix) == (3, "1.5 s audio")
    progress.shard_done(2, rows=4, audio_seconds=2.0)
    progress.batch(BatchDone(shard=2, attempt=1, rows=1, audio_seconds=0.5))  # a dead actor's late word
    assert (bar.n, bar.postfix) == (4, "2.0 s audio")
