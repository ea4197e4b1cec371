"""A/B metrics between two variants' wavs of the same rows (same text, reference and seed).

Per row, on the two waveforms:
  duration_ratio  B seconds / A seconds
  mel_lsd_db      log-spectral distance of 80-band log-mel spectra (dB): per frame the RMS over bands of
                  the dB difference, averaged over the frames both clips have (0 = identical spectra)
  snr_db          10 log10(sum a^2 / sum (a - b)^2) over the common length (inf when identical)
  correlation     Pearson correlation of the waveforms over the common length
A row whose two wavs cannot be compared (one unreadable or empty, sample rates differ) keeps its place with
comparable=False, the reason, and no metrics.

Per row, on the two variants' generated audio codes (JOB/tokens, pipeline.tokens), when both are kept:
  token_same       per codebook, the frames where both chose the same code (over the frames both have)
  token_frames     the frames compared
  token_agreement  sum(token_same) / (codebooks x token_frames)
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

from engine.errors import OVBatchError
from pipeline.atomic import write_parquet_atomic
from pipeline.messages import first_line
from pipeline.store import JobDir
from pipeline.tokens import agreement, read_tokens

N_FFT = 1024
HOP = 256
N_MELS = 80
DB_FLOOR = -100.0
METRICS = ("duration_ratio", "mel_lsd_db", "snr_db", "correlation")
TOKEN_METRICS = ("token_agreement", "token_frames", "token_same")


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + f / 700.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


@lru_cache(maxsize=8)
def mel_filterbank(sample_rate: int, n_fft: int = N_FFT, n_mels: int = N_MELS) -> np.ndarray:
    """Triangular filters on the HTK mel scale, [n_mels, n_fft // 2 + 1]."""
    bins = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    edges = _mel_to_hz(np.linspace(0.0, _hz_to_mel(np.array(sample_rate / 2.0)), n_mels + 2))
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins[None, :] - lo) / np.maximum(mid - lo, 1e-9)
    falling = (hi - bins[None, :]) / np.maximum(hi - mid, 1e-9)
    return np.clip(np.minimum(rising, falling), 0.0, None).astype(np.float32)


def log_mel_db(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """[frames, n_mels] log-mel power in dB (Hann window, N_FFT / HOP framing, zero-padded to one frame)."""
    audio = np.asarray(audio, dtype=np.float32)
    if len(audio) < N_FFT:
        audio = np.pad(audio, (0, N_FFT - len(audio)))
    frames = np.lib.stride_tricks.sliding_window_view(audio, N_FFT)[::HOP]
    power = np.abs(np.fft.rfft(frames * np.hanning(N_FFT).astype(np.float32), axis=1)) ** 2
    mel = power @ mel_filterbank(sample_rate).T
    return np.maximum(10.0 * np.log10(np.maximum(mel, 1e-10)), DB_FLOOR)


def pair_metrics(a: np.ndarray, b: np.ndarray, sample_rate: int) -> dict[str, float]:
    n = min(len(a), len(b))
    if n == 0:
        raise OVBatchError("cannot compare an empty waveform: one of the two wavs holds no samples.")
    ma, mb = log_mel_db(a, sample_rate), log_mel_db(b, sample_rate)
    frames = min(len(ma), len(mb))
    lsd = float(np.mean(np.sqrt(np.mean((ma[:frames] - mb[:frames]) ** 2, axis=1))))
    a64, b64 = a[:n].astype(np.float64), b[:n].astype(np.float64)
    noise = float(np.sum((a64 - b64) ** 2))
    signal = float(np.sum(a64**2))
    snr = math.inf if noise == 0 else (10.0 * math.log10(signal / noise) if signal > 0 else -math.inf)
    sa, sb = a64.std(), b64.std()
    corr = float(np.mean((a64 - a64.mean()) * (b64 - b64.mean())) / (sa * sb)) if sa > 0 and sb > 0 else 0.0
    return {
        "duration_ratio": len(b) / len(a) if len(a) else math.inf,
        "mel_lsd_db": lsd,
        "snr_db": snr,
        "correlation": corr,
    }


def _read(job: JobDir, rel: str) -> tuple[np.ndarray, int]:
    audio, sr = sf.read(job.path / rel, dtype="float32", always_2d=True)
    return audio[:, 0], sr


def _pair(job: JobDir, pair: list[tuple[str, str]]) -> tuple[dict[str, float | None], str | None]:
    """Metrics of one row's two wavs [(variant, wav path)] x 2, or no metrics and why they cannot be
    compared."""
    waves = []
    for variant, rel in pair:
        try:
            audio, sr = _read(job, rel)
        except (sf.SoundFileError, OSError) as e:
            return dict.fromkeys(METRICS), f"the {variant} wav cannot be read ({first_line(e)})"
        if len(audio) == 0:
            return dict.fromkeys(METRICS), f"the {variant} wav holds no samples"
        waves.append((audio, sr))
    (a, sr_a), (b, sr_b) = waves
    if sr_a != sr_b:
        return dict.fromkeys(METRICS), (
            f"the {pair[0][0]} wav is {sr_a} Hz and the {pair[1][0]} wav {sr_b} Hz: A/B variants must share "
            "the codec's sample rate"
        )
    return pair_metrics(a, b, sr_a), None


def token_metrics(job: JobDir, variant_a: str, variant_b: str, row_id: str) -> dict[str, Any]:
    """The row's code agreement between two variants; None values when either's codes are not kept (or
    the two do not have the same codebooks)."""
    try:
        a, b = read_tokens(job, variant_a, row_id), read_tokens(job, variant_b, row_id)
        same, frames = agreement(a, b) if a is not None and b is not None else (None, 0)
    except (OSError, ValueError):  # a torn or foreign file counts as not kept
        same, frames = None, 0
    if same is None:
        return dict.fromkeys(TOKEN_METRICS)
    return {
        "token_agreement": float(same.sum() / (len(same) * frames)) if frames else None,
        "token_frames": frames,
        "token_same": [int(n) for n in same],
    }


def compare_variants(job: JobDir, variant_a: str, variant_b: str) -> list[dict[str, Any]]:
    """One row per id ok in both variants (metrics, or comparable=False and the reason); written to
    report/compare.parquet beside the rows of the job's other pairs."""
    results = job.read_results().to_pylist()
    ok = {(r["variant"], r["id"]): r for r in results if r["status"] == "ok"}
    rows = []
    for (variant, row_id), ra in sorted(ok.items()):
        rb = ok.get((variant_b, row_id))
        if variant != variant_a or rb is None:
            continue
        metrics, reason = _pair(job, [(variant_a, ra["wav_path"]), (variant_b, rb["wav_path"])])
        rows.append(
            {
                "id": row_id,
                "variant_a": variant_a,
                "variant_b": variant_b,
                "bucket": ra["bucket"],
                "seconds_a": ra["audio_seconds"],
                "seconds_b": rb["audio_seconds"],
                "rtf_a": ra["rtf"],
                "rtf_b": rb["rtf"],
                "wav_a": ra["wav_path"],
                "wav_b": rb["wav_path"],
                "comparable": reason is None,
                "reason": reason,
                **metrics,
                **token_metrics(job, variant_a, variant_b, row_id),
            }
        )
    path = job.report_dir / "compare.parquet"
    # One file holds every pair the report compares (the first variant against each other one).
    earlier = pq.read_table(path).to_pylist() if path.is_file() else []
    pair = (variant_a, variant_b)
    everything = [r for r in earlier if (r.get("variant_a"), r.get("variant_b")) != pair] + rows
    table = pa.Table.from_pylist(everything) if everything else pa.table({"id": pa.array([], pa.string())})
    write_parquet_atomic(path, table)
    return rows
