"""A/B metrics on known signals, and the HTML report of a two-variant job dir."""

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from ab_job import SR, make_ab_job
from ab_job import tone as _tone

from engine.errors import OVBatchError
from pipeline.atomic import write_wav_atomic
from pipeline.compare import compare_variants, log_mel_db, mel_filterbank, pair_metrics
from pipeline.report import table, write_report
from pipeline.store import JobDir


def test_identical_signals():
    a = _tone(1.0, 440, np.random.default_rng(0))
    m = pair_metrics(a, a.copy(), SR)
    assert m["snr_db"] == math.inf and m["mel_lsd_db"] == 0.0
    assert m["correlation"] == pytest.approx(1.0) and m["duration_ratio"] == 1.0


@pytest.mark.parametrize("snr", [5.0, 20.0, 40.0])
def test_snr_matches_the_noise_added(snr: float):
    rng = np.random.default_rng(int(snr))
    a = _tone(2.0, 300, rng)
    noise = rng.standard_normal(len(a))
    noise *= np.sqrt(np.sum(a.astype(np.float64) ** 2) / np.sum(noise**2) / 10 ** (snr / 10))
    m = pair_metrics(a, (a + noise).astype(np.float32), SR)
    assert m["snr_db"] == pytest.approx(snr, abs=0.1)
    assert m["mel_lsd_db"] > 0
    assert m["correlation"] == pytest.approx(1 / math.sqrt(1 + 10 ** (-snr / 10)), abs=0.01)


def test_spectral_distance_grows_with_spectral_difference_and_duration_ratio():
    rng = np.random.default_rng(3)
    a = _tone(1.0, 440, rng)
    near = pair_metrics(a, _tone(1.0, 450, rng), SR)["mel_lsd_db"]
    far = pair_metrics(a, _tone(1.0, 2000, rng), SR)["mel_lsd_db"]
    assert 0 < near < far
    assert pair_metrics(a, _tone(1.5, 440, rng), SR)["duration_ratio"] == pytest.approx(1.5)


def test_mel_filterbank_and_tone_peak():
    fb = mel_filterbank(SR)
    assert fb.shape == (80, 513) and (fb >= 0).all() and (fb.max(axis=1) > 0).all()
    mel = log_mel_db(_tone(0.5, 1000, np.random.default_rng(1)), SR)
    peak_band = int(np.argmax(mel.mean(axis=0)))
    centres = fb.argmax(axis=1) * SR / 1024
    assert abs(centres[peak_band] - 1000) < 150


def _ab_job(root: Path) -> JobDir:
    return make_ab_job(root)


def test_table_cells_keep_the_sign_of_an_infinity():
    row = {"snr_db": float("-inf"), "gain": float("inf"), "x": float("nan")}
    html = table([row], list(row))
    assert '<td class="n">-inf</td><td class="n">inf</td><td class="n"></td>' in html


def test_compare_variants_pairs_rows_by_id(tmp_path: Path):
    job = _ab_job(tmp_path)
    rows = compare_variants(job, "fp16", "w4a4")
    assert sorted(r["id"] for r in rows) == [f"u{i}" for i in range(5)]
    assert all(10 < r["snr_db"] < 40 and r["duration_ratio"] == 1.0 for r in rows)
    assert pq.read_table(job.report_dir / "compare.parquet").num_rows == 5


def test_compare_parquet_keeps_every_pair_of_the_job(tmp_path: Path):
    job = _ab_job(tmp_path)
    compare_variants(job, "fp16", "w4a4")
    compare_variants(job, "w4a4", "fp16")
    compare_variants(job, "fp16", "w4a4")  # a pair compared again replaces its own rows
    table = pq.read_table(job.report_dir / "compare.parquet").to_pylist()
    pairs = sorted((r["variant_a"], r["variant_b"], r["id"]) for r in table)
    assert pairs == sorted((a, b, f"u{i}") for a, b in (("fp16", "w4a4"), ("w4a4", "fp16")) for i in range(5))


def test_report_has_tables_plots_and_players(tmp_path: Path):
    job = _ab_job(tmp_path)
    page = write_report(job).read_text()
    assert page.count("<svg") >= 4
    assert page.count("<audio") == 10  # 5 rows x (A, B)
    assert 'src="audio/w4a4/u0.wav"' in page and (job.report_dir / "audio/w4a4/u0.wav").is_file()
    assert "A/B: w4a4 against fp16" in page
    ab = json.loads((job.report_dir / "ab.json").read_text())
    assert ab[0]["rows"] == 5 and ab[0]["metrics"]["snr_db"]["median"] > 10


def test_rows_that_cannot_be_compared_are_marked_and_the_report_is_still_written(tmp_path: Path):
    job = _ab_job(tmp_path)
    write_wav_atomic(job.wav_path("w4a4", "u1"), np.zeros(0, np.float32), SR)  # zero samples
    write_wav_atomic(job.wav_path("fp16", "u3"), _tone(0.5, 300, np.random.default_rng(9)), 16000)
    job.wav_path("w4a4", "u4").unlink()
    rows = {r["id"]: r for r in compare_variants(job, "fp16", "w4a4")}
    assert sorted(rows) == [f"u{i}" for i in range(5)]
    assert rows["u1"]["comparable"] is False and "w4a4 wav holds no samples" in rows["u1"]["reason"]
    assert rows["u3"]["comparable"] is False and "16000 Hz" in rows["u3"]["reason"]
    assert rows["u4"]["comparable"] is False and "w4a4 wav cannot be read" in rows["u4"]["reason"]
    for i in ("u1", "u3", "u4"):
        assert all(rows[i][m] is None for m in ("duration_ratio", "mel_lsd_db", "snr_db", "correlation"))
    assert rows["u0"]["comparable"] and rows["u0"]["reason"] is None and 10 < rows["u0"]["snr_db"] < 40
    stored = pq.read_table(job.report_dir / "compare.parquet").to_pylist()
    assert sorted((r["id"], r["comparable"]) for r in stored) == [(f"u{i}", i in (0, 2)) for i in range(5)]

    page = write_report(job).read_text()
    assert "3 not comparable" in page and "w4a4 wav holds no samples" in page
    ab = json.loads((job.report_dir / "ab.json").read_text())[0]
    assert ab["rows"] == 5 and ab["metrics"]["snr_db"]["rows"] == 2
    assert math.isfinite(ab["metrics"]["snr_db"]["median"])
    assert sorted(r["id"] for r in ab["not_comparable"]) == ["u1", "u3", "u4"]


def test_a_pair_with_no_comparable_row_still_gets_its_section(tmp_path: Path):
    job = _ab_job(tmp_path)
    for i in range(5):
        write_wav_atomic(job.wav_path("w4a4", f"u{i}"), np.zeros(0, np.float32), SR)
    page = write_report(job).read_text()
    assert "A/B: w4a4 against fp16 (5 rows ok in both, 5 not comparable)" in page
    ab = json.loads((job.report_dir / "ab.json").read_text())[0]
    assert ab["metrics"]["mel_lsd_db"] == {"rows": 0} and len(ab["not_comparable"]) == 5


def test_pair_metrics_refuses_an_empty_waveform_by_name():
    with pytest.raises(OVBatchError, match="holds no samples"):
        pair_metrics(np.zeros(0, np.float32), np.ones(10, np.float32), SR)


def _single_variant_job(root: Path) -> JobDir:
    job = _ab_job(root)
    plan = job.read_plan()
    plan.variants, plan.shards = ["fp16"], plan.shards[:1]
    job.write_plan(plan)
    job.shard_result_path(1).unlink()
    return job


def test_single_variant_report_lists_samples_without_ab(tmp_path: Path):
    page = write_report(_single_variant_job(tmp_path)).read_text()
    assert "<h2>Samples</h2>" in page and page.count("<audio") == 5
    assert "A/B" not in page and not (tmp_path / "report" / "ab.json").exists()


def test_ab_job_through_the_real_engine(tmp_path: Path, tmp_path_factory):
    """Two variants (fp32, bf16 on the CPU) of the tiny checkpoint, same rows and seeds, local mode."""
    import pyarrow as pa

    from engine.tiny import ensure_tiny_checkpoint
    from pipeline.config import load_job_config
    from pipeline.job import submit
    from pipeline.sizing import frontend_sizer

    data = Path(__file__).parent / "data"
    clips = json.loads((data / "clips.json").read_text())
    clip = "en_16k_mono.wav"
    table = pa.table(
        {
            "id": ["a", "b", "c"],
            "text": ["Hello there.", "Thank you.", "Good night."],
            "ref_audio": [str(data / clip)] * 3,
            "ref_text": [clips[clip]["transcript"]] * 3,
        }
    )
    pq.write_table(table, tmp_path / "m.parquet")
    cfg = load_job_config(
        None,
        [
            f"manifest={tmp_path / 'm.parquet'}",
            f"engine.checkpoint={ensure_tiny_checkpoint()}",
            "local=true",
            "engine.device=cpu",
            "engine.generation.num_step=4",
            "progress=false",
            f"engine.prompt_cache_dir={tmp_path_factory.getbasetemp() / 'ovbatch-prompts'}",
            "variants.fp32.precision=fp32",
            "variants.bf16.precision=bf16",
        ],
    )
    outcome = submit(cfg, tmp_path / "job", frontend_sizer)
    results = outcome.job.read_results().to_pylist()
    assert sorted((r["variant"], r["id"], r["status"], r["precision"]) for r in results) == [
        (v, i, "ok", v) for v in ("bf16", "fp32") for i in "abc"
    ]
    keys = {(r["variant"], r["id"]): r["row_key"] for r in results}
    assert all(keys[("fp32", i)] != keys[("bf16", i)] for i in "abc")
    wavs = outcome.job.path / "wavs"
    assert all((wavs / v / f"{i}.wav").is_file() for v in ("fp32", "bf16") for i in "abc")
    ab = json.loads((outcome.job.report_dir / "ab.json").read_text())
    assert ab[0]["variant_a"] == "fp32" and ab[0]["variant_b"] == "bf16" and ab[0]["rows"] == 3
    assert all(math.isfinite(ab[0]["metrics"][m]["median"]) for m in ("duration_ratio", "mel_lsd_db"))
    assert all(
        (outcome.job.path / "tokens" / v / f"{i}.npy").is_file() for v in ("fp32", "bf16") for i in "abc"
    )
    assert ab[0]["token_rows"] == 3 and len(ab[0]["token_agreement"]["per_codebook"]) == 8
    assert 0 <= ab[0]["token_agreement"]["all"] <= 1
    assert "A/B: bf16 against fp32" in (outcome.job.report_dir / "index.html").read_text()


def test_demo_ab_runs_float32_against_w4a4(tmp_path: Path):
    """`ovbatch demo --ab`: the tiny checkpoint quantized to W4A4 once, both variants over the demo rows."""
    from pipeline.demo import DEMO_ROWS, run_demo

    outcome = run_demo(
        tmp_path / "job", local=True, overrides=["engine.generation.num_step=4", "progress=false"], ab=True
    )
    results = outcome.job.read_results().to_pylist()
    assert sorted({(r["variant"], r["precision"]) for r in results}) == [("fp32", "fp32"), ("w4a4", "w4a4")]
    assert [r["status"] for r in results] == ["ok"] * (2 * DEMO_ROWS)
    ab = json.loads((outcome.job.report_dir / "ab.json").read_text())
    assert ab[0]["variant_a"] == "fp32" and ab[0]["variant_b"] == "w4a4" and ab[0]["rows"] == DEMO_ROWS
