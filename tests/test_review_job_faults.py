"""Fault-tolerance review of the job: a submit that stops on an error leaves no workers or Ray running,
with stand-ins for the engine and for Ray."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipeline.job as job_mod
from engine.api import SynthResult
from engine.errors import OVBatchError
from pipeline.config import load_job_config
from pipeline.plan import RowSize
from pipeline.store import JobDir, JobDirError

DATA = Path(__file__).resolve().parent / "data"


class ToneEngine:
    sample_rate = 8000
    model_id = "tone@000000000000"
    precision = "fp32"
    device = None

    def __init__(self, cfg):
        self.cfg = cfg

    def synthesize(self, reqs):
        audio = np.full(800, 0.1, np.float32)
        return [SynthResult(audio, self.sample_rate, 10, 320) for _ in reqs]


def _cfg(manifest: Path, *extra: str):
    return load_job_config(
        None,
        [
            f"manifest={manifest}",
            "local=true",
            f"engine_factory={__name__}:ToneEngine",
            "progress=false",
            "engine.buckets=[64,128]",
            "engine.max_batch_tokens=128",
            *extra,
        ],
    )


def _manifest(path: Path, n: int) -> Path:
    clip = str(DATA / "en_24k_mono.wav")
    table = {
        "id": [f"r{i}" for i in range(n)],
        "text": [f"row {i}" for i in range(n)],
        "ref_audio": [clip] * n,
        "ref_text": ["The quick brown fox jumps over the lazy dog."] * n,
    }
    pq.write_table(pa.table(table), path)
    return path


def _sizer(cfg, rows):
    return lambda row: RowSize(text_tokens=10, ref_frames=20, target_frames=15)


class RecordingWorkers:
    """Workers that only record whether the job shut them down."""

    shutdowns: list[str] = []

    def __init__(self, job, cfg, ray_head=None, warm=None):
        self.start_seconds, self.start_parts, self.started_at = 0.0, {}, 0.0

    def shutdown(self, wait_for_ray=True):
        RecordingWorkers.shutdowns.append("shutdown")


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("step", ["write_rows", "append_run"])
def test_a_submit_that_fails_after_its_planning_stops_its_workers(tmp_path: Path, monkeypatch, step: str):
    """The workers start beside the planning; a write that fails after it (the job's files, the run's
    record) must stop them, as a failed planning does: else a Ray job's actors keep their devices."""
    RecordingWorkers.shutdowns = []
    monkeypatch.setattr(job_mod, "Workers", RecordingWorkers)
    monkeypatch.setattr(JobDir, step, _disk_full)
    with pytest.raises(OSError, match="No space left"):
        job_mod.submit(_cfg(_manifest(tmp_path / "m.parquet", 3)), tmp_path / "job", _sizer)
    assert RecordingWorkers.shutdowns == ["shutdown"]


class FakeRay:
    """The calls a pool makes of Ray while it starts; actors are never run."""

    def __init__(self, cpus: float):
        self.cpus, self.up = cpus, False

    def is_initialized(self) -> bool:
        return self.up

    def init(self, **kwargs) -> None:
        self.up = True

    def shutdown(self) -> None:
        self.up = False

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": self.cpus}

    def remote(self, cls):
        raise AssertionError("no actor should be made for a pool that does not fit")

    def kill(self, actor, no_restart: bool = True) -> None:
        pass


def test_a_pool_refused_on_the_ray_the_job_started_shuts_that_ray_down(tmp_path: Path, monkeypatch):
    """Left up, the job's own Ray is taken for a cluster by the next pool in the process, which then only
    warns that its actors do not fit and waits for them forever."""
    fake = FakeRay(cpus=2.0)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = _cfg(_manifest(tmp_path / "m.parquet", 1), "local=false", "engine.device=cpu", "ray.num_actors=4")
    for _ in range(2):
        with pytest.raises(OVBatchError, match=r"4 actors x num_cpus=1 need 4, Ray has 2"):
            job_mod.Workers(JobDir(tmp_path / "job"), cfg)
        assert not fake.is_initialized()


class HeldEngine(ToneEngine):
    """Holds its run in its first batch: `running` is set once there, the batch goes on once `go` is."""

    running = threading.Event()
    go = threading.Event()

    def synthesize(self, reqs):
        HeldEngine.running.set()
        assert HeldEngine.go.wait(30), "the test never let the run go on"
        return super().synthesize(reqs)


def test_a_submit_that_plans_while_another_run_takes_the_job_writes_nothing_into_it(tmp_path: Path):
    """`refuse_if_running` is only checked before the planning; a run that takes the job meanwhile must
    still find its files untouched by the submit refused after it (config.yaml is what a rerun runs by)."""
    HeldEngine.running, HeldEngine.go = threading.Event(), threading.Event()
    manifest, out = _manifest(tmp_path / "m.parquet", 3), tmp_path / "job"
    late: list[BaseException] = []

    def late_sizer(cfg, rows):  # plans once the other run holds the job
        assert HeldEngine.running.wait(30)
        return _sizer(cfg, rows)

    def submit_late():
        try:
            job_mod.submit(_cfg(manifest, "writer_threads=3"), out, late_sizer)
        except BaseException as e:  # noqa: BLE001 - checked below
            late.append(e)

    second = threading.Thread(target=submit_late)
    second.start()
    first = threading.Thread(
        target=job_mod.submit, args=(_cfg(manifest, f"engine_factory={__name__}:HeldEngine"), out, _sizer)
    )
    first.start()
    second.join(30)
    HeldEngine.go.set()
    first.join(30)
    assert not second.is_alive() and not first.is_alive()
    assert len(late) == 1 and isinstance(late[0], JobDirError) and "is being run by pid" in str(late[0])
    job = JobDir(out)
    assert load_job_config(job.config_path).writer_threads == 2
    assert job_mod.status(out)["complete"]
