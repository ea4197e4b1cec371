"""bench/scaling.py on the CPU: merging runs and scaling efficiency, the seeded text-length spread, the
GPU-utilisation and shard-timing summaries, and one tiny W4A4 job through a local Ray (1 CPU actor,
4 decoding steps) end to end, merged with a run made elsewhere."""

from __future__ import annotations

import json
import os
import statistics

import pytest

from bench.manifests import LENGTHS, manifest_texts, speech_seconds, text_of_length
from bench.pipeline import gpu_utilization, parse_gpu_samples
from bench.scaling import (
    main,
    merge_reports,
    parse_gpus,
    shard_timings,
    with_efficiency,
    worker_load,
)
from engine.errors import InputError

JOB = {"size": "full", "rows": 2000, "precision": "w4a4", "config": ["progress=false"], "distribution": {}}


def run(gpus: int, x_exec: float, x_wall: float, **extra) -> dict:
    return {"gpus": gpus, "x_realtime_execution": x_exec, "x_realtime": x_wall, **extra}


def report(*runs: dict, job: dict = JOB) -> dict:
    return {"bench": "scaling", "job": job, "runs": list(runs)}


def test_efficiency_is_throughput_over_n_times_one_gpu():
    runs = with_efficiency([run(2, 72.0, 50.0), run(1, 40.0, 30.0), run(4, 120.0, 60.0)])
    assert [r["gpus"] for r in runs] == [1, 2, 4]
    assert [r["scaling_efficiency"] for r in runs] == [1.0, 0.9, 0.75]
    assert [r["scaling_efficiency_wall"] for r in runs] == [1.0, round(50 / 60, 4), 0.5]


def test_efficiency_waits_for_a_one_gpu_run():
    (only,) = with_efficiency([run(2, 72.0, 50.0)])
    assert only["scaling_efficiency"] is None and only["scaling_efficiency_wall"] is None


def test_merge_keys_runs_by_gpu_count_and_recomputes():
    merged = merge_reports(None, report(run(2, 60.0, 40.0, note="first 2-GPU run")))
    merged = merge_reports(merged, report(run(1, 40.0, 25.0)))
    assert [r["gpus"] for r in merged["runs"]] == [1, 2]
    assert merged["runs"][1]["scaling_efficiency"] == 0.75
    merged = merge_reports(merged, report(run(2, 76.0, 45.0, note="rerun")))
    assert [r["gpus"] for r in merged["runs"]] == [1, 2]
    assert merged["runs"][1]["note"] == "rerun"
    assert merged["runs"][1]["scaling_efficiency"] == 0.95
    assert merged["runs"][1]["scaling_efficiency_wall"] == 0.9
    assert merged["job"] == JOB


def test_merge_refuses_another_job():
    other = {**JOB, "rows": 500}
    with pytest.raises(InputError, match="differs in rows"):
        merge_reports(report(run(1, 40.0, 25.0)), report(run(2, 70.0, 40.0), job=other))


def test_speech_lengths_are_seeded_and_bounded():
    a, b = speech_seconds(2000, seed=0), speech_seconds(2000, seed=0)
    assert a == b and a != speech_seconds(2000, seed=1)
    assert min(a) >= LENGTHS["min_s"] and max(a) <= LENGTHS["max_s"]
    assert min(a) == LENGTHS["min_s"] and max(a) == LENGTHS["max_s"]  # both tails reached and clipped
    assert abs(statistics.median(a) - LENGTHS["median_s"]) < 0.3
    short = sum(s < 2 for s in a) / len(a)
    long = sum(s > 10 for s in a) / len(a)
    assert 0.05 < short < 0.2 and 0.03 < long < 0.15  # a real spread, from a phrase to several sentences


def test_texts_follow_the_drawn_lengths():
    texts, seconds = manifest_texts(300, seed=3)
    assert texts == manifest_texts(300, seed=3)[0]
    for text, s in zip(texts, seconds, strict=True):
        target = round(s * LENGTHS["chars_per_second"])
        assert target <= len(text) <= target + 20
        assert text[0].isupper() and text.endswith(".") and not text.endswith("..")
    assert len(set(texts)) > 250


def test_text_of_length_cycles_the_passage():
    text = text_of_length(5000, start=7)
    assert len(text) >= 5000 and text.endswith(".")


def test_gpu_utilization_per_gpu_and_over_the_busiest():
    samples = parse_gpu_samples("0, 90, 1980\n1, 0, 345\n")
    assert samples == {0: (90.0, 1980.0), 1: (0.0, 345.0)}
    util = gpu_utilization({0: [90.0, 70.0], 1: [0.0, 2.0], 2: [50.0, 60.0]}, used=2)
    assert util["mean_pct_by_gpu"] == {"0": 80.0, "1": 1.0, "2": 55.0}
    assert util["mean_pct_used_gpus"] == 67.5 and util["samples"] == 2
    assert gpu_utilization({}, used=1)["mean_pct_used_gpus"] is None
    with pytest.raises(ValueError):
        parse_gpu_samples("0, [N/A], 1980\n")


def result(shard: int, worker: str, start: str, end: str, synth: float, status: str = "ok") -> dict:
    return {
        "shard": shard,
        "worker": worker,
        "status": status,
        "bucket": 512,
        "started_at": f"2026-01-01T00:00:{start}+00:00",
        "finished_at": f"2026-01-01T00:00:{end}+00:00",
        "synth_seconds": synth,
        "audio_seconds": 10 * synth,
    }


def test_shard_timings_and_worker_load():
    rows = [
        result(0, "a", "01.000", "03.500", 1.0),
        result(0, "a", "04.000", "06.000", 2.0),
        result(1, "b", "01.000", "02.000", 0.5),
        result(1, "b", "01.000", "30.000", 9.0, status="failed"),
        result(2, "a", "07.000", "08.000", 1.0),
    ]
    shards = shard_timings(rows)
    assert [(s["shard"], s["rows"], s["wall_seconds"], s["synth_seconds"]) for s in shards] == [
        (0, 2, 5.0, 3.0),
        (1, 1, 1.0, 0.5),
        (2, 1, 1.0, 1.0),
    ]
    assert max(shards, key=lambda s: s["wall_seconds"])["shard"] == 0
    load = worker_load(shards, execution_seconds=10.0)
    assert load == [
        {"worker": "a", "shards": 2, "rows": 3, "synth_seconds": 4.0, "busy_fraction": 0.4},
        {"worker": "b", "shards": 1, "rows": 1, "synth_seconds": 0.5, "busy_fraction": 0.05},
    ]


@pytest.mark.parametrize("bad", ["", "0", "1,x", "-1"])
def test_bad_gpu_counts_are_refused(bad):
    with pytest.raises(InputError, match="--gpus"):
        parse_gpus(bad)


def test_tiny_job_end_to_end_then_merged(tmp_path, monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    out = tmp_path / "scaling.json"
    argv = ["--size", "tiny", "--rows", "6", "--gpus", "1", "--out", str(out)]
    main([*argv, "--set", "engine.generation.num_step=4"])
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    written = json.loads(out.read_text())
    (one,) = written["runs"]
    assert one["gpus"] == 1 and one["rows"]["ok"] == 6 and one["rows"]["failed"] == 0
    assert one["precision"] == ["w4a4"] and one["scaling_efficiency"] == 1.0
    assert one["audio_seconds"] > 0 and one["x_realtime_execution"] > 0
    assert 0 < one["engine_busy_fraction_per_gpu"] <= 1
    assert one["slowest_shard"]["rows"] >= 1 and one["slowest_shard"]["wall_seconds"] > 0
    assert sum(w["rows"] for w in one["workers"]) == 6
    assert written["job"]["distribution"]["seed"] == 0
    assert one["planning_seconds"] + one["execution_seconds"] == pytest.approx(one["wall_seconds"], abs=0.01)

    elsewhere = tmp_path / "two.json"
    faster = {**one, "gpus": 2, "x_realtime_execution": 1.6 * one["x_realtime_execution"]}
    elsewhere.write_text(json.dumps({**written, "runs": [faster]}))
    main(["--merge", str(elsewhere), "--out", str(out)])
    merged = json.loads(out.read_text())
    assert [r["gpus"] for r in merged["runs"]] == [1, 2]
    assert merged["runs"][1]["scaling_efficiency"] == pytest.approx(0.8, abs=1e-3)
    with pytest.raises(InputError, match="no such report"):
        main(["--merge", str(tmp_path / "missing.json"), "--out", str(out)])


def test_another_job_in_out_is_refused_before_any_work(tmp_path):
    out = tmp_path / "scaling.json"
    out.write_text(json.dumps(report(run(1, 40.0, 25.0))))
    work = tmp_path / "work"
    with pytest.raises(InputError, match="another job"):
        main(["--size", "tiny", "--rows", "4", "--gpus", "1", "--out", str(out), "--work", str(work)])
    assert not (work / "ckpt-w4a4").exists()


def test_a_used_work_folder_is_refused(tmp_path):
    (tmp_path / "job-1gpu").mkdir()
    with pytest.raises(InputError, match="not empty"):
        main(["--size", "tiny", "--gpus", "1", "--out", str(tmp_path / "o.json"), "--work", str(tmp_path)])
