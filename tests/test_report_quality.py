"""The report's model metrics (WER/CER from speech recognition, speaker similarity from x-vectors) wired
through randomly initialised tiny transformers models saved to a folder, and the A/B report over more than
two variants."""

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from ab_job import SR, TEXTS, make_ab_job
from tiny_models import tiny_wavlm_xvector, tiny_whisper

from engine.errors import InputError
from pipeline.atomic import write_wav_atomic
from pipeline.config import CompareConfig, load_job_config
from pipeline.quality import QUALITY_FILE, measure
from pipeline.report import write_report
from pipeline.wer import error_counts

VARIANTS = ("fp16", "fp8", "w4a4")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> CompareConfig:
    root = tmp_path_factory.mktemp("models")
    return CompareConfig(
        asr_model=str(tiny_whisper(root / "whisper")),
        speaker_model=str(tiny_wavlm_xvector(root / "wavlm")),
        device="cpu",
        batch_size=2,
    )


def test_measure_transcribes_and_embeds_every_ok_row_of_every_variant(tmp_path: Path, models: CompareConfig):
    job = make_ab_job(tmp_path, variants=VARIANTS, rows=3)
    quality = measure(job, models, [r for r in job.read_results().to_pylist() if r["status"] == "ok"])
    assert quality.notes == [] and sorted(quality.rows) == sorted(
        (v, f"u{i}") for v in VARIANTS for i in range(3)
    )
    for (_, row_id), rec in quality.rows.items():
        text = TEXTS[int(row_id[1:])]
        assert isinstance(rec["transcript"], str) and rec["asr_model"] == models.asr_model
        counts = error_counts(text, rec["transcript"])
        assert (rec["word_errors"], rec["ref_words"]) == (counts.word_errors, counts.ref_words)
        assert rec["wer"] == pytest.approx(counts.wer) and rec["cer"] == pytest.approx(counts.cer)
        assert -1.0 <= rec["speaker_sim"] <= 1.0 and rec["speaker_model"] == models.speaker_model
        assert rec["problem"] is None
    stored = pq.read_table(job.report_dir / QUALITY_FILE).to_pylist()
    assert len(stored) == 9 and all(r["transcript"] is not None for r in stored)


def test_a_report_written_again_reuses_what_the_same_models_measured(tmp_path: Path, models: CompareConfig):
    job = make_ab_job(tmp_path, rows=2)
    ok = [r for r in job.read_results().to_pylist() if r["status"] == "ok"]
    first = measure(job, models, ok)
    speaker_only = measure(job, CompareConfig(speaker_model=models.speaker_model, device="cpu"), ok)
    assert all(r["transcript"] is None and r["wer"] is None for r in speaker_only.rows.values())
    moved = Path(models.asr_model).rename(Path(models.asr_model).with_suffix(".away"))
    try:  # with the speech model gone, only what the file kept can give the same transcripts
        again = measure(job, models, ok)
    finally:
        moved.rename(models.asr_model)
    assert again.notes == []
    for key, rec in first.rows.items():
        assert again.rows[key]["transcript"] == rec["transcript"] and again.rows[key]["wer"] == rec["wer"]
    other = measure(job, CompareConfig(asr_model=str(tmp_path / "no-such-model"), device="cpu"), ok)
    assert len(other.notes) == 1 and "no-such-model" in other.notes[0]
    assert all(r["transcript"] is None for r in other.rows.values())  # not another model's transcript


def test_the_a_b_report_over_three_variants_shows_every_metric(tmp_path: Path, models: CompareConfig):
    job = make_ab_job(tmp_path, variants=VARIANTS, rows=3, tokens=True)
    page = write_report(job, models).read_text()
    for b in VARIANTS[1:]:
        assert f"A/B: {b} against fp16 (3 rows ok in both)" in page
    assert "Each variant against fp16" in page and "Intelligibility and speaker similarity" in page
    assert "Not measured" not in page
    assert page.count("Token agreement per codebook (3 rows,") == 2
    ab = json.loads((job.report_dir / "ab.json").read_text())
    assert [(p["variant_a"], p["variant_b"]) for p in ab] == [("fp16", "fp8"), ("fp16", "w4a4")]
    for pair in ab:
        assert pair["not_measured"] == [] and pair["token_agreement"]["all"] > 0
        for v in (pair["variant_a"], pair["variant_b"]):
            q = pair["quality"][v]
            assert q["wer_rows"] == 3 and q["sim_rows"] == 3 and math.isfinite(q["wer"])
    pairs = {
        (r["variant_a"], r["variant_b"])
        for r in pq.read_table(job.report_dir / "compare.parquet").to_pylist()
    }
    assert pairs == {("fp16", "fp8"), ("fp16", "w4a4")}


def test_without_models_the_report_says_what_is_missing_and_how_to_get_it(tmp_path: Path):
    job = make_ab_job(tmp_path)
    page = write_report(job, CompareConfig()).read_text()
    assert "Not measured" in page
    assert "intelligibility (WER/CER): not measured; set compare.asr_model" in page
    assert "speaker similarity: not measured; set compare.speaker_model" in page
    assert (
        "Intelligibility and speaker similarity" not in page and not (job.report_dir / QUALITY_FILE).exists()
    )
    ab = json.loads((job.report_dir / "ab.json").read_text())[0]
    assert len(ab["not_measured"]) == 3  # the two models, and the codes this job never kept
    assert ab["token_agreement"] is None and ab["quality"]["w4a4"]["wer"] is None


def test_a_model_that_cannot_load_is_named_in_the_report(tmp_path: Path):
    job = make_ab_job(tmp_path)
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    page = write_report(job, CompareConfig(speaker_model=str(bad), device="cpu")).read_text()
    assert (
        f"speaker similarity not measured: compare.speaker_model=&#x27;{bad}&#x27; cannot be loaded" in page
    )


def test_rows_whose_audio_cannot_be_read_are_listed_not_fatal(tmp_path: Path, models: CompareConfig):
    job = make_ab_job(tmp_path, rows=2)
    job.wav_path("w4a4", "u1").write_bytes(b"RIFF, cut off")
    rows = job.read_rows()
    rows["u0"].ref_audio = str(tmp_path / "missing.wav")
    job.write_rows(list(rows.values()))
    ok = [r for r in job.read_results().to_pylist() if r["status"] == "ok"]
    quality = measure(job, models, ok)
    assert "the wav cannot be read" in quality.rows[("w4a4", "u1")]["problem"]
    assert quality.rows[("w4a4", "u1")]["transcript"] is None
    assert "reference clip cannot be read" in quality.rows[("fp16", "u0")]["problem"]
    assert quality.rows[("fp16", "u0")]["speaker_sim"] is None and quality.rows[("fp16", "u0")]["transcript"]
    assert quality.rows[("fp16", "u1")]["speaker_sim"] is not None


def test_compare_settings_are_checked_by_name():
    cfg = load_job_config(None, ["compare.asr_model=openai/whisper-small", "compare.batch_size=4"])
    assert cfg.compare.asr_model == "openai/whisper-small" and cfg.compare.speaker_model is None
    with pytest.raises(InputError, match=r"compare.batch_size=0"):
        load_job_config(None, ["compare.batch_size=0"])
    with pytest.raises(InputError, match=r"compare.audio='inline': choose link, copy or embed"):
        load_job_config(None, ["compare.audio=inline"])
    ab = load_job_config(Path(__file__).parents[1] / "jobs" / "ab.yaml")
    assert (
        ab.compare.asr_model is None
        and ab.compare.speaker_model is None
        and ab.variant_names() == ["fp16", "fp8", "w4a4"]
    )


def _strict_json(path: Path):
    def refuse(constant: str):
        raise ValueError(f"{path.name} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_clips_too_short_for_the_speaker_model_are_named_and_keep_nan_out(
    tmp_path: Path, models: CompareConfig
):
    # An x-vector pools statistics over frames: a few milliseconds of audio gave a NaN embedding in a padded
    # batch (the variant's mean similarity NaN, ab.json not JSON) and failed alone (every row unmeasured).
    job = make_ab_job(tmp_path, rows=3)
    write_wav_atomic(job.wav_path("w4a4", "u2"), np.full(100, 0.1, np.float32), SR)
    speaker = CompareConfig(speaker_model=models.speaker_model, device="cpu")
    page = write_report(job, speaker).read_text()
    quality = _strict_json(job.report_dir / "ab.json")[0]["quality"]["w4a4"]
    assert quality["sim_rows"] == 2 and math.isfinite(quality["speaker_sim"])
    assert "<td>u2</td><td>w4a4</td><td>no speaker similarity: the speaker model" in page
    ok = [r for r in job.read_results().to_pylist() if r["status"] == "ok"]
    again = measure(job, speaker, ok)  # u2 alone is measured again: a batch of one short clip
    assert again.notes == [] and again.rows[("w4a4", "u2")]["speaker_sim"] is None
    assert "cannot embed it" in again.rows[("w4a4", "u2")]["problem"]
    assert "the wav holds 0.00 s" in again.rows[("w4a4", "u2")]["problem"]
    assert all(again.rows[(v, f"u{i}")]["speaker_sim"] is not None for v in ("fp16", "w4a4") for i in (0, 1))

    short = tmp_path / "short-reference.wav"
    write_wav_atomic(short, np.full(100, 0.1, np.float32), SR)
    rows = job.read_rows()
    rows["u0"].ref_audio = str(short)
    job.write_rows(list(rows.values()))
    (job.report_dir / QUALITY_FILE).unlink()
    again = measure(job, speaker, ok)
    assert again.notes == [] and "for the reference clip" in again.rows[("fp16", "u0")]["problem"]
    assert again.rows[("fp16", "u0")]["speaker_sim"] is None and again.rows[("fp16", "u1")]["speaker_sim"]


def test_a_nan_speaker_similarity_kept_from_before_is_measured_again(tmp_path: Path, models: CompareConfig):
    """quality.parquet files written before short clips were named could hold NaN: such a value is not a
    measurement, so the next report measures the row again instead of serving NaN forever."""
    job = make_ab_job(tmp_path, rows=2)
    ok = [r for r in job.read_results().to_pylist() if r["status"] == "ok"]
    speaker = CompareConfig(speaker_model=models.speaker_model, device="cpu")
    first = measure(job, speaker, ok)
    stored = pq.read_table(job.report_dir / QUALITY_FILE)
    rows = stored.to_pylist()
    rows[0]["speaker_sim"] = float("nan")
    pq.write_table(pa.Table.from_pylist(rows, schema=stored.schema), job.report_dir / QUALITY_FILE)
    again = measure(job, speaker, ok)
    key = (rows[0]["variant"], rows[0]["id"])
    assert math.isfinite(again.rows[key]["speaker_sim"]) and -1.0 <= again.rows[key]["speaker_sim"] <= 1.0
    others = [k for k in first.rows if k != key]  # kept, not measured again
    assert [again.rows[k]["speaker_sim"] for k in others] == [first.rows[k]["speaker_sim"] for k in others]


def test_a_clip_too_short_for_the_speech_model_is_named_and_the_others_transcribed(
    tmp_path: Path, models: CompareConfig, monkeypatch
):
    """A CTC speech model (wav2vec 2) refuses a clip shorter than its convolutions, and the refusal failed the
    batch, so speech recognition failed for the whole job. Here the tiny Whisper's pipeline refuses clips
    under 400 samples the way such a model does."""
    from pipeline import quality

    made = quality.Transcriber.__init__

    def refusing_short_clips(self, *args, **kwargs):
        made(self, *args, **kwargs)
        pipe = self.pipe

        def run(clips, **kw):
            if any(len(c) < 400 for c in clips):
                raise RuntimeError("Calculated padded input size per channel: (1). Kernel size: (10).")
            return pipe(clips, **kw)

        self.pipe = run

    monkeypatch.setattr(quality.Transcriber, "__init__", refusing_short_clips)
    job = make_ab_job(tmp_path, rows=3)
    write_wav_atomic(job.wav_path("w4a4", "u2"), np.full(100, 0.1, np.float32), SR)
    asr = CompareConfig(asr_model=models.asr_model, device="cpu", batch_size=8)
    ok = [r for r in job.read_results().to_pylist() if r["status"] == "ok"]
    measured = measure(job, asr, ok)
    assert measured.notes == []
    short = measured.rows[("w4a4", "u2")]
    assert (
        short["transcript"] is None
        and "no transcript: the speech model cannot transcribe it" in short["problem"]
    )
    assert "the wav holds 0.00 s" in short["problem"]
    assert all(rec["transcript"] is not None for key, rec in measured.rows.items() if key != ("w4a4", "u2"))
