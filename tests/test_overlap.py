"""The shard runner's writer stage: the engine generates the next batch while writer threads post-process
and write the last ones, at most 2 x writer_threads batches behind; nothing is lost or written twice."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from engine.api import SynthResult
from pipeline.config import load_job_config
from pipeline.manifest import ManifestRow
from pipeline.plan import PlannedRow
from pipeline.rows import RequestRow
from pipeline.shard_runner import ShardRunner, ShardTask


class Output:
    """What StagedEngine.generate returns: finish() waits for the gate, then makes the row's audio."""

    def __init__(self, engine: StagedEngine, text: str, seed: int):
        self.engine, self.text, self.seed = engine, text, seed
        self.token_work = 10 * len(text)

    def finish(self) -> SynthResult:
        assert StagedEngine.gate.wait(30), "the test never opened the gate"
        if "BADAUDIO" in self.text:
            raise ValueError(f"post-processing {self.text!r} failed")
        StagedEngine.finished.append(self.text)
        audio = np.full(800 + 8 * len(self.text), 0.01 * (self.seed % 50), np.float32)
        if "BADSHAPE" in self.text:  # an engine_factory's malformed output: no wav can hold it
            audio = audio.reshape(2, 2, -1)
        return SynthResult(
            audio, 8000, len(self.text), self.token_work, {"generate": 1.0, "postprocess": 0.1}
        )


class StagedEngine:
    sample_rate = 8000
    model_id = "staged@000000000000"
    precision = "fp32"
    device = None
    gate = threading.Event()
    batches: list[list[str]] = []
    finished: list[str] = []

    def __init__(self, cfg):
        self.cfg = cfg

    def generate(self, reqs):
        StagedEngine.batches.append([r.text for r in reqs])
        return [Output(self, r.text, r.seed) for r in reqs]


@pytest.fixture(autouse=True)
def reset():
    StagedEngine.gate, StagedEngine.batches, StagedEngine.finished = threading.Event(), [], []
    yield
    StagedEngine.gate.set()


def _cfg(writers: int, engine: str = "StagedEngine"):
    return load_job_config(
        None,
        [
            "local=true",
            f"engine_factory={__name__}:{engine}",
            "progress=false",
            "engine.buckets=[64,128]",
            "engine.max_batch_tokens=100",  # rows of 60 tokens: one row per batch
            f"writer_threads={writers}",
        ],
    )


def _rows(texts: list[str]) -> list[RequestRow]:
    rows = [ManifestRow(i, f"r{i:02d}", t, None, None, seed=i) for i, t in enumerate(texts)]
    return [RequestRow.of(r, PlannedRow(r.id, f"k{r.row_index}", 60, 10)) for r in rows]


def test_generation_runs_ahead_of_the_writers_by_a_bounded_number_of_batches(tmp_path: Path):
    runner = ShardRunner(tmp_path, _cfg(writers=1))
    rows = _rows([f"row number {i}" for i in range(8)])
    outcome: dict = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault("r", runner.run_shard(ShardTask(0, "default", 128, 1, rows)))
    )
    thread.start()
    thread.join(timeout=2.0)  # the gate is shut: the writer is stuck on the first batch
    assert thread.is_alive() and not StagedEngine.finished
    # 1 batch with the writer + 2 x writer_threads waiting; the engine waits before the next one
    assert len(StagedEngine.batches) == 3
    StagedEngine.gate.set()
    thread.join(timeout=30)
    results = outcome["r"]
    assert [r.id for r in results] == [r.id for r in rows]  # each row once, in batch order
    assert all(r.status == "ok" for r in results) and sorted(StagedEngine.finished) == sorted(
        r.text for r in rows
    )
    assert {p.stem for p in (tmp_path / "wavs" / "default").iterdir()} == {r.id for r in rows}


@pytest.mark.parametrize("writers", [1, 3])
def test_every_row_is_written_once_and_whole_whatever_the_writer_count(tmp_path: Path, writers: int):
    StagedEngine.gate.set()
    rows = _rows([f"text {i} " * (1 + i % 3) for i in range(9)])
    results = ShardRunner(tmp_path, _cfg(writers)).run_shard(ShardTask(0, "default", 128, 1, rows))
    assert [r.id for r in results] == [r.id for r in rows] and all(r.status == "ok" for r in results)
    for row, result in zip(rows, results):
        audio, rate = sf.read(tmp_path / result.wav_path, dtype="float32")
        assert rate == 8000 and len(audio) == 800 + 8 * len(row.text)
        assert result.postprocess_seconds == pytest.approx(0.1) and result.write_seconds > 0
    assert not list(tmp_path.rglob("*.ovtmp-*"))


class FlushingEngine(StagedEngine):
    flushed_after: list[int] = []  # rows finished when each flush came

    def flush(self):
        FlushingEngine.flushed_after.append(len(StagedEngine.finished))


def test_a_shard_returns_once_its_rows_are_written_and_its_prompts_flushed(tmp_path: Path):
    StagedEngine.gate.set()
    FlushingEngine.flushed_after = []
    rows = _rows([f"row {i}" for i in range(5)])
    runner = ShardRunner(tmp_path, _cfg(2, "FlushingEngine"))
    results = runner.run_shard(ShardTask(0, "default", 128, 1, rows))
    assert len(results) == 5 and FlushingEngine.flushed_after == [5]


@pytest.mark.parametrize(
    "text, error",
    [("BADAUDIO two", "post-processing 'BADAUDIO two' failed"), ("BADSHAPE two", "too many dimensions")],
)
def test_a_row_whose_post_processing_or_wav_fails_fails_alone(tmp_path: Path, text: str, error: str):
    """Its post-processing raised, or its audio is malformed (a ValueError from the wav writer: the row's
    fault, not the disk's): the row fails with the reason, the shard's other rows are written."""
    StagedEngine.gate.set()
    rows = _rows(["fine one", text, "fine three"])
    results = ShardRunner(tmp_path, _cfg(2)).run_shard(ShardTask(0, "default", 128, 1, rows))
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    assert error in results[1].error and results[1].wav_path is None
    assert not (tmp_path / "wavs" / "default" / "r01.wav").exists()
    assert (tmp_path / "wavs" / "default" / "r02.wav").is_file()


def test_a_write_that_fails_fails_the_shard_after_every_writer_stopped(tmp_path: Path, monkeypatch):
    from pipeline import shard_runner

    StagedEngine.gate.set()
    written = []

    def write(path, audio, rate):
        if path.stem == "r02":
            raise OSError(28, "No space left on device")
        written.append(path.stem)

    monkeypatch.setattr(shard_runner, "write_wav_atomic", write)
    runner = ShardRunner(tmp_path, _cfg(3))
    with pytest.raises(OSError, match="No space left"):
        runner.run_shard(ShardTask(0, "default", 128, 1, _rows([f"row {i}" for i in range(6)])))
    assert runner.writers._work_queue.empty()  # nothing left queued behind the error
    assert "r02" not in written


class CapturingEngine(StagedEngine):
    """StagedEngine that records the batch shapes it is asked to capture graphs for, and how many objects
    were frozen out of the garbage collector's walks as each batch ran."""

    shapes: list[list[tuple[int, int]]] = []
    frozen: list[int] = []
    load_timings = {"weights": 0.25, "codec": 0.125}  # as Engine reports its load

    def generate(self, reqs):
        CapturingEngine.frozen.append(gc.get_freeze_count())
        return super().generate(reqs)

    def capture(self, batches):
        CapturingEngine.shapes += batches
        return len({tuple(b) for b in batches})


def test_the_engines_capture_the_batches_of_the_run_before_its_first_shard(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.job import submit
    from pipeline.plan import RowSize

    StagedEngine.gate.set()
    CapturingEngine.shapes, CapturingEngine.frozen = [], []
    manifest = tmp_path / "m.parquet"
    texts = [f"row {i}" for i in range(5)]
    none = pa.array([None] * 5, pa.string())
    table = pa.table({"id": [f"r{i}" for i in range(5)], "text": texts, "ref_audio": none, "ref_text": none})
    pq.write_table(table, manifest)
    cfg = load_job_config(
        None,
        [
            f"manifest={manifest}",
            "local=true",
            f"engine_factory={__name__}:CapturingEngine",
            "progress=false",
            "engine.buckets=[64,128]",
            "engine.max_batch_tokens=100",
        ],
    )
    outcome = submit(cfg, tmp_path / "job", lambda cfg, rows: lambda row: RowSize(10, 10, 20))  # 60 tokens
    # one row a batch, as run_shard packs them: (packed tokens, target frames) each
    assert CapturingEngine.shapes == [[(60, 20)]] * 5
    assert sorted(StagedEngine.batches) == [[t] for t in texts]
    (run,) = outcome.summary["runs"]
    assert run["graphs"] == 1 and run["capture_seconds"] >= 0 and run["ready_seconds"] > 0
    assert 0 <= run["load_seconds"] <= run["ready_seconds"]  # the engines loaded before the run was ready
    assert run["load_breakdown"] == CapturingEngine.load_timings  # where the load's seconds went
    assert "capture" in outcome.summary["time"]
    # after capture the worker's objects are out of the collector's full walks; after the job, back in
    assert len(CapturingEngine.frozen) == 5 and min(CapturingEngine.frozen) > 0
    assert gc.get_freeze_count() == 0


class PreloadingEngine(StagedEngine):
    """StagedEngine that records when each batch's clips were preloaded and when it was generated."""

    events: list[tuple[str, tuple[str, ...]]] = []

    def preload(self, reqs):
        time.sleep(0.05)
        PreloadingEngine.events.append(("preloaded", tuple(r.text for r in reqs)))

    def generate(self, reqs):
        PreloadingEngine.events.append(("generate", tuple(r.text for r in reqs)))
        return super().generate(reqs)


ROW_TEXTS = [f"row {i}" for i in range(4)]


def _run_one_row_batches(tmp_path: Path, engine_class: type) -> list[RequestRow]:
    """One shard of four rows, one row a batch, on `engine_class` (its `events` emptied first)."""
    StagedEngine.gate.set()
    engine_class.events = []
    cfg = _cfg(writers=1)
    cfg.engine_factory = f"{__name__}:{engine_class.__name__}"
    rows = _rows(ROW_TEXTS)
    ShardRunner(tmp_path, cfg).run_shard(ShardTask(0, "default", 128, 1, rows))
    return rows


def test_each_batch_is_preloaded_once_before_it_generates(tmp_path: Path):
    rows = _run_one_row_batches(tmp_path, PreloadingEngine)
    preloaded = [batch for kind, batch in PreloadingEngine.events if kind == "preloaded"]
    generated = [batch for kind, batch in PreloadingEngine.events if kind == "generate"]
    assert preloaded == generated == [(r.text,) for r in rows]
    for batch in generated:
        assert PreloadingEngine.events.index(("preloaded", batch)) < PreloadingEngine.events.index(
            ("generate", batch)
        )


def test_the_next_shard_generates_while_the_one_before_waits_for_its_writes(tmp_path: Path):
    from pipeline.shard_runner import run_local

    runner = ShardRunner(tmp_path, _cfg(writers=1))
    rows = _rows(["first shard", "second shard"])
    tasks = [ShardTask(0, "default", 128, 1, rows[:1]), ShardTask(1, "default", 128, 1, rows[1:])]
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("r", list(run_local(runner, tasks))))
    thread.start()
    deadline = time.monotonic() + 10
    while len(StagedEngine.batches) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # the gate is shut: neither shard's write is done, and both generated (one on the device at a time,
    # whichever of the two threads came first)
    assert sorted(StagedEngine.batches) == [["first shard"], ["second shard"]] and not StagedEngine.finished
    StagedEngine.gate.set()
    thread.join(timeout=30)
    assert sorted((task.index, [r.id for r in results]) for task, results in outcome["r"]) == [
        (0, ["r00"]),
        (1, ["r01"]),
    ]


def test_a_local_run_that_stops_early_starts_no_further_shard(tmp_path: Path):
    from pipeline.shard_runner import SHARDS_IN_FLIGHT, run_local

    StagedEngine.gate.set()
    runner = ShardRunner(tmp_path, _cfg(writers=1))
    last = SHARDS_IN_FLIGHT  # the first shard past those started at once
    rows = _rows([f"row {i}" for i in range(last + 1)])
    run = run_local(runner, [ShardTask(i, "default", 128, 1, [row]) for i, row in enumerate(rows)])
    task, results = next(run)  # the first shard to finish
    run.close()  # e.g. Ctrl-C in the driver
    assert task.index < last and [r.id for r in results] == [f"r{task.index:02d}"]
    assert [f"row {last}"] not in StagedEngine.batches  # it never started
    assert not runner.stopping.is_set()  # the runner can run again


class AheadEngine(StagedEngine):
    """Records prepare_ahead and generate. A batch's generate checks that it gets the very objects prepared
    ahead, and waits (10 s at most) for the next batch to be prepared before it runs its `then`: a batch whose
    preparation waited for the generate call before it would show as a wait that ran out."""

    events: list[tuple[str, str]] = []

    def __init__(self, cfg):
        super().__init__(cfg)
        self.prepared = {}  # first row's text -> the requests prepared

    def prepare_ahead(self, reqs):
        self.prepared[reqs[0].text] = reqs
        AheadEngine.events.append(("ahead", reqs[0].text))

    def generate(self, reqs, then=None):
        text = reqs[0].text
        if text in self.prepared:
            assert all(a is b for a, b in zip(self.prepared[text], reqs, strict=True)), "not the same objects"
        AheadEngine.events.append(("generate", text))
        following = f"row {int(text.split()[1]) + 1}"
        deadline = time.monotonic() + 10
        while following in ROW_TEXTS and ("ahead", following) not in AheadEngine.events:
            if time.monotonic() > deadline:
                AheadEngine.events.append(("waited out", following))
                break
            time.sleep(0.01)
        outputs = super().generate(reqs)
        if then is not None:
            then()
        return outputs


def test_each_batch_is_prepared_two_ahead_without_waiting_for_the_one_before(tmp_path: Path):
    """Batch i + 2 is prepared once batch i is set up (its `then`), on the preparing thread: its preparation
    runs beside batches i and i + 1 and needs neither generate call to return."""
    from pipeline.shard_runner import PREPARE_AHEAD

    assert PREPARE_AHEAD == 2
    _run_one_row_batches(tmp_path, AheadEngine)
    events = AheadEngine.events
    assert not [e for e in events if e[0] == "waited out"], events
    assert [text for kind, text in events if kind == "generate"] == ROW_TEXTS
    assert (
        sorted(text for kind, text in events if kind == "ahead") == ROW_TEXTS[1:]
    )  # no shard before the first
    for i, text in enumerate(ROW_TEXTS[1:], start=1):
        assert events.index(("ahead", text)) < events.index(("generate", text))
        if i >= PREPARE_AHEAD:
            assert events.index(("ahead", text)) > events.index(("generate", ROW_TEXTS[i - PREPARE_AHEAD]))


class OverlapEngine(StagedEngine):
    """Batch 1's preparation waits (10 s at most) until batch 2's has started: it can only start beside it."""

    events: list[tuple[str, str]] = []

    def prepare_ahead(self, reqs):
        text = reqs[0].text
        OverlapEngine.events.append(("ahead", text))
        deadline = time.monotonic() + 10
        while text == "row 1" and ("ahead", "row 2") not in OverlapEngine.events:
            if time.monotonic() > deadline:
                OverlapEngine.events.append(("waited out", text))
                break
            time.sleep(0.01)

    def generate(self, reqs, then=None):
        outputs = super().generate(reqs)
        if then is not None:
            then()
        return outputs


def test_two_batches_are_prepared_at_once(tmp_path: Path):
    """A preparation that outlasts a batch does not hold back the next one (PREPARE_THREADS)."""
    from pipeline.shard_runner import PREPARE_THREADS

    assert PREPARE_THREADS == 2
    _run_one_row_batches(tmp_path, OverlapEngine)
    assert ("waited out", "row 1") not in OverlapEngine.events
    assert sorted(text for kind, text in OverlapEngine.events if kind == "ahead") == ROW_TEXTS[1:]


class HandOffEngine(StagedEngine):
    """Records prepare_ahead and generate; each batch but the last to generate runs its `then` only once
    another shard is in line for the device (so that the test does not depend on the threads' timing)."""

    runner: ShardRunner | None = None
    shards = 0
    events: list[tuple[str, str]] = []

    def prepare_ahead(self, reqs):
        HandOffEngine.events.append(("ahead", reqs[0].text))

    def generate(self, reqs, then=None):
        HandOffEngine.events.append(("generate", reqs[0].text))
        outputs = super().generate(reqs)
        if len(StagedEngine.batches) < HandOffEngine.shards:
            deadline = time.monotonic() + 10
            while not HandOffEngine.runner.turns.waiting() and time.monotonic() < deadline:
                time.sleep(0.01)
        if then is not None:
            then()
        return outputs


def test_shards_take_the_device_in_line_each_first_batch_prepared_by_the_shard_before(tmp_path: Path):
    """Each shard's last batch prepares (its `then`) the first batch of the shard next in line, and that
    shard takes the device next: with SHARDS_IN_FLIGHT shards at once, two or more wait for it, and a
    plain lock could hand it to another one."""
    from pipeline.shard_runner import run_local

    StagedEngine.gate.set()
    HandOffEngine.events, HandOffEngine.shards = [], 6
    cfg = _cfg(writers=1)
    cfg.engine_factory = f"{__name__}:HandOffEngine"
    runner = HandOffEngine.runner = ShardRunner(tmp_path, cfg)
    rows = _rows([f"shard {i}" for i in range(HandOffEngine.shards)])
    tasks = [ShardTask(i, "default", 128, 1, [row]) for i, row in enumerate(rows)]
    results = list(run_local(runner, tasks))
    statuses = sorted((task.index, [r.status for r in rs]) for task, rs in results)
    assert statuses == [(i, ["ok"]) for i in range(6)]
    order = [text for kind, text in HandOffEngine.events if kind == "generate"]
    assert sorted(order) == [f"shard {i}" for i in range(6)]
    want = [("generate", order[0])]
    for text in order[1:]:
        want += [("ahead", text), ("generate", text)]
    assert HandOffEngine.events == want
    assert not runner.turns.waiting()


class FirstBatchesEngine(StagedEngine):
    """Two shards of two one-row batches ("a batch 0", ...). The shard that takes the device first waits at
    each batch for the other to be in line, and its last batch returns only once the other shard's second
    batch is prepared (10 s at most): only the shard on the device can have queued that."""

    runner: ShardRunner | None = None
    events: list[tuple[str, str]] = []

    def prepare_ahead(self, reqs):
        FirstBatchesEngine.events.append(("ahead", reqs[0].text))

    def generate(self, reqs, then=None):
        events = FirstBatchesEngine.events
        text = reqs[0].text
        events.append(("generate", text))
        outputs = super().generate(reqs)
        first_shard = next(t for kind, t in events if kind == "generate")[0]
        deadline = time.monotonic() + 10
        if text[0] == first_shard:
            while not FirstBatchesEngine.runner.turns.waiting() and time.monotonic() < deadline:
                time.sleep(0.01)
        if then is not None:
            then()
        other = "b" if first_shard == "a" else "a"
        if text == f"{first_shard} batch 1":
            while ("ahead", f"{other} batch 1") not in events:
                if time.monotonic() > deadline:
                    events.append(("waited out", text))
                    break
                time.sleep(0.01)
        return outputs


def test_the_shard_on_the_device_prepares_the_first_two_batches_of_the_next(tmp_path: Path):
    from pipeline.shard_runner import run_local

    StagedEngine.gate.set()
    FirstBatchesEngine.events = []
    cfg = _cfg(writers=1)
    cfg.engine_factory = f"{__name__}:FirstBatchesEngine"
    runner = FirstBatchesEngine.runner = ShardRunner(tmp_path, cfg)
    rows = _rows([f"{name} batch {b}" for name in "ab" for b in range(2)])
    tasks = [ShardTask(i, "default", 128, 1, rows[2 * i : 2 * i + 2]) for i in range(2)]
    results = list(run_local(runner, tasks))
    assert sorted(r.status for _, rs in results for r in rs) == ["ok"] * 4
    events = FirstBatchesEngine.events
    assert not [e for e in events if e[0] == "waited out"], events
    generated = [text for kind, text in events if kind == "generate"]
    # every batch prepared ahead once, but the first shard's first (no shard before it)
    assert sorted(text for kind, text in events if kind == "ahead") == sorted(generated[1:])
    for text in generated[1:]:
        assert events.index(("ahead", text)) < events.index(("generate", text))


class SetUpEngine(AheadEngine):
    """AheadEngine whose batches take 0.1 s to set up before their `then`, as the device waits for them."""

    def generate(self, reqs, then=None):
        outputs = StagedEngine.generate(self, reqs)
        time.sleep(0.1)
        SetUpEngine.events.append(("set up", reqs[0].text))
        if then is not None:
            then()
        return outputs


def test_a_batch_goes_to_the_writers_once_the_batch_after_it_is_set_up(tmp_path: Path, monkeypatch):
    """The writers' post-processing never shares the interpreter with the next batch's set-up (the host
    work the device waits for): a batch's writes start in the next batch's `then`, the last batch's once
    its call is done."""
    settle = ShardRunner._settle

    def recorded(self, engine, task, part):
        SetUpEngine.events.append(("write", part.rows[0].text))
        return settle(self, engine, task, part)

    monkeypatch.setattr(ShardRunner, "_settle", recorded)
    rows = _run_one_row_batches(tmp_path, SetUpEngine)
    texts = [r.text for r in rows]
    events = [e for e in SetUpEngine.events if e[0] in ("set up", "write")]
    assert sorted(text for kind, text in events if kind == "write") == sorted(texts)  # each batch once
    for before, after in zip(texts, texts[1:]):
        assert events.index(("write", before)) > events.index(("set up", after))
    assert {p.stem for p in (tmp_path / "wavs" / "default").iterdir()} == {r.id for r in rows}


class FailingSetUpEngine(SetUpEngine):
    def generate(self, reqs, then=None):
        if "FAIL" in reqs[0].text:
            raise RuntimeError("set-up failed")
        return super().generate(reqs, then)


def test_the_batch_before_one_that_fails_before_its_then_is_still_written(tmp_path: Path):
    StagedEngine.gate.set()
    FailingSetUpEngine.events = []
    cfg = _cfg(writers=1)
    cfg.engine_factory = f"{__name__}:FailingSetUpEngine"
    rows = _rows(["row 0", "FAIL 1", "row 2"])
    results = ShardRunner(tmp_path, cfg).run_shard(ShardTask(0, "default", 128, 1, rows))
    assert [(r.id, r.status) for r in results] == [("r00", "ok"), ("r01", "failed"), ("r02", "ok")]
    assert {p.stem for p in (tmp_path / "wavs" / "default").iterdir()} == {"r00", "r02"}


def test_a_shards_last_batch_goes_to_the_writers_once_the_next_shards_first_is_set_up(
    tmp_path: Path, monkeypatch
):
    from pipeline import shard_runner
    from pipeline.shard_runner import run_local

    settle = ShardRunner._settle

    def recorded(self, engine, task, part):
        SetUpEngine.events.append(("write", part.rows[0].text))
        return settle(self, engine, task, part)

    monkeypatch.setattr(ShardRunner, "_settle", recorded)
    monkeypatch.setattr(shard_runner, "NEXT_SET_UP_WAIT_S", 30.0)  # a wait that ran out would show
    StagedEngine.gate.set()
    SetUpEngine.events = []
    cfg = _cfg(writers=1)
    cfg.engine_factory = f"{__name__}:SetUpEngine"
    rows = _rows(["shard zero", "shard one"])
    tasks = [ShardTask(i, "default", 128, 1, [row]) for i, row in enumerate(rows)]
    start = time.monotonic()
    results = list(run_local(ShardRunner(tmp_path, cfg), tasks))
    assert time.monotonic() - start < 10  # neither shard's writes waited the 30 s out
    assert sorted((t.index, [r.status for r in rs]) for t, rs in results) == [(0, ["ok"]), (1, ["ok"])]
    events = [e for e in SetUpEngine.events if e[0] in ("set up", "write")]
    first, second = [text for kind, text in events if kind == "set up"]
    assert events.index(("write", first)) > events.index(("set up", second))


def test_a_shards_batches_hold_at_most_the_engines_token_budget():
    """max_batch_tokens above the largest bucket: batches stay within the bucket (the token budget), where
    the engine's graphs are, instead of running larger ones eagerly."""
    from engine.config import EngineConfig
    from pipeline.shard_runner import pack_batches

    cfg = EngineConfig(buckets=(512, 1024), max_batch_tokens=8192)
    rows = [RequestRow(i, f"r{i}", "Hi.", None, None, packed_tokens=300 + 7 * i) for i in range(12)]
    batches = pack_batches(rows, cfg)
    assert sorted(r.id for b in batches for r in b) == sorted(r.id for r in rows)
    assert max(sum(r.packed_tokens for r in b) for b in batches) <= cfg.token_budget == 1024
