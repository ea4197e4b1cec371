"""Shards on Ray: a pool of actors, each loading an engine once per variant, fed with backpressure (at most
`inflight_per_actor` shards queued per actor, results collected with ray.wait). Actors follow the devices
of the variants: a variant on the CPU (device cpu, or auto where the cluster has no GPU) runs on CPU
actors, any other on GPU actors (one GPU each by default), so an A/B job may hold both kinds.

An actor runs SHARDS_IN_FLIGHT calls at once (pipeline.shard_runner: one generates while the others wait for
the device in line or for their writes); shards go to the actors one each in turn. An actor that dies
(process killed, node lost) costs an attempt to its oldest call (calls start in submission order); the
shards behind it go back to the queue as they were. The dead actor is replaced when there is work for it. A
shard out of attempts in this run (ray.max_shard_attempts; a rerun starts afresh) comes back with every row
failed.

Progress: with an on_batch callback, actors put each finished batch (BatchDone) on a Ray queue, which the
driver drains between waits (every PROGRESS_POLL_S) and always before it hands on a finished shard, so
that a shard's batches reach on_batch before its end.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from engine.errors import OVBatchError
from pipeline.config import JobConfig
from pipeline.messages import first_line
from pipeline.ray_head import RayHead, check_reachable, cluster_address
from pipeline.rows import ResultRow
from pipeline.shard_runner import SHARDS_IN_FLIGHT, BatchCallback, ShardRunner, ShardTask

log = logging.getLogger(__name__)

PROGRESS_POLL_S = 0.5


class ShardActor:
    """The Ray actor body: one ShardRunner per process, its variants' engines loaded as it starts (an engine
    that cannot load fails the actor's start, which stops the job with its message)."""

    def __init__(self, job_path: str, cfg: JobConfig, torch_threads: int | None, variants: list[str]):
        self.started = time.time()  # when Ray had the process up and this module imported
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        self.runner = ShardRunner(job_path, cfg)
        self.runner.load_engines(variants)

    def start_warming(self, clips: list[tuple[str, str]]) -> None:
        self.runner.start_warming(clips)

    def capture(self, tasks: list[ShardTask]) -> dict[str, Any]:
        return {**self.runner.capture(tasks), "started": self.started}

    def run_shard(self, task: ShardTask, progress: Any = None) -> list[ResultRow]:
        """progress: the pool's ray.util.queue.Queue for BatchDone reports, or None."""
        on_batch = progress.put_nowait if progress is not None else None  # put_nowait returns once queued
        return self.runner.run_shard(task, on_batch)


def connect(cfg: JobConfig, head: RayHead | None = None) -> bool:
    """Join the cluster at ray.address / RAY_ADDRESS, or the job's own Ray: the one `head` started (the CLI
    starts it early, pipeline.ray_head), else one started here. True when the job started its Ray."""
    import ray

    if ray.is_initialized():
        return False
    if head is not None:
        ray.init(address=head.address(), log_to_driver=False)
        return True
    address = cluster_address(cfg)
    if address:
        given_as = "ray.address" if cfg.ray.address else "RAY_ADDRESS"
        check_reachable(address, given_as)
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as e:
            raise OVBatchError(
                f"cannot join the Ray cluster at {address} ({given_as}): {first_line(e)}. Start the cluster "
                "or fix the address, or pass --local to run in this process."
            ) from None
        return False
    ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, log_to_driver=False)
    return True


def died(e: BaseException) -> bool:
    from ray.exceptions import ActorUnavailableError, RayActorError, WorkerCrashedError

    return isinstance(e, RayActorError | ActorUnavailableError | WorkerCrashedError)


@dataclass
class ActorGroup:
    """Actors of one kind (GPU or CPU) and the variants whose shards they run."""

    gpu: bool
    variants: list[str]
    size: int
    resources: dict[str, float]


def actor_groups(cfg: JobConfig, cluster: dict[str, float]) -> list[ActorGroup]:
    """One group per device kind the variants need. A group has ray.num_actors actors when set, else one
    per GPU (gpus_per_actor each) for GPU variants and ray.cpu_actors for CPU variants."""
    gpus = cluster.get("GPU", 0.0)
    kinds: dict[bool, list[str]] = {}
    for variant in cfg.variant_names():
        device = cfg.engine_config(variant).device
        on_cpu = device.split(":")[0] == "cpu" or (device == "auto" and gpus == 0)
        kinds.setdefault(not on_cpu, []).append(variant)
    groups = []
    for gpu, variants in kinds.items():
        if cfg.ray.num_actors is not None:
            size = cfg.ray.num_actors
        elif gpu:
            size = max(1, int(gpus // cfg.ray.gpus_per_actor))
        else:
            size = cfg.ray.cpu_actors
        resources = {"num_cpus": cfg.ray.cpus_per_actor}
        if gpu:
            resources["num_gpus"] = cfg.ray.gpus_per_actor
        groups.append(ActorGroup(gpu, variants, size, resources))
    return groups


@dataclass
class _Slot:
    actor: Any
    name: str
    group: ActorGroup
    inflight: deque = field(default_factory=deque)  # object refs, oldest first


class ActorPool:
    def __init__(
        self, job_path: str, cfg: JobConfig, started_ray: bool = False, on_batch: BatchCallback | None = None
    ):
        import ray

        self.started_ray = started_ray  # shut Ray down with the pool when the job started it
        self.on_batch = on_batch
        self.progress = None
        self.job_path = job_path
        self.cfg = cfg
        self.created = time.time()
        self.slots: list[_Slot] = []
        try:
            self._start(ray)
        except BaseException:
            # Left up, the job's own Ray would be joined as a cluster by the next pool in this process, which
            # only warns of actors that cannot be placed, and waits for them for ever.
            self.shutdown()
            raise

    def _start(self, ray: Any) -> None:
        if self.on_batch is not None:
            from ray.util.queue import Queue

            self.progress = Queue(actor_options={"num_cpus": 0})  # takes no CPU an actor needs
        cluster = ray.cluster_resources()
        self.groups = actor_groups(self.cfg, cluster)
        self._check_fits(cluster)
        self.actor_cls = ray.remote(ShardActor)
        self.prefix = f"ovbatch-{uuid.uuid4().hex[:8]}"
        self.spawned = 0
        for group in self.groups:
            for _ in range(group.size):
                self.slots.append(self._spawn(group))  # one by one: shutdown() kills those made

    def _check_fits(self, cluster: dict[str, float]) -> None:
        """Actors that can never be placed leave a job waiting forever: on the local Ray started for the
        job, refuse up front; on a cluster (which may be autoscaling) warn."""
        for key, resource in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
            using = [g for g in self.groups if key in g.resources]
            actors = sum(g.size for g in using)
            need = sum(g.size * g.resources[key] for g in using)
            have = cluster.get(resource, 0.0)
            if need <= have:
                continue
            variants = [v for g in using for v in g.variants]
            fix = "set their device to cpu, " if key == "num_gpus" else ""
            per_actor = using[0].resources[key]
            message = (
                f"{actors} actors x {key}={per_actor:g} need {need:g}, Ray has {have:g} (actors for "
                f"variant(s) {variants}): lower ray.num_actors or ray.{key[4:]}_per_actor, {fix}or add nodes."
            )
            if self.started_ray:
                raise OVBatchError(message)
            log.warning("%s Actors wait until the cluster grows.", message)

    def _spawn(self, group: ActorGroup) -> _Slot:
        name = f"{self.prefix}-actor-{self.spawned}"
        self.spawned += 1
        threads = None if group.gpu else max(1, int(self.cfg.ray.cpus_per_actor))
        actor = self.actor_cls.options(name=name, max_concurrency=SHARDS_IN_FLIGHT, **group.resources).remote(
            self.job_path, self.cfg, threads, group.variants
        )
        return _Slot(actor, name, group)

    def start_warming(self, clips: list[tuple[str, str]]) -> None:
        """Have the GPU actors make the voice prompts of these (clip, transcript) pairs, each its share, once
        loaded and until capture() (ShardRunner.start_warming); not waited for."""
        slots = [slot for slot in self.slots if slot.group.gpu and slot.actor is not None]
        for i, slot in enumerate(slots):
            slot.actor.start_warming.remote(clips[i :: len(slots)])

    def capture(self, tasks: list[ShardTask]) -> dict[str, Any]:
        """Every actor captures the graphs its variants' shards will replay, before any shard runs: graphs
        captured (all actors), and the slowest actor's seconds of capture, of the engine's imports, of engine
        loading (and the load's phases, load_breakdown, of the actor slowest to load) and of boot (from the
        pool's creation until Ray had the actor's process up). An actor that cannot start or dies here is
        left to run(), which reports or replaces it."""
        import ray

        refs = []
        for slot in self.slots:
            mine = [t for t in tasks if t.variant in slot.group.variants]
            if mine and slot.actor is not None:
                refs.append(slot.actor.capture.remote(mine))
        reports = []
        for ref in refs:
            try:
                reports.append(ray.get(ref))
            except Exception as e:  # noqa: BLE001 - run() deals with the actor
                log.warning("an actor did not capture its graphs ahead: %s", first_line(e))
        slowest = max(reports, key=lambda r: r["load_seconds"], default={})
        return {
            "graphs": sum(r["graphs"] for r in reports),
            "capture_seconds": max((r["capture_seconds"] for r in reports), default=0.0),
            "import_seconds": max((r["import_seconds"] for r in reports), default=0.0),
            "load_seconds": max((r["load_seconds"] for r in reports), default=0.0),
            "load_breakdown": slowest.get("load_breakdown", {}),
            "boot_seconds": round(max((r["started"] - self.created for r in reports), default=0.0), 3),
            "warmed_clips": sum(r["warmed_clips"] for r in reports),
            "warm_seconds": max((r["warm_seconds"] for r in reports), default=0.0),
        }

    def run(self, tasks: list[ShardTask]) -> Iterator[tuple[ShardTask, list[ResultRow]]]:
        import ray

        # one queue per actor group (GPU, CPU): a shard waits for an actor of its variant's device kind
        gpu_variant = {v: g.gpu for g in self.groups for v in g.variants}
        queues: dict[bool, deque] = {g.gpu: deque() for g in self.groups}
        for task in tasks:
            queues[gpu_variant[task.variant]].append(task)
        owner: dict[Any, tuple[_Slot, ShardTask]] = {}
        max_attempts = self.cfg.ray.max_shard_attempts
        while any(queues.values()) or owner:
            placed = True
            while placed:  # a shard per actor in turn, so that a short queue is spread over the actors
                placed = False
                for i, slot in enumerate(self.slots):
                    queue = queues[slot.group.gpu]
                    if queue and slot.actor is None:  # its actor died: a fresh one, now that there is work
                        slot = self.slots[i] = self._spawn(slot.group)
                    if queue and len(slot.inflight) < self.cfg.ray.inflight_per_actor:
                        task = queue.popleft()
                        ref = slot.actor.run_shard.remote(task, self.progress)
                        slot.inflight.append(ref)
                        owner[ref] = (slot, task)
                        placed = True
            poll = None if self.progress is None else PROGRESS_POLL_S
            ready, _ = ray.wait(list(owner), num_returns=1, timeout=poll)
            self._pass_on_progress()
            done: list[tuple[ShardTask, list[ResultRow]]] = []
            for ref in ready:
                if ref not in owner:  # dropped with its dead actor in this same round
                    continue
                slot, task = owner[ref]
                try:
                    results = ray.get(ref)
                except Exception as e:
                    if not died(e):
                        cause = getattr(e, "cause", None) or e  # a RayTaskError's text opens with its pid
                        why = f"shard {task.index} could not run: {type(cause).__name__}: {first_line(cause)}"
                        # A problem the worker named stays one (exit 2); a bug's or the machine's is
                        # unexpected (exit 3, the worker's traceback chained), as in the driver's process.
                        raise (OVBatchError if isinstance(cause, OVBatchError) else RuntimeError)(why) from e
                    if getattr(e, "actor_init_failed", False):  # every replacement would fail the same way
                        raise OVBatchError(
                            f"the shard actor could not start on a worker: {_last_line(e)}"
                        ) from e
                    done.extend(self._replace_dead(slot, owner, queues[slot.group.gpu], max_attempts, e))
                    continue
                slot.inflight.remove(ref)
                del owner[ref]
                done.append((task, results))
            yield from done

    def _pass_on_progress(self) -> None:
        if self.progress is not None:
            for batch in self.progress.get_nowait_batch(self.progress.qsize()):
                self.on_batch(batch)

    def _replace_dead(
        self, slot: _Slot, owner: dict, queue: deque, max_attempts: int, e: BaseException
    ) -> list[tuple[ShardTask, list[ResultRow]]]:
        import ray

        log.warning("actor %s died: %s", slot.name, first_line(e))
        refs = list(slot.inflight)
        lost = [owner.pop(r)[1] for r in refs]
        given_up: list[tuple[ShardTask, list[ResultRow]]] = []
        running, waiting = lost[0], lost[1:]
        for task in reversed(waiting):
            queue.appendleft(task)
        deaths = running.deaths + 1
        if deaths >= max_attempts:
            reason = (
                f"the worker running this shard died {deaths} time(s) "
                f"(ray.max_shard_attempts={max_attempts}); last: {first_line(e)}"
            )
            given_up.append((running, failed_rows(running, reason)))
        else:
            queue.appendleft(replace(running, attempt=running.attempt + 1, deaths=deaths))
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        slot.actor = None
        slot.inflight.clear()
        return given_up

    def shutdown(self) -> None:
        import ray

        if self.progress is not None:
            self.progress.shutdown(force=True)
        for slot in self.slots:
            if slot.actor is None:
                continue
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.started_ray:
            ray.shutdown()


def failed_rows(task: ShardTask, reason: str) -> list[ResultRow]:
    return [ResultRow.of(r, task.variant, "failed", reason, shard=task) for r in task.rows]


def _last_line(e: BaseException) -> str:
    """The exception line at the end of a traceback Ray carries as text."""
    text = str(e).strip().splitlines()
    return text[-1].strip()[:300] if text else type(e).__name__
