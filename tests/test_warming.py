"""Warming the prompt cache while a job plans: Engine.warm makes the prompts its batches then find, the
shard runner warms in steps until capture() and never after, and the manifest gives the pairs to warm."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from engine.api import Engine, SynthRequest
from engine.config import EngineConfig, GenerationConfig
from pipeline import manifest as manifest_mod
from pipeline.config import load_job_config
from pipeline.shard_runner import WARM_STEP_CLIPS, ShardRunner

DATA = Path(__file__).parent / "data"
CLIPS = json.loads((DATA / "clips.json").read_text())
FAST = GenerationConfig(num_step=2, postprocess_output=False)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_warmed_prompts_are_what_the_batches_then_use(tmp_path, monkeypatch, device):
    names = sorted(n for n in CLIPS if n.endswith((".wav", ".flac")))
    pairs = [(str(DATA / n), CLIPS[n]["transcript"]) for n in names]
    reqs = [SynthRequest(text=f"Line {i}.", ref_audio=c, ref_text=t) for i, (c, t) in enumerate(pairs)]
    want = Engine(EngineConfig(device=device, prompt_cache_dir=None, generation=FAST)).prepare_many(reqs)

    engine = Engine(EngineConfig(device=device, prompt_cache_dir=str(tmp_path / "prompts"), generation=FAST))
    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF....WAVE")
    # a clip that cannot be read and one without a transcript are left to their rows
    engine.warm([(str(broken), "words"), *pairs, (str(DATA / names[0]), "")])
    encoded = []
    real = engine.codec.encode
    monkeypatch.setattr(
        engine.codec, "encode", lambda wavs, device=None: encoded.append(1) or real(wavs, device)
    )
    got = engine.prepare_many(reqs)
    assert not encoded
    for a, b in zip(got, want, strict=True):
        assert a.prompt.tokens.equal(b.prompt.tokens) and a.prompt.ref_rms == b.prompt.ref_rms


class WarmEngine:
    """Records its warm() steps; one step may be held open with `hold`."""

    def __init__(self, on_gpu: bool = True):
        self.device = SimpleNamespace(type="cuda" if on_gpu else "cpu")
        self.steps: list[list[tuple[str, str]]] = []
        self.ahead: list[list[tuple[str, str]]] = []  # each step's pairs to read beside it
        self.hold = threading.Event()
        self.hold.set()
        self.in_step = threading.Event()

    def warm(self, clips, ahead=()):
        self.ahead.append(ahead)
        self.in_step.set()
        assert self.hold.wait(10)
        self.steps.append(clips)


def _runner(tmp_path, engine) -> ShardRunner:
    runner = ShardRunner(tmp_path, load_job_config(None, ["local=true", "progress=false"]))
    runner.engines["default"] = engine
    return runner


def test_warming_runs_in_steps_until_capture_which_waits_for_the_step_in_flight(tmp_path):
    engine = WarmEngine()
    engine.hold.clear()
    runner = _runner(tmp_path, engine)
    clips = [(f"clip{i}.wav", f"words {i}") for i in range(3 * WARM_STEP_CLIPS)]
    runner.start_warming(clips)
    assert engine.in_step.wait(10)
    threading.Timer(0.2, engine.hold.set).start()  # capture() comes while the first step is in flight
    report = runner.capture([])
    assert engine.steps == [clips[:WARM_STEP_CLIPS]]  # that step finished, no other began
    assert report["warmed_clips"] == WARM_STEP_CLIPS and report["warm_seconds"] >= 0.2
    runner.start_warming(clips)  # never after capture
    assert runner.capture([])["warmed_clips"] == WARM_STEP_CLIPS and len(engine.steps) == 1
    runner.close()


def test_warming_stops_at_the_end_of_its_clips_and_never_on_a_cpu_engine(tmp_path):
    engine = WarmEngine()
    runner = _runner(tmp_path, engine)
    clips = [(f"clip{i}.wav", "words") for i in range(WARM_STEP_CLIPS + 3)]
    runner.start_warming(clips)
    deadline = time.monotonic() + 10
    while len(engine.steps) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    report = runner.capture([])
    assert engine.steps == [clips[:WARM_STEP_CLIPS], clips[WARM_STEP_CLIPS:]]
    assert engine.ahead == [clips[WARM_STEP_CLIPS:], []]  # each step reads the next one's clips
    assert report["warmed_clips"] == len(clips)
    on_cpu = WarmEngine(on_gpu=False)
    runner = _runner(tmp_path, on_cpu)
    runner.start_warming(clips)
    assert runner.capture([])["warmed_clips"] == 0 and not on_cpu.steps
    runner.close()


def test_the_manifests_pairs_come_once_each_longest_texts_first_then_shortest_first(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_mod, "LONGEST_TEXTS_FIRST", 1)
    table = pa.table(
        {
            "id": ["a", "b", "c", "d", "e", "f"],
            "text": ["a long text to speak here", "short", "a medium text", "tiny", "x", "no clip"],
            "ref_audio": ["one.wav", "two.wav", "one.wav", "s3://bucket/three.wav", "one.wav", None],
            "ref_text": ["words one", "words two", "words one", "words three", "  other words  ", None],
        }
    )
    pairs = manifest_mod.reference_pairs((str(tmp_path / "m.parquet"), table))
    assert manifest_mod.reference_pairs(("s3://bucket/m.parquet", table)) == []  # all resolve remote
    one, two = str(tmp_path / "one.wav"), str(tmp_path / "two.wav")
    # the longest text's pair first (one.wav's "words one"), then the rest from the shortest text up;
    # remote clips are copied into the job later, rows without a clip have nothing to warm
    assert pairs == [(one, "words one"), (one, "other words"), (two, "words two")]


def test_a_warm_call_reads_the_next_calls_clips_beside_its_encode(monkeypatch):
    import engine.api as api

    names = sorted(n for n in CLIPS if n.endswith((".wav", ".flac")))
    pairs = [(str(DATA / n), CLIPS[n]["transcript"]) for n in names]
    first, second = pairs[: len(pairs) // 2], pairs[len(pairs) // 2 :]
    engine = Engine(EngineConfig(prompt_cache_dir=None, generation=FAST))
    prepared = []
    real = api.prepare_reference
    monkeypatch.setattr(api, "prepare_reference", lambda *a, **k: prepared.append(a[0]) or real(*a, **k))
    engine.warm(first, ahead=second)
    assert sorted(prepared) == sorted(c for c, _ in pairs)  # its own clips and the next call's
    engine.warm(second)
    assert len(prepared) == len(pairs)  # read once, by the call before
    reqs = [SynthRequest(text="Hi.", ref_audio=c, ref_text=t) for c, t in pairs]
    assert all(p.prompt is not None for p in engine.prepare_many(reqs))
