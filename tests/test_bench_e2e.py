"""bench/e2e.py on the CPU: padding arithmetic and merging entries from several device calls."""

import argparse
import json

import pytest

from bench.e2e import PARTS, merge, padding_fraction, parse_parts


def test_padding_is_the_token_weighted_empty_share_of_the_buckets():
    buckets = [1024, 2048, 4096]
    assert padding_fraction([1024, 2048], buckets) == 0.0
    assert padding_fraction([1000, 1500], buckets) == round(1 - 2500 / (1024 + 2048), 4)
    assert padding_fraction([5000], buckets) == 0.0  # over every bucket: ran eagerly, unpadded
    assert padding_fraction([], buckets) is None


def test_entries_merge_by_variant_across_calls(tmp_path):
    out = tmp_path / "e2e.json"
    out.write_text(json.dumps({"bench": "e2e", "entries": [{"variant": "engine_bf16", "x_realtime": 1.0}]}))
    report = merge(
        out, [{"variant": "engine_bf16", "x_realtime": 2.0}, {"variant": "job_ray_bf16"}], {"rows": 9}
    )
    assert report["entries"] == [{"variant": "engine_bf16", "x_realtime": 2.0}, {"variant": "job_ray_bf16"}]
    assert report["rows"] == 9 and merge(tmp_path / "none.json", [], {})["entries"] == []


def test_parts_are_checked_and_setup_runs_no_part():
    assert parse_parts("job_ray,engine") == ["job_ray", "engine"]
    assert parse_parts(",".join(PARTS)) == list(PARTS)
    assert parse_parts("setup") == []
    for bad in ("egine", "engine,setup", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="unknown part"):
            parse_parts(bad)


def test_gpu_fields_read_the_busiest_gpu():
    from bench.e2e import gpu_fields
    from bench.pipeline import GpuSampler

    gpu = GpuSampler()
    assert gpu_fields(gpu) == {"gpu_busy": None, "mean_sm_clock_mhz": None, "gpu_samples_missed": 0}
    gpu.by_gpu, gpu.sm_mhz = {0: [2.0, 4.0], 1: [90.0, 100.0]}, {0: [300.0, 300.0], 1: [1900.0, 1980.0]}
    gpu.missed = 1
    assert gpu_fields(gpu) == {"gpu_busy": 0.95, "mean_sm_clock_mhz": 1940.0, "gpu_samples_missed": 1}


def test_a_query_that_times_out_or_reads_garbage_skips_one_sample_not_the_rest(monkeypatch):
    """A long run's busy fractions are means over its samples: a sampler that stopped at the first slow
    nvidia-smi would average the run's first minutes only, without a word."""
    import subprocess
    import time

    from bench import pipeline

    replies = iter(["timeout", "garbage", *["0, 97, 1980\n"] * 1000])

    def fake_run(query, **kwargs):
        reply = next(replies)
        if reply == "timeout":
            raise subprocess.TimeoutExpired(query, 5)
        return subprocess.CompletedProcess(query, 0, stdout=reply, stderr="")

    monkeypatch.setattr(pipeline.subprocess, "run", fake_run)
    monkeypatch.setattr(pipeline, "SAMPLE_SECONDS", 0.01)
    with pipeline.GpuSampler() as gpu:
        deadline = time.monotonic() + 10
        while len(gpu.by_gpu.get(0, [])) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert gpu.by_gpu[0][:3] == [97.0, 97.0, 97.0] and gpu.missed == 2


def test_busy_since_reads_the_samples_after_the_ready_event():
    from bench.e2e import busy_since
    from bench.pipeline import GpuSampler

    gpu = GpuSampler()
    gpu.by_gpu = {0: [0.0, 0.0, 96.0, 98.0], 1: [50.0, 50.0, 10.0, 12.0]}
    gpu.times = {0: [1.0, 2.0, 3.0, 4.0], 1: [1.0, 2.0, 3.0, 4.0]}
    assert busy_since(gpu, 2.5) == 0.97  # planning and startup samples left out
    assert busy_since(gpu, 0.0) == 0.485  # every sample: GPU 0's (0 + 0 + 96 + 98) / 4
    assert busy_since(gpu, 9.0) is None
    assert busy_since(gpu, 2.5, until=3.5) == 0.96  # until the last batch was generated: the tail left out


def test_the_attention_backend_is_named_for_the_device_the_bench_runs_on():
    from bench.e2e import attention_here

    assert attention_here("cpu") == "sdpa"  # the one backend that runs on a CPU


def test_generation_idle_is_summed_per_batch_and_split_at_shard_starts():
    from bench.e2e import idle_by_batch

    def row(shard, start, idle):
        started = f"2026-12-04T18:00:{start:02d}.000+00:00"
        return {"shard": shard, "started_at": started, "generation_idle_seconds": idle}

    rows = [
        row(0, 1, None),  # an engine's first batch: nothing before it to measure from
        *[row(0, 5, 0.01), row(0, 5, 0.03)],  # one batch: its rows' shares add up
        row(1, 9, 0.5),  # shard 1's first batch
        row(1, 12, 0.2),
    ]
    got = idle_by_batch(rows)
    assert got["batches"] == 3 and got["seconds"] == 0.74
    assert got["shard_first_batches_seconds"] == 0.5 and got["other_batches_seconds"] == 0.24
    assert got["longest"][0] == {"shard": 1, "first_of_shard": True, "seconds": 0.5}
    assert idle_by_batch([row(0, 1, None)]) is None


def test_the_busy_timeline_splits_the_window_into_equal_slices():
    from bench.e2e import busy_timeline
    from bench.pipeline import GpuSampler

    gpu = GpuSampler()
    gpu.by_gpu = {0: [10.0, 20.0, 90.0, 100.0, 50.0]}
    gpu.times = {0: [1.0, 2.0, 3.0, 4.0, 9.0]}
    # [1, 3) [3, 5] in halves; a slice without samples is None
    assert busy_timeline(gpu, 1.0, 5.0, parts=2) == [0.15, 0.95]
    assert busy_timeline(gpu, 5.0, 7.0, parts=2) == [None, None]
    assert busy_timeline(GpuSampler(), 1.0, 5.0) is None  # no nvidia-smi


def test_by_bucket_sums_each_buckets_rows_and_phase_shares():
    from bench.e2e import by_bucket

    def row(bucket, audio, generate, idle):
        return {
            "bucket": bucket,
            "audio_seconds": audio,
            "generate_seconds": generate,
            "prepare_ahead_seconds": None,
            "generation_idle_seconds": idle,
        }

    got = by_bucket([row(1, 2.0, 0.5, 0.1), row(0, 4.0, 1.0, None), row(1, 3.0, 0.25, 0.2)])
    assert list(got) == ["0", "1"]
    assert got["1"] == {
        "rows": 2,
        "audio_seconds": 5.0,
        "generate_seconds": 0.75,
        "prepare_ahead_seconds": 0.0,
        "generation_idle_seconds": 0.3,
    }
    assert by_bucket([row(0, 1.0, None, None)]) is None  # an engine that times no phase
