"""A job from start to finish: submit (plan, then run), resume, rerun, status.

submit MANIFEST --out JOB   plans the job into JOB and runs every shard without a result file; the same
                            command again resumes (the plan must match: same rows, same engine settings).
rerun JOB                   runs exactly the shards whose result file is missing or holds failed rows;
                            ok and rejected rows are kept as they are (their wavs are not rewritten).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from engine.errors import InputError
from pipeline import manifest as manifest_mod
from pipeline.atomic import write_bytes_atomic, write_json_atomic
from pipeline.config import JobConfig, load_job_config, resolve_checkpoint_names, to_yaml
from pipeline.messages import first_line
from pipeline.plan import Plan, RowSize, SizerFactory, budget_problem, make_plan, plan_differences
from pipeline.ray_head import RayHead
from pipeline.rows import RequestRow, ResultRow
from pipeline.shard_runner import BatchCallback, BatchDone, ShardRunner, ShardTask, load_factory, run_local
from pipeline.store import JobDir, JobDirError
from pipeline.summary import summarize

log = logging.getLogger(__name__)


@dataclass
class JobOutcome:
    job: JobDir
    summary: dict[str, Any]
    shards_run: list[int]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def with_job_defaults(cfg: JobConfig, job: JobDir) -> JobConfig:
    """Fill settings whose default depends on the job dir (the voice-prompt cache)."""
    if cfg.engine.prompt_cache_dir is None:
        cfg = replace(cfg, engine=replace(cfg.engine, prompt_cache_dir=str(job.path / "cache" / "prompts")))
    return cfg


def plan_job(
    cfg: JobConfig,
    make_sizer: SizerFactory,
    clip_dir: Path | None,
    read: tuple | None = None,
    phases: dict[str, float] | None = None,
) -> tuple[Plan, list[manifest_mod.ManifestRow]]:
    """Load and validate the manifest (remote clips are copied to clip_dir; `read`: its table, when read
    already), size its rows, cut shards. phases, where given, gets the seconds of each step: manifest (read
    and its clips checked), clips (the sizer made: every clip prepared), rows (each row sized), cut (row
    keys and shards)."""
    start = time.perf_counter()
    first = cfg.engine_config(cfg.variant_names()[0])  # the variant whose engine sizes the rows
    manifest = manifest_mod.load(cfg.manifest, clip_dir, first.max_ref_seconds, read)
    if phases is not None:
        phases["manifest"] = round(time.perf_counter() - start, 3)
    return plan_rows(cfg, manifest, make_sizer, phases)


def plan_rows(
    cfg: JobConfig,
    manifest: manifest_mod.Manifest,
    make_sizer: SizerFactory,
    phases: dict[str, float] | None = None,
) -> tuple[Plan, list[manifest_mod.ManifestRow]]:
    """Size a read manifest's rows and cut shards (phases: as plan_job's)."""
    times = [time.perf_counter()]
    sizer = make_sizer(cfg, manifest.rows) if manifest.rows else None
    times.append(time.perf_counter())
    sizes: dict[str, RowSize] = {}
    rejected = list(manifest.rejected)
    rows = []
    for row in manifest.rows:
        try:
            sizes[row.id] = sizer(row)
        except InputError as e:  # the engine's frontend refused the row (AudioError included)
            rejected.append(manifest_mod.Rejection(row.row_index, row.id, str(e)))
            continue
        except Exception as e:  # one row must not stop the job; the reason keeps what went wrong
            reason = f"could not be prepared ({type(e).__name__}: {first_line(e)}); check its inputs"
            log.warning("row %s: %s", row.id, reason)
            rejected.append(manifest_mod.Rejection(row.row_index, row.id, reason))
            continue
        rows.append(row)
    times.append(time.perf_counter())
    settings = {v: manifest_mod.engine_settings(cfg.engine_config(v)) for v in cfg.variant_names()}
    keys = {v: {r.id: manifest_mod.row_key(r, s) for r in rows} for v, s in settings.items()}
    base = cfg.engine
    plan = make_plan(
        rows,
        rejected,
        sizes,
        keys,
        base.buckets,
        base.max_batch_tokens,
        cfg.shard_tokens,
        cfg.max_rows_per_shard,
    )
    plan.engine_settings = settings
    if any(sizes[r.id].cut_to_budget for r in rows):
        plan.token_budget = cfg.engine_config(cfg.variant_names()[0]).token_budget  # the sizer's budget
    for variant in cfg.variant_names()[1:]:
        problem = budget_problem(plan, variant, cfg.engine_config(variant).token_budget)
        if problem:
            raise InputError(
                f"variants.{variant}: {problem}. Give every variant the same engine.max_batch_tokens and "
                "engine.buckets."
            )
    times.append(time.perf_counter())
    if phases is not None:
        phases.update((k, round(b - a, 3)) for k, a, b in zip(("clips", "rows", "cut"), times, times[1:]))
    return plan, rows


def check_manifest(cfg: JobConfig, make_sizer: SizerFactory) -> dict[str, Any]:
    """What submit would plan, without writing or running anything. Remote clips go to a temporary
    folder (submit copies them into the job) so that the engine's preparation can read them."""
    cfg = resolve_checkpoint_names(cfg)
    with tempfile.TemporaryDirectory(prefix="ovbatch-check-") as clips:
        plan, _ = plan_job(cfg, make_sizer, clip_dir=Path(clips))
    buckets: dict[int, int] = {}
    for shard in plan.shards:
        if shard.variant == plan.variants[0]:
            buckets[shard.bucket] = buckets.get(shard.bucket, 0) + len(shard.rows)
    accepted = sum(buckets.values())
    return {
        "source": cfg.manifest,
        "rows": accepted + len(plan.rejected),
        "accepted": accepted,
        "rejected": plan.rejected,
        "buckets": dict(sorted(buckets.items())),
        "shards": len(plan.shards),
    }


def submit(
    cfg: JobConfig, out: str | Path, make_sizer: SizerFactory, ray_head: RayHead | None = None
) -> JobOutcome:
    """Plan MANIFEST into OUT and run it; on an existing OUT with the same plan, run what is unfinished.
    make_sizer(cfg, rows) gives the row sizer (pipeline.sizing.frontend_sizer: the engine's own request
    preparation, without the model or the codec). ray_head: the job's own Ray, started already (the CLI's;
    the job closes it); else the job starts Ray here when it needs one."""
    t0 = time.perf_counter()
    job = JobDir(out)
    cfg = with_job_defaults(cfg, job)
    if cfg.manifest is None:
        raise JobDirError("no manifest given: pass MANIFEST to submit (or manifest=... in the config).")
    if job.path.exists() and not job.path.is_dir():
        raise JobDirError(f"--out {job.path} is a file: give a new or empty directory for the job.")
    job.refuse_if_running()  # before its config, rows or Ray are touched
    foreign = [] if job.exists() else job.foreign_entries()
    if foreign:
        raise JobDirError(
            f"--out {job.path} already holds other files ({', '.join(foreign[:3])}): "
            "give a new or empty directory for the job."
        )
    cfg = resolve_checkpoint_names(cfg)
    table = manifest_mod.read_table(cfg.manifest)  # a missing or malformed manifest fails before any worker
    workers = held = None
    start_workers = not _complete(job)
    try:
        if start_workers and not cfg.local:
            # Ray starts before the planning, as the actors start only once Ray is up; they then import and
            # load in their own processes while this one plans (its clip workers yield them the CPU), and
            # encode a new job's clips meanwhile (a resumed one has most in its cache).
            warm = [] if job.exists() else manifest_mod.reference_pairs(table)
            workers = Workers(job, cfg, ray_head, warm)
        elif start_workers:
            # Imported before the planner's thread starts, which imports some of them too: transformers
            # replaces itself in sys.modules at the end of its import, and a second thread importing it
            # meanwhile can get the module it replaced ("cannot import name ... from 'transformers'").
            load_factory(cfg.engine_factory)
        planning_phases: dict[str, float] = {}
        with ThreadPoolExecutor(1, thread_name_prefix="ovbatch-plan") as planner:
            planning = planner.submit(_read_and_plan, cfg, job.clip_dir, make_sizer, table, planning_phases)
            if start_workers and cfg.local:
                workers = Workers(job, cfg)  # the engines load on a thread as the rows are sized
            (plan, rows), planned_at = planning.result()
        if workers is not None and cfg.local:  # what starting them held the driver up beyond the planning
            workers.start_seconds = max(0.0, workers.started_at - planned_at)
        held = job.hold_for_run()  # before the job's files: a run may have taken the job while this planned
        kind = "submit"
        if job.exists():
            stored = job.read_plan()
            if stored.fingerprint != plan.fingerprint:
                raise JobDirError(
                    f"{job.path} holds a different job: {'; '.join(plan_differences(stored, plan))}. Submit "
                    "to a new --out, or `ovbatch rerun` the existing job with its own settings."
                )
            kind = "resume"
            job.write_rows(rows)  # the same rows, their clips where the manifest now puts them (moved, maybe)
            job.write_rejected(plan)
        else:
            job.path.mkdir(parents=True, exist_ok=True)
            job.write_rows(rows)
            job.write_rejected(plan)
            job.write_plan(plan)
        write_bytes_atomic(job.config_path, to_yaml(cfg).encode())
        todo = [s.index for s in plan.shards if s.index not in job.finished_shards()]
    except BaseException:
        if held is not None:
            held.close()
        if workers is not None:
            workers.shutdown()
        raise
    return execute(job, cfg, plan, todo, kind, t0, workers, planning_phases=planning_phases, held=held)


def _read_and_plan(
    cfg: JobConfig, clip_dir: Path, make_sizer: SizerFactory, table: tuple, phases: dict[str, float]
):
    """plan_job (the manifest's clips checked, its rows planned), and perf_counter when it was done."""
    return plan_job(cfg, make_sizer, clip_dir, table, phases), time.perf_counter()


def _complete(job: JobDir) -> bool:
    """Whether every shard of the job in this directory (if any) has its results."""
    return job.exists() and {s.index for s in job.read_plan().shards} <= job.finished_shards()


def may_run(out: str | Path) -> bool:
    """Whether submitting to `out` may run shards: a new job, or one not complete (not a file, not done).
    A job another run holds is refused here, before anything starts."""
    job = JobDir(out)
    job.refuse_if_running()
    return not job.path.exists() or (job.path.is_dir() and not _complete(job))


def shards_to_rerun(job: JobDir) -> list[int]:
    """The shards a rerun runs: those missing their results file or holding failed rows."""
    finished = job.finished_shards()
    return [
        s.index for s in job.read_plan().shards if s.index not in finished or job.has_failed_rows(s.index)
    ]


def rerun(
    job_path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    literal: dict[str, Any] | None = None,
    ray_head: RayHead | None = None,
) -> JobOutcome:
    """Run the shards that are missing a result file or hold failed rows; only their failed rows run.
    overrides and literal settings go on top of the job's stored config (see load_job_config); ray_head as
    in submit."""
    job = JobDir(job_path)
    job.require()
    job.refuse_if_running()
    cfg = load_job_config(job.config_path, overrides, literal)
    plan = job.read_plan()
    changed = [
        v
        for v in plan.variants
        if v not in cfg.variant_names()
        or manifest_mod.engine_settings(cfg.engine_config(v)) != plan.engine_settings.get(v)
    ]
    if changed:
        raise JobDirError(
            f"rerun cannot change what variant(s) {changed} sound like (checkpoint, precision, generation "
            "settings): only run settings (device, buckets, batch limits, ray.*, local) may be overridden. "
            "Submit the manifest to a new --out for other settings."
        )
    todo = shards_to_rerun(job)
    for variant in plan.variants:
        problem = budget_problem(plan, variant, cfg.engine_config(variant).token_budget, todo)
        if problem:
            raise JobDirError(f"rerun cannot run variant {variant} under these batch limits: {problem}.")
    return execute(job, cfg, plan, todo, "rerun", ray_head=ray_head)


def _task(
    plan: Plan, index: int, rows: dict[str, manifest_mod.ManifestRow], earlier: dict[int, list[ResultRow]]
) -> ShardTask:
    """The shard's rows not settled by an earlier run (`earlier`: its results), as its next attempt."""
    shard = plan.shards[index]
    done = {r.id for r in earlier.get(index, []) if r.status != "failed"}
    payload = [RequestRow.of(rows[p.id], p) for p in shard.rows if p.id not in done]
    attempt = 1 + max((r.attempt or 0 for r in earlier.get(index, [])), default=0)
    return ShardTask(shard.index, shard.variant, shard.bucket, attempt, payload)


def execute(
    job: JobDir,
    cfg: JobConfig,
    plan: Plan,
    shard_indices: list[int],
    kind: str,
    t0: float | None = None,
    workers: Workers | None = None,
    ray_head: RayHead | None = None,
    planning_phases: dict[str, float] | None = None,
    held: IO[str] | None = None,
) -> JobOutcome:
    """Run `shard_indices` and write their results; t0 (perf_counter) is when the run began, planning
    included (default: now); workers: started already (default: started here, on ray_head's Ray if given);
    planning_phases: plan_job's phases, for the run's record. One run at a time writes into a job: held is
    its run lock where the caller took it (JobDir.hold_for_run; closed here), else it is taken here."""
    try:
        if held is None:
            held = job.hold_for_run()
    except BaseException:
        if workers is not None:
            workers.shutdown()
        raise
    try:
        return _execute(job, cfg, plan, shard_indices, kind, t0, workers, ray_head, planning_phases)
    finally:
        held.close()


def _execute(
    job: JobDir,
    cfg: JobConfig,
    plan: Plan,
    shard_indices: list[int],
    kind: str,
    t0: float | None,
    workers: Workers | None,
    ray_head: RayHead | None,
    planning_phases: dict[str, float] | None,
) -> JobOutcome:
    try:  # until run_tasks, which stops the workers itself
        job.remove_temp_files()
        rows = job.read_rows()
        finished = job.finished_shards()
        earlier = {i: job.read_shard_results(i) for i in shard_indices if i in finished}
        # Rows a shard already settled (ok or rejected) are kept and never run again.
        kept = {i: [r for r in results if r.status != "failed"] for i, results in earlier.items()}
        tasks = [_task(plan, i, rows, earlier) for i in shard_indices]
        t0 = time.perf_counter() if t0 is None else t0
        if tasks and workers is None:
            workers = Workers(job, cfg, ray_head)
        worker_start = workers.start_seconds if workers is not None else 0.0
        since_t0 = time.perf_counter() - t0
        planning = since_t0 - worker_start
        started = (datetime.now(UTC) - timedelta(seconds=since_t0)).isoformat(timespec="milliseconds")
        run_id = uuid.uuid4().hex[:12]
        run_record = {
            "kind": kind,
            "started_at": started,
            "planning_seconds": round(planning, 3),
            "planning_phases": planning_phases or {},  # plan_job's steps (a rerun plans nothing)
            "worker_start_seconds": round(worker_start, 3),  # what starting the workers held the driver up
            "worker_start_parts": workers.start_parts if workers is not None else {},
            "mode": "local" if cfg.local else "ray",
            "shards": len(tasks),
            "rows": sum(len(t.rows) for t in tasks),
        }
        if tasks:
            # Recorded before any shard runs, so that a run killed half-way still counts its time.
            job.append_run({"event": "start", "run": run_id, **run_record})
    except BaseException:
        if workers is not None:
            workers.shutdown()
        raise
    if tasks:
        run_tasks(job, cfg, tasks, kept, kind, run_id, t0, workers)
        job.append_run({"event": "end", "run": run_id, "finished_at": _now(), "wall_seconds": _since(t0)})
    else:  # recorded, but a run with nothing to do adds no time to the job (summary.counts_time)
        if workers is not None:
            workers.shutdown()
        job.append_run(
            {"event": "end", "run": run_id, **run_record, "finished_at": _now(), "wall_seconds": _since(t0)}
        )
    summary = summarize(job)
    write_json_atomic(job.summary_path, summary)
    if cfg.report == "always" or (cfg.report == "auto" and len(plan.variants) > 1 and summary["complete"]):
        from pipeline.report import write_report

        write_report(job, cfg.compare)
    return JobOutcome(job, summary, [t.index for t in tasks])


def _since(t0: float) -> float:
    return round(time.perf_counter() - t0, 3)


class Progress:
    """The run's bar: rows, with the seconds of audio made beside them. It moves per finished batch as the
    executor reports batches, and at shard end adds only what the shard's batches did not report. A
    shard run again after its actor died counts its rows once: the bar shows, per shard, the most any
    one attempt reported. Thread-safe: local shards report from their own threads."""

    def __init__(self, bar: Any):
        self.bar = bar
        self.lock = threading.Lock()
        self.audio_seconds = 0.0
        self.reported: dict[int, dict[int, tuple[int, float]]] = {}  # shard -> attempt -> (rows, audio s)
        self.finished: set[int] = set()

    def batch(self, done: BatchDone) -> None:
        with self.lock:
            if done.shard in self.finished:  # from an actor taken for dead whose shard has ended without it
                return
            attempts = self.reported.setdefault(done.shard, {})
            before = _most(attempts)
            rows, audio = attempts.get(done.attempt, (0, 0.0))
            attempts[done.attempt] = (rows + done.rows, audio + done.audio_seconds)
            after = _most(attempts)
            self._advance(after[0] - before[0], after[1] - before[1])

    def shard_done(self, shard: int, rows: int, audio_seconds: float) -> None:
        with self.lock:
            counted_rows, counted_audio = _most(self.reported.pop(shard, {}))
            self.finished.add(shard)
            self._advance(rows - counted_rows, audio_seconds - counted_audio)

    def _advance(self, rows: int, audio_seconds: float) -> None:
        self.audio_seconds += audio_seconds
        self.bar.set_postfix_str(f"{self.audio_seconds:.1f} s audio", refresh=False)  # update() draws it
        self.bar.update(rows)


def _most(attempts: dict[int, tuple[int, float]]) -> tuple[int, float]:
    """The most rows and audio seconds any one attempt reported."""
    reports = attempts.values()
    return max((rows for rows, _ in reports), default=0), max((audio for _, audio in reports), default=0.0)


def run_tasks(
    job: JobDir,
    cfg: JobConfig,
    tasks: list[ShardTask],
    kept: dict[int, list[ResultRow]],
    kind: str,
    run_id: str,
    t0: float,
    workers: Workers,
) -> None:
    """Run the shards and write each one's results as it finishes, with a `shard` event in runs.jsonl.
    A run that stops on an exception (Ctrl-C included) records its end and what stopped it."""
    bar = tqdm(
        total=sum(len(t.rows) for t in tasks),
        unit="row",
        desc=f"{kind} {job.path.name}",
        disable=not cfg.progress,
        dynamic_ncols=True,
    )
    progress = Progress(bar)
    finished = False
    try:
        ready = workers.ready(tasks)
        job.append_run({"event": "ready", "run": run_id, "seconds": _since(t0), **ready})
        for task, results in workers.run(tasks, progress.batch if cfg.progress else None):
            for r in results:  # a row that did not end ok keeps no wav from an earlier attempt
                if r.status != "ok":
                    job.wav_path(task.variant, r.id).unlink(missing_ok=True)
            job.write_shard_results(task.index, kept.get(task.index, []) + results)
            job.append_run({"event": "shard", "run": run_id, "shard": task.index, "seconds": _since(t0)})
            progress.shard_done(task.index, len(task.rows), sum(r.audio_seconds or 0.0 for r in results))
        finished = True
    except BaseException as e:
        job.append_run(
            {
                "event": "end",
                "run": run_id,
                "finished_at": _now(),
                "wall_seconds": _since(t0),
                "stopped_by": type(e).__name__,
            }
        )
        raise
    finally:
        bar.close()
        # Every shard of a finished run has returned, its writes done: nothing waits for Ray's own teardown.
        # A run stopped half-way waits for it, so that no actor writes behind the temp files' removal.
        workers.shutdown(wait_for_ray=not finished)
        # A worker lost during this run (a killed actor) may have left a temp file; no writer is left.
        job.remove_temp_files()


class BatchRelay:
    """An on_batch callback whose target is set later: workers start before the progress bar exists."""

    def __init__(self) -> None:
        self.target: BatchCallback | None = None

    def __call__(self, done: BatchDone) -> None:
        if self.target is not None:
            self.target(done)


class Workers:
    """Where shards run: this process (local mode) or Ray actors, started so that the engines load while
    the driver plans (Ray: before the planning, the actors then loading in their own processes; local: on a
    thread beside the planner's); Ray actors then make the voice prompts of `warm`'s (clip, transcript)
    pairs until ready() (ShardRunner.start_warming: GPU engines only); run() then feeds them the shards.
    A local job does not warm: with the warming in the planner's process its planning took 14.3 s on the H200
    (4,600 rows; 8.9 s in the session before warming landed) for 192 clips, ~1 s of the device's encode."""

    def __init__(
        self,
        job: JobDir,
        cfg: JobConfig,
        ray_head: RayHead | None = None,
        warm: list[tuple[str, str]] | None = None,
    ):
        start = time.perf_counter()
        self.ray_head = ray_head
        self.relay = BatchRelay()
        self.pool = self.runner = self.loading = None
        self.start_parts: dict[str, float] = {}  # Ray: its modules' import, ray.init, the actors' creation
        if cfg.local and warm:
            raise ValueError("Workers: warming is for Ray actors; a local job passes no `warm` pairs")
        if cfg.local:
            self.runner = ShardRunner(job.path, cfg)
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="ovbatch-engine-load")
            self.loading = self._loader.submit(self.runner.load_engines, cfg.variant_names())
        else:
            import ray  # noqa: F401 - imported here to time it apart from ray.init

            from pipeline.ray_runner import ActorPool, connect

            imported = time.perf_counter()
            started_ray = connect(cfg, ray_head)
            connected = time.perf_counter()
            on_batch = self.relay if cfg.progress else None
            self.pool = ActorPool(str(job.path), cfg, started_ray=started_ray, on_batch=on_batch)
            if warm:
                self.pool.start_warming(warm)
            self.start_parts = {
                "import": round(imported - start, 3),
                "ray_init": round(connected - imported, 3),
                "actors": round(time.perf_counter() - connected, 3),
            }
        self.started_at = time.perf_counter()
        self.start_seconds = self.started_at - start  # Ray's start; the engines load meanwhile

    def ready(self, tasks: list[ShardTask]) -> dict[str, Any]:
        """Wait for the engines, then have them capture the CUDA graphs the tasks will replay: graphs
        captured, the seconds capture took, and what starting the engines took (ShardRunner.capture)."""
        if self.pool is not None:
            return self.pool.capture(tasks)
        self.loading.result()  # an engine that could not load stops the run here, with its own error
        return self.runner.capture(tasks)

    def run(self, tasks: list[ShardTask], on_batch: BatchCallback | None) -> Iterator[tuple[ShardTask, list]]:
        self.relay.target = on_batch
        if self.pool is not None:
            yield from self.pool.run(tasks)
            return
        self.loading.result()
        yield from run_local(self.runner, tasks, self.relay)

    def shutdown(self, wait_for_ray: bool = True) -> None:
        """Stop the workers; wait_for_ray: until the job's own Ray (if it started one) is down."""
        if self.pool is not None:
            self.pool.shutdown()
            if self.ray_head is not None:
                self.ray_head.close(wait=wait_for_ray)
        else:
            self._loader.shutdown(wait=True)
            self.runner.close()


def status(job_path: str | Path) -> dict[str, Any]:
    job = JobDir(job_path)
    job.require()
    return summarize(job)
