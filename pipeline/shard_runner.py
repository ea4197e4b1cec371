"""Run shards: pack a shard's rows into batches, synthesize, write wavs atomically, return per-row results.

The same ShardRunner serves local mode (in this process) and each Ray actor (pipeline.ray_runner). The
engine's device waits for as little host work as it can: a preload thread prepares the reference clips of the
batches to come (Engine.preload), preparing threads prepare each batch (Engine.prepare_ahead: its clips
encoded, its first runner calls packed) PREPARE_AHEAD batches before it generates, from the `then` of the
batch that many before (generate's hook, run once a batch is set up), and writer threads post-process and
write the batches before it (each Engine.generate output's finish()), each batch from its successor's `then`
on (a shard's last batch: the next shard's first), so that no writer competes for the interpreter with the
set-up of a batch that the device waits for. A worker holds SHARDS_IN_FLIGHT shards at once, one generating at
a time, the others taking the device in the order they asked for it (pipeline.device_turns): the next shard's
first two batches are prepared from the last batches of the one before (their clips on the preload thread
before that), so that only the shard holding the device puts work on it, and it generates while the one before
waits for its last writes.
A batch that raises is split in halves and each half retried, down to single rows, so one bad row
fails alone and a CUDA out-of-memory error retries smaller batches. A row's synth_seconds is its share
of its batch's wall time in proportion to its token work (packed tokens x decoding steps). Each batch that
settles its rows (ok, failed or rejected) is reported to an optional callback, so progress moves per batch.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.errors import ClipReadError, InputError, OVBatchError
from engine.generate.batching import bucket_batches
from pipeline.atomic import write_wav_atomic
from pipeline.config import JobConfig
from pipeline.device_turns import DeviceTurns
from pipeline.manifest import ManifestRow
from pipeline.rows import RequestRow, ResultRow
from pipeline.store import JobDir
from pipeline.tokens import write_tokens

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 2000
# Shards a worker runs at once: one generating, the next in line waiting for the device, and one more, so
# that the shard after the next is in line before the next one's last batch (which prepares its first batch)
# even while the one before still writes its rows.
SHARDS_IN_FLIGHT = 3
# How long a shard's last batch waits for the next shard's first batch to be set up before going to the
# writers anyway: a bound, far above a set-up prepared ahead, which only a shard in line that fails before its
# set-up reaches.
NEXT_SET_UP_WAIT_S = 1.0
# How many batches ahead of the one generating a batch is prepared: its reference clips are encoded on the
# device beside the generation, and a preparation that outlasts one batch (the short rows' batches bring the
# most clips per second of speech) has the next batch's generation too. Two instead of one: the FP8 Ray job
# 111.5x -> 118.3x, the generation stream still idle 21.9 s of its ~141 s (e2e-h200.json, 89b05c7).
PREPARE_AHEAD = 2
# Batches prepared at once: two, so that the preparations of the two batches ahead overlap (each encodes its
# clips on its own CUDA stream) where one takes longer than a batch generates (not yet measured on a GPU).
PREPARE_THREADS = 2
ENGINE_PHASES = ("prepare", "generate", "decode")  # an Engine.generate batch's timed phases
# Clips a warming step makes voice prompts for (start_warming): capture() waits for the step in flight.
WARM_STEP_CLIPS = 32


class Stopped(Exception):
    """A shard stopped between batches because its run ended (ShardRunner.stopping)."""


@dataclass(frozen=True)
class BatchDone:
    """Rows of one attempt at shard `shard` that one batch settled, and the seconds of audio it made."""

    shard: int
    attempt: int
    rows: int
    audio_seconds: float


BatchCallback = Callable[[BatchDone], None]


@dataclass
class ShardTask:
    index: int
    variant: str
    bucket: int
    attempt: int  # counts every run of the shard, reruns included (the results' attempt column)
    rows: list[RequestRow]
    deaths: int = 0  # of the workers that ran it in this run (ray.max_shard_attempts bounds this run's tries)


def load_factory(spec: str) -> Callable[..., Any]:
    """'module:callable' -> the callable (the engine class, or a wrapper of it)."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise OVBatchError(
            f"engine_factory {spec!r} cannot be loaded ({e}): write it as 'module:callable' "
            "importable on every worker."
        ) from None


def is_out_of_memory(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _release_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _traced(name: str):
    """A torch.profiler range named `name` (bench/profile_job.py reads them) once torch is imported (the
    engine imports it), else nothing."""
    torch = sys.modules.get("torch")
    return torch.profiler.record_function(name) if torch is not None else nullcontext()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]


def synth_request(row: ManifestRow) -> Any:
    """The engine request of a manifest row (planned or not)."""
    from engine.frontend.requests import SynthRequest  # not engine.api: the planner runs without torch

    return SynthRequest(
        text=row.text,
        ref_audio=row.ref_audio,
        ref_text=row.ref_text,
        language=row.language,
        instruct=row.instruct,
        duration=row.duration,
        speed=row.speed,
        seed=row.seed,
    )


def pack_batches(rows: list[RequestRow], engine_cfg: EngineConfig) -> list[list[RequestRow]]:
    """A shard's rows in batches within the engine's token budget that fill its graph buckets
    (bucket_batches), each longest row first."""
    longest_first = sorted(rows, key=lambda r: -r.packed_tokens)
    return bucket_batches(
        longest_first, lambda r: r.packed_tokens, engine_cfg.token_budget, engine_cfg.buckets
    )


@dataclass
class _FirstBatches:
    """What a shard in line for the device gives the shard on it to prepare: its engine, the requests of its
    first PREPARE_AHEAD batches and their preloads; and the futures of the preparations queued for them
    (batch index -> future), which the shard reads once it holds the device."""

    engine: Any
    requests: list[list[Any]]
    preloads: list[Future]
    prepared: dict[int, Future] = field(default_factory=dict)


@dataclass
class _Part:
    """Rows one engine call settled: its outputs (to finish and write), or results made already."""

    rows: list[RequestRow]
    outputs: list[Any] = field(default_factory=list)  # one per row: Generated (to finish) or SynthResult
    wall: float = 0.0
    started: str = ""
    finished: str = ""
    settled: list[ResultRow] | None = None


def _engine_outputs(engine: Any, reqs: list[Any], then: Callable[[], None] | None = None) -> list[Any]:
    """engine.generate where the engine has it (outputs whose finish() post-processes them, run on a writer
    thread), else engine.synthesize (an engine_factory's engine may offer only that). then: only for
    engines with prepare_ahead (ShardRunner._prepares), whose generate takes it."""
    generate = getattr(engine, "generate", None)
    if generate is None:
        return engine.synthesize(reqs)
    return generate(reqs, then=then) if then is not None else generate(reqs)


class ShardRunner:
    """Holds one engine per variant (loaded on first use) and runs shards with it.

    The engine generates batch after batch on the calling thread; meanwhile the preload and preparing threads
    prepare the batches to come, and writer threads post-process and write the rows of the batches before, at
    most 2 x writer_threads batches behind. A batch is reported (on_batch) once its rows are written and the
    engine has finished the batch after it; a shard returns once every one of its rows is written (or settled
    as failed or rejected). run_shard may be called from several threads (SHARDS_IN_FLIGHT): one shard at a
    time generates; the others wait for the device in line, or for their writes."""

    def __init__(self, job_path: str | Path, cfg: JobConfig, prepare_threads: int = PREPARE_THREADS):
        self.job = JobDir(job_path)
        self.cfg = cfg
        start = time.perf_counter()
        self.factory = load_factory(cfg.engine_factory)
        self.import_seconds = time.perf_counter() - start  # the engine's modules (torch, transformers, ...)
        self.engines: dict[str, Any] = {}  # variant -> its engine
        self.load_seconds = 0.0  # spent in load_engines
        self.load_breakdown: dict[str, float] = {}  # the engines' load_timings, summed by phase
        self.host = socket.gethostname()
        self.worker = f"{self.host}:{os.getpid()}"
        self.writers = ThreadPoolExecutor(cfg.writer_threads, thread_name_prefix="ovbatch-writer")
        self.preloader = ThreadPoolExecutor(1, thread_name_prefix="ovbatch-preload")
        self.preparer = ThreadPoolExecutor(prepare_threads, thread_name_prefix="ovbatch-prepare")
        # the device's turns; a shard in line gives its _FirstBatches to the shard on the device to prepare
        self.turns = DeviceTurns()
        self.stopping = threading.Event()  # set: running shards stop before their next batch
        # batches set up on this worker so far (their `then` began), for a shard's last batch to wait on
        self._set_ups = 0
        self._set_up = threading.Condition()
        self._warmer = ThreadPoolExecutor(1, thread_name_prefix="ovbatch-warm")
        self._warming: Future | None = None
        self._warm_lock = threading.Lock()
        self._warm_stop = threading.Event()  # set by capture(): no warming from then on

    def engine(self, variant: str) -> Any:
        if variant not in self.engines:
            engine = self.engines[variant] = self.factory(self.cfg.engine_config(variant))
            for phase, seconds in getattr(engine, "load_timings", {}).items():  # a factory's may have none
                self.load_breakdown[phase] = self.load_breakdown.get(phase, 0.0) + seconds
        return self.engines[variant]

    def load_engines(self, variants: list[str]) -> None:
        """Load the variants' engines now (before the first shard comes)."""
        start = time.perf_counter()
        for variant in variants:
            self.engine(variant)
        self.load_seconds += time.perf_counter() - start

    def start_warming(self, clips: list[tuple[str, str]]) -> None:
        """Make the voice prompts of these (reference clip, transcript) pairs on a thread of this runner,
        WARM_STEP_CLIPS at a time, with the first engine loaded (Engine.warm), until capture(): the job
        does this while it plans, its GPU otherwise idle, so that its batches find their clips encoded.
        Only for an engine on a GPU that has warm() (on a CPU, a step's ~200 s of audio at the full-size
        codec's ~7x realtime would hold capture() for half a minute), once, never once capture() began."""
        engine = next(iter(self.engines.values()), None)
        if engine is None or getattr(engine, "warm", None) is None or not _on_gpu(engine):
            return
        with self._warm_lock:
            if self._warming is None and not self._warm_stop.is_set():
                self._warming = self._warmer.submit(self._warm, engine, clips)

    def _warm(self, engine: Any, clips: list[tuple[str, str]]) -> dict[str, Any]:
        start, done = time.perf_counter(), 0
        while done < len(clips) and not self._warm_stop.is_set():
            step = clips[done : done + WARM_STEP_CLIPS]
            ahead = clips[done + WARM_STEP_CLIPS : done + 2 * WARM_STEP_CLIPS]  # read beside this encode
            try:
                with _traced("ovbatch.warm"):
                    engine.warm(step, ahead)
            except Exception as e:  # noqa: BLE001 - the batches make what warming could not
                log.warning("warming the prompt cache stopped after %d clips: %s", done, _error_text(e))
                break
            done += len(step)
        _release_cuda_cache()  # the encode's blocks belong to this thread's stream, which encodes no more
        return {"warmed_clips": done, "warm_seconds": round(time.perf_counter() - start, 3)}

    def _stop_warming(self) -> dict[str, Any]:
        """Stop warming and wait for its step in flight: what it did (nothing where it never started)."""
        with self._warm_lock:
            self._warm_stop.set()
            warming = self._warming
        return warming.result() if warming is not None else {"warmed_clips": 0, "warm_seconds": 0.0}

    def capture(self, tasks: list[ShardTask]) -> dict[str, Any]:
        """Stop warming (a graph capture admits no other device work), then have each variant's engine
        capture the CUDA graphs the tasks' batches will replay (engines without capture() skip it), then
        freeze what the process holds out of the garbage collector's full collections (until close()):
        graphs captured, seconds spent, the seconds the engine's imports and load_engines took, the
        engines' load seconds by phase (load_breakdown), and the clips warmed before it (and seconds)."""
        warmed = self._stop_warming()
        start = time.perf_counter()
        graphs = 0
        for variant in sorted({t.variant for t in tasks}):
            capture = getattr(self.engine(variant), "capture", None)
            if capture is None:
                continue
            engine_cfg = self.cfg.engine_config(variant)
            shapes = [
                [(r.packed_tokens, r.target_frames) for r in batch]
                for task in tasks
                if task.variant == variant
                for batch in pack_batches(task.rows, engine_cfg)
            ]
            graphs += capture(shapes)
        # The imports, engines and graphs live as long as the worker: frozen, a full collection (which holds
        # every thread, the device's feeders too) walks only what the shards make. Garbage goes first.
        gc.collect()
        gc.freeze()
        return {
            "graphs": graphs,
            "capture_seconds": round(time.perf_counter() - start, 3),
            "import_seconds": round(self.import_seconds, 3),
            "load_seconds": round(self.load_seconds, 3),
            "load_breakdown": {phase: round(t, 3) for phase, t in self.load_breakdown.items()},
            **warmed,
        }

    def close(self) -> None:
        """Give what capture froze back to the garbage collector: the process may go on without this runner
        (another job, a test), and the runner's objects must be collectable then."""
        self._stop_warming()
        gc.unfreeze()

    def run_shard(self, task: ShardTask, on_batch: BatchCallback | None = None) -> list[ResultRow]:
        self._stop_warming()  # where no capture() came first
        engine = self.engine(task.variant)
        results: list[ResultRow] = []
        pending: deque[Future] = deque()  # writer jobs, oldest first

        def take_oldest() -> None:  # reported here, on the thread that called run_shard
            results.extend(_reported(pending.popleft().result(), task, on_batch))

        # A batch's outputs go to the writers once the batch after it is set up (that batch's `then`, or the
        # next shard's first batch's for the last one): the host's set-up of a batch, while the device waits
        # for it, then shares the interpreter with no writer.
        unwritten: list[_Part] = []

        def write_unwritten() -> None:  # also on the `then` thread, while this one waits in generate()
            for part in unwritten:
                pending.append(self.writers.submit(self._settle, engine, task, part))
            unwritten.clear()

        def set_up() -> None:  # the engine's `then` begins: the batch is set up
            write_unwritten()
            self._note_set_up()

        batches = pack_batches(task.rows, self.cfg.engine_config(task.variant))
        requests = {id(r): synth_request(r) for r in task.rows}  # one object per row: prepare_ahead's key

        def requests_of(rows: list[RequestRow]) -> list[Any]:
            return [requests[id(r)] for r in rows]

        preloads: dict[int, Future] = {}  # batch index -> its clips' preload
        prepared: dict[int, Future] = {}  # batch index -> its preparation ahead

        def preload(i: int) -> None:
            if i < len(batches) and i not in preloads:
                preloads[i] = self._preload(engine, requests_of(batches[i]))

        def prepare(i: int) -> None:  # batch i ahead, once (where the shard before did not)
            if self._prepares(engine) and i < len(batches) and i not in prepared:
                reqs = requests_of(batches[i])
                prepared[i] = self.preparer.submit(self._prepare, engine, reqs, preloads[i])

        next_shard: list[_FirstBatches] = []  # the shard in line whose first batches this one prepares

        def then_of(i: int) -> Callable[[], None] | None:  # batch i's `then`: set up, so prepare ahead
            if not self._prepares(engine):
                return None

            def then() -> None:
                set_up()
                prepare(i + PREPARE_AHEAD)
                if i + PREPARE_AHEAD >= len(batches):  # past this shard: the next one's first batches
                    self._prepare_next_shards(next_shard, upto=i + PREPARE_AHEAD - len(batches))

            return then

        # The first batches' clips now, while the shard before generates; the batches themselves are prepared
        # by that shard, so that device work stays within the device holder's turn.
        heads = range(min(PREPARE_AHEAD, len(batches)))
        for j in heads:
            preload(j)
        first = _FirstBatches(engine, [requests_of(batches[j]) for j in heads], [preloads[j] for j in heads])
        turn = object()
        self.turns.ask(turn, first)
        try:
            with _traced("ovbatch.wait_device"):
                self.turns.take(turn)
            prepared.update(first.prepared)
            try:
                with _traced("ovbatch.shard_on_device"):
                    for i, batch in enumerate(batches):
                        if self.stopping.is_set():
                            raise Stopped(f"shard {task.index} stopped before batch {i + 1}")
                        for ahead in range(1, PREPARE_AHEAD + 1):  # the clips of the batches to come
                            preload(i + ahead)
                        for ahead in range(1, PREPARE_AHEAD):  # where no `then` has (the first batches)
                            prepare(i + ahead)
                        with _traced("ovbatch.wait_prepared"):  # this batch's clips and preparation
                            wait([preloads[i], *([prepared[i]] if i in prepared else [])])
                        parts = self._generate(engine, task, batch, requests_of, then_of(i))
                        write_unwritten()  # where the batch never got to its `then` (an error, a split)
                        unwritten.extend(parts)
                        if not self._prepares(engine):  # no `then`: no set-up to keep clear
                            write_unwritten()
                        while pending and pending[0].done():
                            take_oldest()
                        with _traced("ovbatch.wait_writers"):
                            while len(pending) > 2 * self.cfg.writer_threads:
                                take_oldest()
            except BaseException:
                write_unwritten()  # the rows that were finished
                self.turns.give_back()
                raise
            seen = self._set_ups_so_far()
            self.turns.give_back()
            if unwritten:  # the last batch's, once the next shard's first batch is set up
                with _traced("ovbatch.wait_next_set_up"):
                    self._wait_next_set_up(seen)
                write_unwritten()
            while pending:  # the next shard generates meanwhile
                take_oldest()
        finally:
            self.turns.leave(turn)
            # no writer or preparation outlives its shard, even one that stopped on an error
            wait([*pending, *preloads.values(), *prepared.values()])
            flush = getattr(engine, "flush", None)  # its prompts on disk, for a rerun or another worker
            if flush is not None:
                flush()
        return results

    def _note_set_up(self) -> None:
        with self._set_up:
            self._set_ups += 1
            self._set_up.notify_all()

    def _set_ups_so_far(self) -> int:
        with self._set_up:
            return self._set_ups

    def _wait_next_set_up(self, seen: int) -> None:
        """Until a batch is set up after the first `seen`, where a shard holds the device or waits for it
        (NEXT_SET_UP_WAIT_S at most)."""
        with self._set_up:
            self._set_up.wait_for(lambda: self._set_ups > seen or not self.turns.busy(), NEXT_SET_UP_WAIT_S)

    def _preload(self, engine: Any, reqs: list[Any]) -> Future:
        """engine.preload (host-side clip preparation) of the requests on the preload thread; a no-op for
        engines without it. Its errors are the batch's to report, when it runs."""
        preload = getattr(engine, "preload", None)

        def run() -> None:
            try:
                if preload is not None and reqs:
                    with _traced("ovbatch.preload"):
                        preload(reqs)
            except Exception as e:  # noqa: BLE001 - generate() prepares what preload could not
                log.debug("preload failed: %s", e)

        return self.preloader.submit(run)

    def _result(
        self, engine: Any, task: ShardTask, row: RequestRow, status: str, error: str | None = None, **measured
    ) -> ResultRow:
        return ResultRow.of(
            row,
            task.variant,
            status,
            error,
            shard=task,
            precision=str(engine.precision),
            model=str(engine.model_id),
            host=self.host,
            gpu=_gpu_name(engine),
            worker=self.worker,
            **measured,
        )

    @staticmethod
    def _prepares(engine: Any) -> bool:
        """Whether the engine prepares batches ahead (prepare_ahead) and takes generate's `then`."""
        return getattr(engine, "prepare_ahead", None) is not None

    @staticmethod
    def _prepare(engine: Any, reqs: list[Any], preloading: Future) -> None:
        """On the preparing thread: engine.prepare_ahead(reqs) once their clips are preloaded. Its errors are
        the batch's to report, when it generates."""
        wait([preloading])
        try:
            with _traced("ovbatch.prepare_ahead"):
                engine.prepare_ahead(reqs)
        except Exception as e:  # noqa: BLE001 - generate() prepares what prepare_ahead could not
            log.debug("prepare_ahead failed: %s", e)

    def _prepare_next_shards(self, next_shard: list[_FirstBatches], upto: int) -> None:
        """Batches 0..upto of the shard next in line for the device, prepared ahead on its own engine, each
        once. next_shard holds that shard's _FirstBatches once taken from the line (nothing happens while no
        shard is in line)."""
        if not next_shard:
            taken = self.turns.next_to_prepare()
            if taken is None:
                return
            next_shard.append(taken)
        shard = next_shard[0]
        if not self._prepares(shard.engine):
            return
        for j, reqs in enumerate(shard.requests[: upto + 1]):
            if j not in shard.prepared:
                shard.prepared[j] = self.preparer.submit(self._prepare, shard.engine, reqs, shard.preloads[j])

    def _generate(
        self,
        engine: Any,
        task: ShardTask,
        rows: list[RequestRow],
        requests_of: Callable[[list[RequestRow]], list[Any]],
        then: Callable[[], None] | None = None,
    ) -> list[_Part]:
        """The engine's outputs for `rows` (then: generate's, see run_shard). A call that raises is split in
        halves, each half tried again, down to single rows: one bad row fails alone, and an out-of-memory
        error retries smaller batches."""
        started = _now()
        t0 = time.perf_counter()
        try:
            outputs = _engine_outputs(engine, requests_of(rows), then)
        except Exception as e:  # noqa: BLE001 - any engine failure is isolated to the rows that cause it
            if is_out_of_memory(e):
                _release_cuda_cache()
            if len(rows) > 1:
                half = len(rows) // 2
                return self._generate(engine, task, rows[:half], requests_of) + self._generate(
                    engine, task, rows[half:], requests_of
                )
            # An input the engine refuses will be refused again: that row is rejected, not failed. A clip
            # that planned fine and cannot be read now (moved, a network file system's blip) may read later.
            refused = isinstance(e, InputError) and not isinstance(e, ClipReadError)
            status = "rejected" if refused else "failed"
            failed = self._result(
                engine,
                task,
                rows[0],
                status,
                _error_text(e),
                batch_size=1,
                started_at=started,
                finished_at=_now(),
            )
            return [_Part(rows, settled=[failed])]
        return [_Part(rows, outputs, time.perf_counter() - t0, started, _now())]

    def _settle(self, engine: Any, task: ShardTask, part: _Part) -> list[ResultRow]:
        """On a writer thread: post-process the part's outputs and write their wavs (and tokens)."""
        if part.settled is not None:
            return part.settled
        with _traced("ovbatch.settle"):
            return self._write_part(engine, task, part)

    def _write_part(self, engine: Any, task: ShardTask, part: _Part) -> list[ResultRow]:
        rows, batch = part.rows, len(part.rows)
        work = [max(int(o.token_work), 0) for o in part.outputs]
        total = sum(work)
        results = []
        for row, out, w in zip(rows, part.outputs, work, strict=True):
            times = {"batch_size": batch, "started_at": part.started, "finished_at": part.finished}
            if hasattr(out, "finish"):
                try:
                    out = out.finish()
                except Exception as e:  # noqa: BLE001 - post-processing one row's audio fails that row only
                    results.append(self._result(engine, task, row, "failed", _error_text(e), **times))
                    continue
            written = time.perf_counter()
            path = self.job.wav_path(task.variant, row.id)
            codes = getattr(out, "tokens", None)  # an engine_factory's own results may carry none
            try:
                if codes is not None:
                    write_tokens(self.job, task.variant, row.id, codes)
                write_wav_atomic(path, out.audio, out.sample_rate)
            except (ValueError, TypeError) as e:  # the row's output is malformed (a full disk: the shard)
                results.append(self._result(engine, task, row, "failed", _error_text(e), **times))
                continue
            audio_seconds = len(out.audio) / float(out.sample_rate)
            fraction = w / total if total else 1.0 / batch
            share = _batch_seconds(getattr(out, "timings", None) or {}, part.wall) * fraction
            results.append(
                self._result(
                    engine,
                    task,
                    row,
                    "ok",
                    wav_path=self.job.relative(path),
                    audio_seconds=audio_seconds,
                    synth_seconds=share,
                    **_phase_seconds(getattr(out, "timings", None) or {}, fraction),
                    write_seconds=time.perf_counter() - written,
                    rtf=share / audio_seconds if audio_seconds > 0 else None,
                    target_frames=int(out.target_frames),
                    token_work=w,
                    **times,
                )
            )
        return results


def _batch_seconds(timings: dict[str, float], wall: float) -> float:
    """A batch's seconds: its prepare, generate and decode phases where the engine timed them (on CUDA its
    generate() returns before the device has run the batch, so its wall says little), else the wall of
    the engine call."""
    if all(timings.get(phase) is not None for phase in ENGINE_PHASES):
        return sum(timings[phase] for phase in ENGINE_PHASES)
    return wall


def _phase_seconds(timings: dict[str, float], fraction: float) -> dict[str, float | None]:
    """A row's seconds in each phase of its batch: its share (by token work) of the batch-wide phases,
    its own post-processing; None where the engine did not time a phase."""

    def share(phase: str) -> float | None:
        return timings[phase] * fraction if phase in timings else None

    return {
        "prepare_seconds": share("prepare"),
        "prepare_ahead_seconds": share("prepare_ahead"),
        "generate_seconds": share("generate"),
        "decode_seconds": share("decode"),
        "generation_idle_seconds": share("generation_idle"),
        "postprocess_seconds": timings.get("postprocess"),
    }


def _reported(results: list[ResultRow], task: ShardTask, on_batch: BatchCallback | None) -> list[ResultRow]:
    if on_batch is not None:
        audio_seconds = sum(r.audio_seconds or 0.0 for r in results)
        on_batch(BatchDone(task.index, task.attempt, len(results), audio_seconds))
    return results


def _on_gpu(engine: Any) -> bool:
    device = getattr(engine, "device", None)
    return device is not None and getattr(device, "type", str(device)) == "cuda"


def _gpu_name(engine: Any) -> str:
    if not _on_gpu(engine):
        return ""
    import torch

    return torch.cuda.get_device_name(engine.device)


def run_local(
    runner: ShardRunner, tasks: list[ShardTask], on_batch: BatchCallback | None = None
) -> Iterator[tuple[ShardTask, list[ResultRow]]]:
    """Local mode: the same shard runner in this process, SHARDS_IN_FLIGHT shards at once on their own
    threads (on_batch is called from them); each shard's results as it finishes (as Ray's pool gives them),
    and the next shard started then, so that one is in line for the device whichever finished. A shard that
    raises stops the others before their next batch; those that finish still give their results, then its
    error is raised. When the caller stops early (an error, Ctrl-C), the shards still running stop too."""
    queued = iter(tasks)
    running: dict[Future, ShardTask] = {}

    def stop_the_rest() -> None:
        runner.stopping.set()
        wait(running)
        runner.stopping.clear()

    with ThreadPoolExecutor(SHARDS_IN_FLIGHT, thread_name_prefix="ovbatch-shard") as pool:
        try:
            while True:
                while len(running) < SHARDS_IN_FLIGHT and (task := next(queued, None)) is not None:
                    running[pool.submit(runner.run_shard, task, on_batch)] = task
                if not running:
                    return
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                failed = sorted(
                    (f for f in finished if f.exception() is not None), key=lambda f: running[f].index
                )
                if failed:
                    stop_the_rest()
                    finished = [f for f in running if f.exception() is None]
                for done in sorted(finished, key=lambda f: running[f].index):
                    yield running.pop(done), done.result()
                if failed:
                    failed[0].result()  # raises the error of the earliest shard that failed
        finally:
            if running:
                stop_the_rest()
