"""Shards on Ray: a pool of actors (one GPU each, or CPU actors where the cluster has no GPU), each
loading the engine once, fed with backpressure (at most `inflight_per_actor` shards queued per actor,
results collected with ray.wait).

An actor that dies (process killed, node lost) costs an attempt to the shard it was running (calls run in
submission order, so that is its oldest call); shards merely queued behind it go back to the queue as
they were. The dead actor is replaced when there is work for it. A shard out of attempts comes back with
every row failed.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from engine.errors import OVBatchError
from pipeline.config import JobConfig
from pipeline.messages import first_line
from pipeline.runner import ShardRunner, ShardTask

log = logging.getLogger(__name__)


class ShardActor:
    """The Ray actor body: one ShardRunner per process."""

    def __init__(self, job_path: str, cfg: JobConfig, torch_threads: int | None):
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)
        self.runner = ShardRunner(job_path, cfg)

    def run_shard(self, task: ShardTask) -> list[dict[str, Any]]:
        return self.runner.run_shard(task)


def connect(cfg: JobConfig) -> bool:
    """Join the cluster at ray.address / RAY_ADDRESS, or start a local Ray. True when we started it."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, log_to_driver=False)
    return True


def died(e: BaseException) -> bool:
    from ray.exceptions import ActorUnavailableError, RayActorError, WorkerCrashedError

    return isinstance(e, RayActorError | ActorUnavailableError | WorkerCrashedError)


@dataclass
class _Slot:
    actor: Any
    name: str
    inflight: deque = field(default_factory=deque)  # object refs, oldest first


class ActorPool:
    def __init__(self, job_path: str, cfg: JobConfig, started_ray: bool = False):
        import ray

        self.started_ray = started_ray  # shut Ray down with the pool when the job started it
        self.job_path = job_path
        self.cfg = cfg
        gpus = ray.cluster_resources().get("GPU", 0.0)
        self.use_gpu = gpus > 0 and cfg.engine.device != "cpu"
        if cfg.ray.num_actors is not None:
            self.size = cfg.ray.num_actors
        elif self.use_gpu:
            self.size = max(1, int(gpus // cfg.ray.gpus_per_actor))
        else:
            self.size = cfg.ray.cpu_actors
        self.resources = {"num_cpus": cfg.ray.cpus_per_actor}
        if self.use_gpu:
            self.resources["num_gpus"] = cfg.ray.gpus_per_actor
        self._check_fits(ray.cluster_resources())
        self.actor_cls = ray.remote(ShardActor)
        self.prefix = f"ovbatch-{uuid.uuid4().hex[:8]}"
        self.spawned = 0
        self.slots = [self._spawn() for _ in range(self.size)]

    def _check_fits(self, cluster: dict[str, float]) -> None:
        """Actors that can never be placed leave a job waiting forever: on the local Ray started for the
        job, refuse up front; on a cluster (which may be autoscaling) warn."""
        for key, per_actor in self.resources.items():
            have = cluster.get("CPU" if key == "num_cpus" else "GPU", 0.0)
            if self.size * per_actor <= have:
                continue
            message = (
                f"{self.size} actors x {key}={per_actor:g} need {self.size * per_actor:g}, Ray has "
                f"{have:g}: lower ray.num_actors or ray.{key[4:]}_per_actor, or add nodes."
            )
            if self.started_ray:
                raise OVBatchError(message)
            log.warning("%s Actors wait until the cluster grows.", message)

    def _spawn(self) -> _Slot:
        name = f"{self.prefix}-actor-{self.spawned}"
        self.spawned += 1
        threads = None if self.use_gpu else max(1, int(self.cfg.ray.cpus_per_actor))
        actor = self.actor_cls.options(name=name, **self.resources).remote(self.job_path, self.cfg, threads)
        return _Slot(actor, name)

    def run(self, tasks: list[ShardTask]) -> Iterator[tuple[ShardTask, list[dict[str, Any]]]]:
        import ray

        queue = deque(tasks)
        owner: dict[Any, tuple[_Slot, ShardTask]] = {}
        max_attempts = self.cfg.ray.max_shard_attempts
        while queue or owner:
            for i, slot in enumerate(self.slots):
                if queue and slot.actor is None:  # its actor died: a fresh one, now that there is work
                    slot = self.slots[i] = self._spawn()
                while queue and len(slot.inflight) < self.cfg.ray.inflight_per_actor:
                    task = queue.popleft()
                    ref = slot.actor.run_shard.remote(task)
                    slot.inflight.append(ref)
                    owner[ref] = (slot, task)
            ready, _ = ray.wait(list(owner), num_returns=1)
            done: list[tuple[ShardTask, list[dict[str, Any]]]] = []
            for ref in ready:
                if ref not in owner:  # dropped with its dead actor in this same round
                    continue
                slot, task = owner[ref]
                try:
                    results = ray.get(ref)
                except Exception as e:
                    if not died(e):
                        cause = getattr(e, "cause", None) or e  # a RayTaskError's text opens with its pid
                        raise OVBatchError(
                            f"shard {task.index} could not run: {type(cause).__name__}: {first_line(cause)}"
                        ) from e
                    if getattr(e, "actor_init_failed", False):  # every replacement would fail the same way
                        raise OVBatchError(
                            f"the shard actor could not start on a worker: {_last_line(e)}"
                        ) from e
                    done.extend(self._replace_dead(slot, owner, queue, max_attempts, e))
                    continue
                slot.inflight.remove(ref)
                del owner[ref]
                done.append((task, results))
            yield from done

    def _replace_dead(
        self, slot: _Slot, owner: dict, queue: deque, max_attempts: int, e: BaseException
    ) -> list[tuple[ShardTask, list[dict[str, Any]]]]:
        import ray

        log.warning("actor %s died: %s", slot.name, first_line(e))
        refs = list(slot.inflight)
        lost = [owner.pop(r)[1] for r in refs]
        given_up: list[tuple[ShardTask, list[dict[str, Any]]]] = []
        running, waiting = lost[0], lost[1:]
        for task in reversed(waiting):
            queue.appendleft(task)
        if running.attempt >= max_attempts:
            reason = (
                f"the worker running this shard died {running.attempt} time(s) "
                f"(ray.max_shard_attempts={max_attempts}); last: {first_line(e)}"
            )
            given_up.append((running, failed_rows(running, reason)))
        else:
            queue.appendleft(replace(running, attempt=running.attempt + 1))
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        slot.actor = None
        slot.inflight.clear()
        return given_up

    def shutdown(self) -> None:
        import ray

        for slot in self.slots:
            if slot.actor is None:
                continue
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.started_ray:
            ray.shutdown()


def failed_rows(task: ShardTask, reason: str) -> list[dict[str, Any]]:
    return [
        {
            "id": r["id"],
            "row_key": r["row_key"],
            "variant": task.variant,
            "status": "failed",
            "error": reason,
            "row_index": r["row_index"],
            "ref_seconds": r["ref_seconds"],
            "bucket": task.bucket,
            "shard": task.index,
            "attempt": task.attempt,
            "packed_tokens": r["packed_tokens"],
        }
        for r in task.rows
    ]


def _last_line(e: BaseException) -> str:
    """The exception line at the end of a traceback Ray carries as text."""
    text = str(e).strip().splitlines()
    return text[-1].strip()[:300] if text else type(e).__name__
