"""Which actors the Ray pool starts and which variant's shards each runs, with a stand-in for Ray (the pool
on a real local Ray is in test_pipeline_e2e.py)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.errors import OVBatchError
from pipeline.config import load_job_config
from pipeline.ray_runner import ActorPool
from pipeline.shard_runner import ShardTask


class _Ref:
    def __init__(self, actor: "_Actor", task: ShardTask):
        self.actor, self.task = actor, task


class _Actor:
    def __init__(self, options: dict, threads: int | None):
        self.options, self.threads = options, threads
        self.run_shard = self
        self.warmed: list[list[tuple[str, str]]] = []  # start_warming.remote(clips) calls
        self.start_warming = SimpleNamespace(remote=self.warmed.append)

    def remote(self, task: ShardTask, progress=None) -> _Ref:  # run_shard.remote(task, progress)
        FakeRay.sent.append((self, task.index))
        return _Ref(self, task)


class _ActorClass:
    def __init__(self, fake: "FakeRay"):
        self.fake = fake

    def options(self, **options):
        fake = self.fake

        class Bound:
            @staticmethod
            def remote(job_path: str, cfg, threads: int | None, variants: list[str]) -> _Actor:
                actor = _Actor(options, threads)
                fake.actors.append(actor)
                return actor

        return Bound


class FakeRay:
    """cluster_resources, remote, wait, get and kill, run synchronously; a shard's result records the
    resources of the actor that ran it."""

    sent: list[tuple[_Actor, int]] = []  # (actor, shard index) of each run_shard call, in order

    def __init__(self, cluster: dict[str, float]):
        self.cluster = cluster
        self.actors: list[_Actor] = []
        FakeRay.sent = []

    def cluster_resources(self) -> dict[str, float]:
        return dict(self.cluster)

    def remote(self, cls) -> _ActorClass:
        return _ActorClass(self)

    def wait(self, refs: list, num_returns: int = 1, timeout: float | None = None):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref: _Ref) -> list[dict]:
        return [{"variant": ref.task.variant, "gpus": ref.actor.options.get("num_gpus", 0)}]

    def kill(self, actor, no_restart: bool = True) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _pool(monkeypatch, cluster: dict[str, float], *overrides: str, started_ray: bool = False):
    fake = FakeRay(cluster)
    monkeypatch.setitem(sys.modules, "ray", fake)
    cfg = load_job_config(None, list(overrides))
    return fake, ActorPool(str(Path("/nonexistent-job")), cfg, started_ray=started_ray)


def _tasks(variants: list[str], per_variant: int = 3) -> list[ShardTask]:
    return [ShardTask(i * 10 + k, v, 512, 1, []) for i, v in enumerate(variants) for k in range(per_variant)]


def test_each_variant_runs_on_actors_of_its_own_device(monkeypatch):
    fake, pool = _pool(
        monkeypatch,
        {"CPU": 16.0, "GPU": 2.0},
        "engine.device=cpu",
        "variants.fp16.device=cuda",
        "variants.fp16.precision=fp16",
        "variants.fp32.precision=fp32",
    )
    gpu = [a for a in fake.actors if "num_gpus" in a.options]
    cpu = [a for a in fake.actors if "num_gpus" not in a.options]
    assert len(gpu) == 2 and all(a.options["num_gpus"] == 1.0 and a.threads is None for a in gpu)
    assert len(cpu) == 2 and all(a.threads == 1 for a in cpu)  # ray.cpu_actors, one torch thread each
    ran = {task.index: results[0] for task, results in pool.run(_tasks(["fp16", "fp32"]))}
    assert len(ran) == 6
    assert all((r["gpus"] > 0) == (r["variant"] == "fp16") for r in ran.values())


def test_the_gpu_actors_warm_a_share_of_the_clips_each(monkeypatch):
    fake, pool = _pool(
        monkeypatch, {"CPU": 16.0, "GPU": 2.0}, "engine.device=cpu", "variants.fp16.device=cuda"
    )
    clips = [(f"clip{i}.wav", f"words {i}") for i in range(5)]
    pool.start_warming(clips)
    gpu = [a for a in fake.actors if "num_gpus" in a.options]
    cpu = [a for a in fake.actors if "num_gpus" not in a.options]
    assert [a.warmed for a in gpu] == [[clips[0::2]], [clips[1::2]]] and not any(a.warmed for a in cpu)


def test_a_shard_is_given_up_after_max_attempts_deaths_in_this_run_whatever_ran_before(monkeypatch):
    """A rerun of a shard whose earlier run took 3 attempts still gets ray.max_shard_attempts tries."""
    fake, pool = _pool(monkeypatch, {"CPU": 4.0}, "engine.device=cpu", "ray.num_actors=1")
    deaths = []

    def get(ref: _Ref):
        if len(deaths) < 2:
            deaths.append(ref.task.attempt)
            raise RuntimeError("the actor died")
        return [{"attempt": ref.task.attempt}]

    monkeypatch.setattr(fake, "get", get)
    monkeypatch.setattr("pipeline.ray_runner.died", lambda e: True)
    rerun = ShardTask(0, "default", 512, 4, [])  # attempts 1-3 ran in earlier runs
    [(task, results)] = list(pool.run([rerun]))
    assert deaths == [4, 5] and results == [{"attempt": 6}]
    assert task.deaths == 2


def test_shards_go_to_the_actors_one_each_in_turn(monkeypatch):
    """A queue shorter than the actors' room is spread over them, not stacked on the first actor."""
    fake, pool = _pool(monkeypatch, {"CPU": 16.0, "GPU": 2.0}, "ray.inflight_per_actor=3")
    assert len(fake.actors) == 2
    assert len(list(pool.run(_tasks(["default"], 4)))) == 4
    first, second = fake.actors
    assert [actor for actor, _ in FakeRay.sent[:4]] == [first, second, first, second]


def test_a_variant_on_the_cpu_leaves_the_gpus_to_the_others(monkeypatch):
    fake, pool = _pool(
        monkeypatch,
        {"CPU": 8.0, "GPU": 1.0},
        "variants.w4a4.precision=w4a4",
        "variants.ref.device=cpu",
        "ray.num_actors=1",
    )
    assert sorted(a.options.get("num_gpus", 0) for a in fake.actors) == [0, 1.0]
    ran = [results[0] for _, results in pool.run(_tasks(["w4a4", "ref"], 2))]
    assert sorted((r["variant"], r["gpus"]) for r in ran) == [("ref", 0)] * 2 + [("w4a4", 1.0)] * 2


def test_auto_on_a_cluster_without_gpus_uses_cpu_actors(monkeypatch):
    fake, pool = _pool(
        monkeypatch,
        {"CPU": 4.0},
        "engine.device=auto",
        "variants.a.precision=fp32",
        "variants.b.precision=bf16",
    )
    assert len(fake.actors) == 2 and all("num_gpus" not in a.options for a in fake.actors)
    assert [r[0]["gpus"] for _, r in pool.run(_tasks(["a", "b"], 1))] == [0, 0]


def test_a_gpu_variant_on_a_local_ray_without_gpus_is_refused_by_name(monkeypatch):
    refused = r"need 1, Ray has 0 \(actors for variant\(s\) \['w4a4'\]\): .*set their device to cpu"
    with pytest.raises(OVBatchError, match=refused):
        _pool(
            monkeypatch,
            {"CPU": 4.0},
            "engine.device=cpu",
            "variants.fp32.precision=fp32",
            "variants.w4a4.device=cuda",
            started_ray=True,
        )
