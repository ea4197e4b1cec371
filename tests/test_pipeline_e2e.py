"""End to end on the tiny checkpoint through a local Ray with two CPU actors: 40+ rows in 3+ buckets,
bad rows rejected while the others run; then an actor killed mid-job, an actor that keeps dying, one
that cannot start, an error inside an actor, and a local Ray too small for the pool.

One Ray session for the module (2 CPUs, no dashboard). The engine runs 4 decoding steps instead of 32
to keep the CPU suite short; everything else is the product's default path.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import soundfile as sf

from engine.errors import OVBatchError
from engine.tiny import ensure_tiny_checkpoint
from pipeline.atomic import TMP_MARK
from pipeline.cli import main as cli_main
from pipeline.config import load_job_config
from pipeline.job import submit
from pipeline.plan import RowSize
from pipeline.ray_runner import ActorPool
from pipeline.shard_runner import ShardTask
from pipeline.sizing import frontend_sizer
from pipeline.store import JobDir

DATA = Path(__file__).parent / "data"
CLIPS = json.loads((DATA / "clips.json").read_text())
TEXTS = {  # three lengths: three graph buckets
    "short": ["Hi there.", "Thank you.", "Good night.", "Yes, please."],
    "medium": [
        "The train leaves at nine, so do not be late today.",
        "We wrote down every number we saw that afternoon.",
    ],
    "long": [
        "Batch synthesis turns a long list of sentences into speech, one clean file for every row, "
        "while the graphs stay warm and the queue keeps moving."
    ],
}


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny_checkpoint()


@pytest.fixture(scope="module")
def prompt_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "ovbatch-prompts"  # shared by the pipeline test modules


def write_manifest(path: Path, kinds: list[str], bad_rows: bool = False) -> Path:
    names = sorted(CLIPS)
    rows = {"id": [], "text": [], "ref_audio": [], "ref_text": []}
    for i, kind in enumerate(kinds):
        clip = names[i % len(names)]
        rows["id"].append(f"{kind}-{i:02d}")
        rows["text"].append(TEXTS[kind][i % len(TEXTS[kind])])
        rows["ref_audio"].append(str(DATA / clip))
        rows["ref_text"].append(CLIPS[clip]["transcript"])
    if bad_rows:
        first = str(DATA / names[0])
        for rid, text, clip in (
            ("../escape", "Hello.", first),
            ("blank", "  ", first),
            ("noclip", "Hello.", str(DATA / "missing.wav")),
        ):
            rows["id"].append(rid)
            rows["text"].append(text)
            rows["ref_audio"].append(clip)
            rows["ref_text"].append(CLIPS[names[0]]["transcript"])
    pq.write_table(pa.table(rows), path)
    return path


def job_config(manifest: Path, tiny: Path, prompts: Path, *extra: str):
    return load_job_config(
        None,
        [
            f"manifest={manifest}",
            f"engine.checkpoint={tiny}",
            f"engine.prompt_cache_dir={prompts}",
            "engine.device=cpu",
            "engine.generation.num_step=4",
            "engine.buckets=[128,256,512,1024]",
            "engine.max_batch_tokens=1024",
            "shard_tokens=1200",
            "ray.num_actors=2",
            "progress=false",
            *extra,
        ],
    )


def check_outputs(job: JobDir, expected_ok: set[str], precision: str = "fp32") -> list[dict]:
    """Every row exactly once; a whole, readable wav for each ok row and nothing else in wavs/."""
    results = job.read_results().to_pylist()
    ids = [r["id"] for r in results]
    assert len(ids) == len(set(ids)), "a row appears twice in the results"
    ok = {r["id"]: r for r in results if r["status"] == "ok"}
    assert set(ok) == expected_ok
    wavs = {p.name for p in (job.path / "wavs" / "default").iterdir()}
    assert wavs == {f"{i}.wav" for i in expected_ok}
    assert not list(job.path.rglob(f"*{TMP_MARK}*"))
    for r in ok.values():
        info = sf.info(job.path / r["wav_path"])
        assert info.samplerate == 24000
        assert info.frames / info.samplerate == pytest.approx(r["audio_seconds"])
        assert r["synth_seconds"] > 0 and r["rtf"] == pytest.approx(r["synth_seconds"] / r["audio_seconds"])
        assert r["target_frames"] > 0 and r["model"].startswith("tiny") and r["precision"] == precision
    return results


def test_end_to_end_on_local_ray(ray_session, tiny, prompt_cache, tmp_path: Path, capsys):
    kinds = ["short"] * 20 + ["medium"] * 14 + ["long"] * 8
    manifest = write_manifest(tmp_path / "m.parquet", kinds, bad_rows=True)
    outcome = submit(job_config(manifest, tiny, prompt_cache), tmp_path / "job", frontend_sizer)
    job = outcome.job
    valid = {f"{k}-{i:02d}" for i, k in enumerate(kinds)}
    results = check_outputs(job, valid)

    rejected = {r["id"]: r["error"] for r in results if r["status"] == "rejected"}
    assert set(rejected) == {"../escape", "blank", "noclip"}
    assert "path separator" in rejected["../escape"] and "text is empty" in rejected["blank"]
    assert "does not exist" in rejected["noclip"] or "not found" in rejected["noclip"]

    ok = [r for r in results if r["status"] == "ok"]
    assert len({r["bucket"] for r in ok}) >= 3
    assert len({r["worker"] for r in ok}) == 2, "both actors should have run shards"
    assert all(r["attempt"] == 1 for r in ok)
    for kind, bucket in (("short", min), ("long", max)):
        # longer texts land in larger buckets
        assert bucket(r["bucket"] for r in ok) in {r["bucket"] for r in ok if r["id"].startswith(kind)}

    s = json.loads(job.summary_path.read_text())
    assert s["complete"] and s["rows"]["ok"] == len(valid) and s["rows"]["rejected"] == 3
    assert s["rows"]["failed"] == 0 and s["rows"]["pending"] == 0
    assert len(s["per_bucket"]) >= 3 and s["x_realtime"] > 0
    assert sum(b["rows"] for b in s["per_bucket"]) == len(valid)
    (run,) = s["runs"]  # what getting the actors ready took: their boot, engine load, capture
    assert 0 < run["boot_seconds"] < run["ready_seconds"] and 0 < run["load_seconds"] < run["ready_seconds"]
    assert 0 < run["import_seconds"] < run["ready_seconds"]  # a fresh actor process imports the engine
    parts = run["worker_start_parts"]  # Ray's start before the planning: import, ray.init, actors created
    assert set(parts) == {"import", "ray_init", "actors"}
    assert sum(parts.values()) <= run["worker_start_seconds"] + 0.003  # each rounded to 1 ms
    phases = run["planning_phases"]  # plan_job's steps, inside the planning
    assert set(phases) == {"manifest", "clips", "rows", "cut"} and min(phases.values()) >= 0
    assert sum(phases.values()) <= run["planning_seconds"] + 0.004  # each rounded to 1 ms
    breakdown = run["load_breakdown"]  # the slowest actor's Engine.load_timings
    assert {"weights", "merge", "codec", "other"} <= set(breakdown)
    assert sum(breakdown.values()) <= run["load_seconds"] + 0.01  # each phase rounded to 1 ms
    plan = json.loads(job.plan_path.read_text())
    assert all(
        len({r["id"][:4] for r in sh["rows"]}) >= 1 and sh["bucket"] in (128, 256, 512, 1024)
        for sh in plan["shards"]
    )
    assert (job.path / "config.yaml").read_text().count("num_step: 4") == 1

    assert cli_main(["status", str(job.path)]) == 0
    out = capsys.readouterr().out
    assert f"{len(valid)} ok, 0 failed, 3 rejected" in out and "complete" in out


def test_killing_an_actor_mid_job_loses_nothing(ray_session, tiny, prompt_cache, tmp_path: Path):
    kinds = ["short"] * 10 + ["medium"] * 6
    manifest = write_manifest(tmp_path / "m.parquet", kinds)
    cfg = job_config(manifest, tiny, prompt_cache, "shard_tokens=500")
    job = JobDir(tmp_path / "job")
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.setdefault("o", submit(cfg, job.path, frontend_sizer)))
    runner.start()
    deadline = time.monotonic() + 240
    while not job.finished_shards() and time.monotonic() < deadline and runner.is_alive():
        time.sleep(0.2)
    assert job.finished_shards(), "no shard finished in time"
    planned = len(job.read_plan().shards)
    assert len(job.finished_shards()) < planned, "the job finished before an actor could be killed"
    actors = sorted(
        (a["name"], a["namespace"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("ovbatch-")
    )
    assert len(actors) == 2
    ray.kill(ray.get_actor(actors[0][0], namespace=actors[0][1]), no_restart=True)
    runner.join(timeout=300)
    assert not runner.is_alive() and "o" in outcome

    results = check_outputs(job, {f"{k}-{i:02d}" for i, k in enumerate(kinds)})
    assert all(r["status"] == "ok" for r in results)
    assert max(r["attempt"] for r in results) == 2, "the killed actor's shard should have run a second time"
    assert outcome["o"].summary["complete"]
    assert len({r["worker"] for r in results}) >= 2


class DyingEngine:
    """An engine whose process exits in the middle of every batch (as a crashed GPU worker would)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def synthesize(self, reqs):
        os._exit(3)


def test_a_shard_whose_actor_keeps_dying_fails_after_its_attempts(ray_session, tmp_path: Path):
    manifest = write_manifest(tmp_path / "m.parquet", ["short", "medium"])
    factory = f"tests.{Path(__file__).stem}:DyingEngine"  # imported by the actors from the repo root
    cfg = load_job_config(
        None,
        [
            f"manifest={manifest}",
            f"engine_factory={factory}",
            "ray.num_actors=1",
            "ray.max_shard_attempts=2",
            "progress=false",
        ],
    )
    outcome = submit(cfg, tmp_path / "job", lambda cfg, rows: lambda row: RowSize(10, 20, 30))
    results = outcome.job.read_results().to_pylist()
    assert sorted(r["id"] for r in results) == ["medium-01", "short-00"]
    for r in results:
        assert r["status"] == "failed" and r["attempt"] == 2
        assert "died 2 time(s) (ray.max_shard_attempts=2)" in r["error"]
    assert not (outcome.job.path / "wavs").exists()
    assert outcome.summary["rows"]["failed"] == 2 and outcome.summary["complete"]


class SlowEngine:
    """Half a second of silence a row, after BATCH_SECONDS a batch."""

    BATCH_SECONDS = 1.0
    sample_rate = 8000
    model_id = "slow@000000000000"
    precision = "fp32"

    def __init__(self, cfg):
        self.cfg = cfg

    def synthesize(self, reqs):
        from engine.api import SynthResult

        time.sleep(self.BATCH_SECONDS)
        audio = np.zeros(self.sample_rate // 2, np.float32)
        return [SynthResult(audio, self.sample_rate, 12, token_work=12, timings={}) for _ in reqs]


def test_the_bar_moves_per_batch_while_an_actor_runs_its_shard(ray_session, tmp_path: Path, monkeypatch):
    """Issue 44, item 6: actors report each batch through a queue the driver drains while it waits."""
    from pipeline import job as job_mod

    updates: list[tuple[float, int, str]] = []

    class Bar:
        def __init__(self, total: int, **_):
            self.postfix = ""

        def set_postfix_str(self, text: str, refresh: bool = True) -> None:
            self.postfix = text

        def update(self, n: int) -> None:
            updates.append((time.perf_counter(), n, self.postfix))

        def close(self) -> None:
            pass

    monkeypatch.setattr(job_mod, "tqdm", Bar)
    manifest = write_manifest(tmp_path / "m.parquet", ["short"] * 8)
    factory = f"tests.{Path(__file__).stem}:SlowEngine"
    cfg = load_job_config(
        None,  # every row 40 packed tokens: two rows a batch, all eight in one shard
        [
            f"manifest={manifest}",
            f"engine_factory={factory}",
            "engine.buckets=[80]",
            "engine.max_batch_tokens=80",
            "shard_tokens=100000",
            "ray.num_actors=1",
        ],
    )
    outcome = submit(cfg, tmp_path / "job", lambda cfg, rows: lambda row: RowSize(10, 10, 10))
    assert outcome.summary["complete"] and outcome.shards_run == [0]
    assert [n for _, n, _ in updates] == [2, 2, 2, 2, 0]  # four batches, then the shard's end adds nothing
    audio = ["1.0 s audio", "2.0 s audio", "3.0 s audio", "4.0 s audio", "4.0 s audio"]
    assert [text for _, _, text in updates] == audio
    # A batch shows once the engine has finished the next one (its rows are written meanwhile).
    first_batch, shard_end = updates[0][0], updates[-1][0]
    assert shard_end - first_batch > SlowEngine.BATCH_SECONDS  # the first batch showed before the shard ended


class UnloadableEngine:
    """An engine that cannot load (as a wrong checkpoint path would)."""

    def __init__(self, cfg):
        raise OVBatchError("checkpoint '/nowhere' not found: pass an OmniVoice checkpoint directory")


def test_an_error_inside_an_actor_is_reported_by_its_own_message(ray_session, tmp_path: Path):
    manifest = write_manifest(tmp_path / "m.parquet", ["short"])
    factory = f"tests.{Path(__file__).stem}:UnloadableEngine"
    cfg = load_job_config(
        None, [f"manifest={manifest}", f"engine_factory={factory}", "ray.num_actors=1", "progress=false"]
    )
    with pytest.raises(OVBatchError, match=r"could not start on a worker: .*checkpoint '/nowhere' not found"):
        submit(cfg, tmp_path / "job", lambda cfg, rows: lambda row: RowSize(10, 20, 30))


class UnwritableEngine:
    """Audio at sample rate 0, which no wav holds: the shard's write fails (an OSError, as a full disk's)."""

    sample_rate, model_id, precision, device = 0, "unwritable@000000000000", "fp32", None

    def __init__(self, cfg):
        self.cfg = cfg

    def synthesize(self, reqs):
        from engine.api import SynthResult

        return [SynthResult(np.zeros(800, np.float32), 0, 10, 320) for _ in reqs]


def test_an_unexpected_error_inside_an_actor_stops_the_job_as_unexpected(ray_session, tmp_path: Path):
    """Not an input problem the worker named (OVBatchError, exit 2) but a bug's or the machine's: exit 3 with
    the worker's traceback chained, as the same error in the driver's process would."""
    manifest = write_manifest(tmp_path / "m.parquet", ["short"])
    factory = f"tests.{Path(__file__).stem}:UnwritableEngine"
    cfg = load_job_config(
        None, [f"manifest={manifest}", f"engine_factory={factory}", "ray.num_actors=1", "progress=false"]
    )
    with pytest.raises(Exception, match=r"shard 0 could not run: OSError: cannot write") as raised:
        submit(cfg, tmp_path / "job", lambda cfg, rows: lambda row: RowSize(10, 20, 30))
    assert not isinstance(raised.value, OVBatchError)


def test_an_actor_that_cannot_start_stops_the_job_with_the_cause(ray_session, tmp_path: Path):
    cfg = load_job_config(None, ["engine_factory=no_such_module:Engine", "ray.num_actors=1"])
    pool = ActorPool(str(tmp_path), cfg)
    task = ShardTask(0, "default", 128, 1, [])
    try:
        with pytest.raises(OVBatchError, match=r"could not start on a worker: .*no_such_module"):
            list(pool.run([task]))
    finally:
        pool.shutdown()


def test_a_local_ray_too_small_for_the_actors_is_refused(ray_session, tmp_path: Path):
    cfg = load_job_config(None, ["ray.num_actors=3"])  # the module's Ray has 2 CPUs
    with pytest.raises(OVBatchError, match=r"3 actors x num_cpus=1 need 3, Ray has 2"):
        ActorPool(str(tmp_path), cfg, started_ray=True)


@pytest.mark.gpu
def test_gpu_actor_end_to_end(ray_session, tiny, prompt_cache, tmp_path: Path):
    """The same job with one Ray GPU actor (bf16, CUDA graphs) on the tiny checkpoint."""
    kinds = ["short"] * 6 + ["medium"] * 4 + ["long"] * 2
    manifest = write_manifest(tmp_path / "m.parquet", kinds)
    cfg = job_config(manifest, tiny, prompt_cache, "engine.device=cuda", "ray.num_actors=1")
    outcome = submit(cfg, tmp_path / "job", frontend_sizer)
    results = check_outputs(outcome.job, {f"{k}-{i:02d}" for i, k in enumerate(kinds)}, precision="bf16")
    assert all(r["gpu"] for r in results) and len({r["worker"] for r in results}) == 1
    assert len({r["bucket"] for r in results}) >= 3
