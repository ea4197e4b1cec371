"""The generated audio codes kept per row (JOB/tokens) and the A/B report's token agreement per codebook."""

import json
from pathlib import Path

import numpy as np
import pytest
from ab_job import CODEBOOKS, changed_mask, codes, make_ab_job

from engine.api import SynthResult
from pipeline.compare import compare_variants
from pipeline.config import load_job_config
from pipeline.manifest import ManifestRow
from pipeline.plan import PlannedRow
from pipeline.report import write_report
from pipeline.rows import RequestRow
from pipeline.shard_runner import ShardRunner, ShardTask
from pipeline.store import JobDir
from pipeline.tokens import agreement, read_tokens, tokens_path, write_tokens


class CodesEngine:
    """A stand-in engine whose results carry codes (as engine.api.Engine's do) or not (`with_codes`)."""

    sample_rate, model_id, precision, device = 8000, "fake@0", "fp32", None
    with_codes = True

    def __init__(self, cfg):
        self.cfg = cfg

    def synthesize(self, reqs):
        out = []
        for r in reqs:
            frames = 4 + len(r.text)
            grid = np.random.default_rng(r.seed).integers(0, 1025, (CODEBOOKS, frames))
            audio = np.full(frames * 320, 0.1, np.float32)
            result = SynthResult(audio, self.sample_rate, frames, token_work=frames)
            result.tokens = grid if self.with_codes else None
            out.append(result)
        return out


def _row(i: int) -> RequestRow:
    row = ManifestRow(row_index=i, id=f"r{i}", text=f"row {i}", ref_audio=None, ref_text=None, seed=i)
    return RequestRow.of(row, PlannedRow(row.id, f"k{i}", 40, 10))


@pytest.mark.parametrize("with_codes", [True, False])
def test_the_shard_runner_keeps_each_rows_codes_beside_its_wav(tmp_path: Path, with_codes: bool):
    CodesEngine.with_codes = with_codes
    cfg = load_job_config(None, ["local=true", f"engine_factory={__name__}:CodesEngine", "progress=false"])
    results = ShardRunner(tmp_path, cfg).run_shard(ShardTask(0, "default", 64, 1, [_row(0), _row(1)]))
    job = JobDir(tmp_path)
    assert [r.status for r in results] == ["ok", "ok"]
    for i in range(2):
        kept = read_tokens(job, "default", f"r{i}")
        if not with_codes:
            assert kept is None and not tokens_path(job, "default", f"r{i}").exists()
            continue
        want = np.random.default_rng(i).integers(0, 1025, (CODEBOOKS, 4 + len(f"row {i}")))
        assert kept.dtype == np.int16 and np.array_equal(kept, want)
        assert tokens_path(job, "default", f"r{i}") == tmp_path / "tokens" / "default" / f"r{i}.npy"


def test_codes_round_trip_small_and_refuse_what_is_not_a_code_grid(tmp_path: Path):
    job = JobDir(tmp_path)
    grid = np.arange(16, dtype=np.int64).reshape(2, 8) * 1000
    write_tokens(job, "a", "x", grid)
    assert np.array_equal(read_tokens(job, "a", "x"), grid) and read_tokens(job, "a", "x").dtype == np.int16
    write_tokens(job, "a", "big", grid * 100)  # past int16: kept whole
    assert np.array_equal(read_tokens(job, "a", "big"), grid * 100)
    assert tokens_path(job, "a", "x").stat().st_size < 16 * 2 + 200
    with pytest.raises(ValueError, match="integers"):
        write_tokens(job, "a", "y", np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"\[codebooks, frames\]"):
        write_tokens(job, "a", "y", np.zeros(5, np.int64))
    assert read_tokens(job, "a", "never") is None


def test_agreement_counts_equal_codes_per_codebook_over_the_common_frames():
    a = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    b = np.array([[1, 0, 3], [0, 0, 7]])
    same, frames = agreement(a, b)
    assert frames == 3 and same.tolist() == [2, 1]
    with pytest.raises(ValueError, match="same codebooks"):
        agreement(a, b[:1])


def test_compare_rows_carry_token_agreement_per_codebook(tmp_path: Path):
    job = make_ab_job(tmp_path, tokens=True)
    rows = {r["id"]: r for r in compare_variants(job, "fp16", "w4a4")}
    for n in range(5):
        frames = codes(n, 25 + n).shape[1]
        want = (~changed_mask(1, (CODEBOOKS, frames))).sum(axis=1)
        r = rows[f"u{n}"]
        assert r["token_frames"] == frames and r["token_same"] == want.tolist()
        assert r["token_agreement"] == pytest.approx(want.sum() / (CODEBOOKS * frames))


def test_report_shows_token_agreement_per_codebook_and_says_when_codes_are_missing(tmp_path: Path):
    job = make_ab_job(tmp_path, tokens=True)
    tokens_path(job, "w4a4", "u3").unlink()  # a row run before codes were kept
    page = write_report(job).read_text()
    assert "Token agreement per codebook (4 rows," in page
    assert "1 of 5 rows have no kept codes in both variants" in page
    ab = json.loads((job.report_dir / "ab.json").read_text())[0]
    kept = [n for n in range(5) if n != 3]
    frames = sum(25 + n for n in kept)
    same = sum((~changed_mask(1, (CODEBOOKS, 25 + n))).sum(axis=1) for n in kept)
    assert ab["token_rows"] == 4
    assert ab["token_agreement"]["per_codebook"] == pytest.approx((same / frames).tolist())
    assert ab["metrics"]["token_agreement"]["rows"] == 4
    assert any("no kept codes" in n for n in ab["not_measured"])


def test_real_engine_results_carry_their_codes():
    """engine.api.Engine on the tiny checkpoint: SynthResult.tokens is the grid its audio was decoded from."""
    from engine.api import Engine, SynthRequest
    from engine.config import EngineConfig, GenerationConfig

    engine = Engine(EngineConfig(device="cpu", generation=GenerationConfig(num_step=2)))
    (out,) = engine.synthesize([SynthRequest(text="Hello there.", language="en", seed=3)])
    assert out.tokens.shape == (CODEBOOKS, out.target_frames) and out.tokens.dtype == np.int64
    assert 0 <= out.tokens.min() and out.tokens.max() < 1025
