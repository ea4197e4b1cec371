"""Planning: buckets, shards of one bucket and variant within a token budget, rejections, JSON round trip."""

import os
import random
from pathlib import Path

import pytest

from engine.generate.batching import bucket_for
from pipeline.manifest import ManifestRow, Rejection
from pipeline.plan import Plan, RowSize, make_plan

BUCKETS = (128, 256, 512, 1024)


def _rows(n: int, rng: random.Random) -> tuple[list[ManifestRow], dict[str, RowSize]]:
    rows, sizes = [], {}
    for i in range(n):
        rid = f"r{i:03d}"
        rows.append(ManifestRow(row_index=i, id=rid, text="t", ref_audio=None, ref_text=None))
        sizes[rid] = RowSize(
            text_tokens=rng.randint(5, 60), ref_frames=rng.randint(0, 150), target_frames=rng.randint(10, 450)
        )
    return rows, sizes


def test_bucket_for_picks_the_smallest_that_holds():
    assert bucket_for(1, BUCKETS) == 128
    assert bucket_for(128, BUCKETS) == 128
    assert bucket_for(129, BUCKETS) == 256
    assert bucket_for(1024, BUCKETS) == 1024
    assert bucket_for(1025, BUCKETS) is None


def test_row_size_counts_cond_and_uncond():
    s = RowSize(text_tokens=10, ref_frames=30, target_frames=50)
    assert s.packed_tokens == 10 + 30 + 50 + 50


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shards_cover_every_row_once_per_variant_within_budget(seed: int):
    rng = random.Random(seed)
    rows, sizes = _rows(200, rng)
    keys = {v: {r.id: f"{v}-{r.id}" for r in rows} for v in ("fp16", "w4a4")}
    pre = [Rejection(500, "bad", "text is empty")]
    plan = make_plan(
        rows, pre, sizes, keys, BUCKETS, max_batch_tokens=1000, shard_tokens=3000, max_rows_per_shard=16
    )
    too_long = {r.id for r in rows if sizes[r.id].packed_tokens > 1000}
    assert too_long, "the random sizes should include rows over the limit"
    assert {r.id for r in plan.rejected} == too_long | {"bad"}
    assert all("packed tokens" in r.reason for r in plan.rejected if r.id != "bad")
    for variant in ("fp16", "w4a4"):
        planned = [p.id for s in plan.shards if s.variant == variant for p in s.rows]
        assert sorted(planned) == sorted(r.id for r in rows if r.id not in too_long)
    for s in plan.shards:
        assert all(bucket_for(p.packed_tokens, BUCKETS) == s.bucket for p in s.rows)
        assert all(p.row_key == f"{s.variant}-{p.id}" for p in s.rows)
        assert s.tokens == sum(p.packed_tokens for p in s.rows)
        assert len(s.rows) <= 16
        assert s.tokens <= 3000 or len(s.rows) == 1
    assert [s.index for s in plan.shards] == list(range(len(plan.shards)))
    # largest buckets first, so the end of a job is made of short shards
    order = [s.bucket for s in plan.shards]
    assert order == sorted(order, reverse=True)


def test_plan_json_round_trip_and_fingerprint():
    rows, sizes = _rows(40, random.Random(5))
    keys = {"default": {r.id: r.id + "-k" for r in rows}}
    plan = make_plan(rows, [], sizes, keys, BUCKETS, 1024, 2000, 64)
    again = Plan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json()
    assert again.fingerprint == plan.fingerprint
    keys["default"][rows[0].id] = "changed"
    assert make_plan(rows, [], sizes, keys, BUCKETS, 1024, 2000, 64).fingerprint != plan.fingerprint

    def with_rejection(index: int, rid: str, reason: str) -> str:
        return make_plan(
            rows, [Rejection(index, rid, reason)], sizes, keys, BUCKETS, 1024, 2000, 64
        ).fingerprint

    reworded = (
        with_rejection(99, "x", "unreadable (request 1)"),
        with_rejection(99, "x", "unreadable (request 2)"),
    )
    assert reworded[0] == reworded[1] != with_rejection(98, "y", "unreadable (request 1)")


def test_a_row_bigger_than_the_budget_gets_its_own_shard():
    rows, _ = _rows(3, random.Random(0))
    sizes = {r.id: RowSize(10, 0, 300) for r in rows}  # 610 tokens each, budget 500
    plan = make_plan(rows, [], sizes, {"v": {r.id: r.id for r in rows}}, BUCKETS, 1024, 500, 100)
    assert [len(s.rows) for s in plan.shards] == [1, 1, 1]


def _sizing_config(prompts):
    from pipeline.config import load_job_config

    return load_job_config(
        None,
        [  # texts over 4 s come in chunks of about 2 s
            "engine.device=cpu",
            "engine.generation.num_step=1",
            "engine.generation.audio_chunk_threshold=4",
            "engine.generation.audio_chunk_duration=2",
            f"engine.prompt_cache_dir={prompts}",
        ],
    )


def test_planning_sizes_rows_as_the_engine_spends_them_without_the_codec(tmp_path_factory, monkeypatch):
    """Sizes from the frontend (tokenizer and codec config only; the clip prepared and counted in hops)
    equal what the engine then builds and spends: reference frames from the codec, packed tokens per
    chunk, token work at one decoding step. A long text (chunked) is sized by its largest chunk, its
    work by all of them. Clips at every rate and format of tests/data."""
    import json
    from pathlib import Path

    from engine.api import Engine
    from engine.codec import Codec
    from pipeline.shard_runner import synth_request
    from pipeline.sizing import frontend_sizer, prepared_size

    data = Path(__file__).parent / "data"
    clips = json.loads((data / "clips.json").read_text())
    cfg = _sizing_config(tmp_path_factory.getbasetemp() / "ovbatch-prompts")
    long_text = "This sentence goes on to make a text that needs chunks. And here is another one, too."
    texts = ["Hello.", "A longer line of text to speak.", long_text]
    rows = [
        ManifestRow(i, f"r{i}", texts[i % 3], str(data / name), clip["transcript"])
        for i, (name, clip) in enumerate(sorted(clips.items()))
    ]
    rows.append(ManifestRow(len(rows), "design", long_text, None, None))

    def no_codec(*args, **kwargs):
        raise AssertionError("planning loaded the codec")

    with monkeypatch.context() as m:
        m.setattr(Codec, "from_dir", no_codec)
        sizer = frontend_sizer(cfg, rows)
        sizes = [sizer(r) for r in rows]
    engine = Engine(cfg.engine_config("default"))
    spent = engine.synthesize([synth_request(r) for r in rows])
    assert [s.work_tokens for s in sizes] == [r.token_work for r in spent]
    for row, size in zip(rows, sizes):
        prepared = engine.prepare(synth_request(row))
        assert size == prepared_size(engine.requests, prepared)
        packed = [text + ref + 2 * target for text, ref, target in engine.requests.chunk_sizes(prepared)]
        assert size.packed_tokens == max(packed) and size.work_tokens == sum(packed)
    for row, size in zip(rows[:-1], sizes):  # the codec's frames of each clip, counted without it
        assert size.ref_frames == engine.prepare(synth_request(row)).prompt.tokens.shape[1]
    assert sizes[0].packed_tokens < sizes[1].packed_tokens
    assert len(engine.prepare(synth_request(rows[2])).chunks) > 1
    assert sizes[2].packed_tokens < sizes[2].work_tokens and sizes[1].work_tokens < sizes[2].work_tokens


def test_many_clips_are_prepared_in_worker_processes_alike(tmp_path, monkeypatch):
    """The worker processes give each clip the frames this process gives it; a clip that cannot be used
    comes back as its error (its rows are rejected, the others planned); clips a worker that died left
    unanswered are counted here."""
    import shutil
    from pathlib import Path

    from engine.errors import AudioError
    from pipeline import clip_pool, sizing

    data = Path(__file__).parent / "data"
    clips = []
    for i, source in enumerate(sorted(data.glob("en_*"))):
        clips.append(str(shutil.copy(source, tmp_path / f"{i}{source.suffix}")))
    (tmp_path / "broken.wav").write_bytes(b"RIFF....WAVE")  # not decodable
    clips.append(str(tmp_path / "broken.wav"))
    frontend = sizing.planning_frontend(_sizing_config(tmp_path / "prompts"))
    serial = sizing.clip_frames_all(frontend, clips, workers=1)
    monkeypatch.setattr(clip_pool, "POOL_MIN_CLIPS", 1)
    pooled = sizing.clip_frames_all(frontend, clips, workers=2)
    errors = serial.pop(clips[-1]), pooled.pop(clips[-1])
    assert all(isinstance(e, AudioError) for e in errors) and str(errors[0]) == str(errors[1])
    assert pooled == serial and all(isinstance(f, int) and f > 0 for f in serial.values())

    real_ask = clip_pool.ask_worker
    monkeypatch.setattr(clip_pool, "ask_worker", lambda spec, share: real_ask(spec, share)[:1])  # then died
    assert sizing.clip_frames_all(frontend, clips[:-1], workers=2) == serial


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="CPU priorities are POSIX's")
def test_clip_workers_run_below_the_planners_cpu_priority(tmp_path):
    """The engines load while the rows are sized: the clip workers yield the CPU to them."""
    import json
    import subprocess
    import sys

    from pipeline import clip_worker

    spec = json.dumps({"task": "probe", "clip_dir": None, "max_seconds": 30.0})
    worker = subprocess.Popen(
        [sys.executable, "-m", "pipeline.clip_worker", spec],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        worker.stdin.write(json.dumps(str(tmp_path / "missing.wav")) + "\n")
        worker.stdin.flush()
        assert "missing.wav" in worker.stdout.readline()  # answered: past its start
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) == min(19, mine + clip_worker.NICENESS)
    finally:
        worker.stdin.close()
        worker.wait(timeout=30)


@pytest.mark.parametrize("by_path", [True, False], ids=["checkpoint_by_path", "default_checkpoint"])
def test_planning_a_manifest_imports_no_torch(tmp_path, by_path):
    """A job's driver plans without torch (a Ray driver never needs it; the workers import it as they load):
    a fresh interpreter plans a manifest of the repo's clips against a checkpoint given by path, or the
    default tiny checkpoint once it is built."""
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from engine.tiny import ensure_tiny_checkpoint

    data = Path(__file__).parent / "data"
    clip = data / "en_24k_mono.wav"
    manifest = tmp_path / "m.parquet"
    pq.write_table(
        pa.table(
            {
                "id": ["a", "b"],
                "text": ["Hello there.", "Good day."],
                "ref_audio": [str(clip)] * 2,
                "ref_text": ["The quick brown fox jumps over the lazy dog."] * 2,
            }
        ),
        manifest,
    )
    tiny = ensure_tiny_checkpoint()  # built here: building it (not finding it) imports torch
    overrides = [f"engine.checkpoint={tiny}"] if by_path else []
    script = f"""
import sys
from pipeline.config import load_job_config
from pipeline.job import plan_job
from pipeline.sizing import frontend_sizer
cfg = load_job_config(None, {overrides!r}, {{"manifest": "{manifest}"}})
plan, rows = plan_job(cfg, frontend_sizer, clip_dir=None)
assert len(rows) == 2 and not plan.rejected, plan.rejected
print(sorted(m for m in ("torch", "engine.api", "engine.codec.model") if m in sys.modules))
"""
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
