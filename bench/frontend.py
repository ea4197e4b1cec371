"""Reference-clip preparation: agreement with upstream OmniVoice's path and speed, per test clip.

Upstream resamples with torchaudio (windowed sinc); we resample with soxr (HQ). This script measures
how far the two prepared references are apart for every clip under tests/data, and how fast ours is.
Where the official `omnivoice` package is importable its functions are the reference; elsewhere the
reference is emulated with engine.resample (torchaudio's resampler, reproduced) and our pydub-exact
silence removal (tests/test_audio.py checks it against pydub).

    python bench/frontend.py [--out bench/results/frontend-cpu.json] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import soxr
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.environment import write_result  # noqa: E402
from engine.frontend import audio as A  # noqa: E402
from engine.resample import resample as sinc_resample  # noqa: E402

DATA = ROOT / "tests" / "data"
RATE, HOP = 24000, 960


def upstream_reference(path: Path) -> tuple[np.ndarray, np.ndarray, str]:
    """(resampled clip, prepared clip) as upstream's create_voice_clone_prompt makes them (transcript
    given, so no long-clip trimming)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from omnivoice.utils import audio as up
        wav = up.load_audio(str(path), RATE)[0]
        source = "omnivoice package"
    except ImportError:
        raw, rate = A.decode(path.read_bytes(), path.name)
        wav = sinc_resample(torch.from_numpy(raw), rate, RATE).numpy() if rate != RATE else raw
        up = None
        source = "emulated: engine.resample (torchaudio's sinc) + pydub-exact silence removal"
    resampled = wav
    rms = float(np.sqrt(np.mean(wav**2)))
    if 0 < rms < 0.1:
        wav = wav * 0.1 / rms
    if up is not None:
        wav = up.remove_silence(wav[None], RATE, mid_sil=200, lead_sil=100, trail_sil=200)[0]
    else:
        wav = A.remove_silence(wav, RATE, **A.REFERENCE_SILENCE)
    return resampled, wav[: len(wav) - len(wav) % HOP], source


def agreement(a: np.ndarray, b: np.ndarray) -> dict:
    n = min(len(a), len(b))
    diff = a[:n].astype(np.float64) - b[:n]
    power = float(np.mean(b[:n].astype(np.float64) ** 2))
    noise = float(np.mean(diff**2))
    return {
        "samples": [len(a), len(b)],
        "max_abs_diff": float(np.abs(diff).max()) if n else 0.0,
        "snr_db": 10 * np.log10(power / noise) if noise > 0 else float("inf"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "frontend-cpu.json"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    clips = json.loads((DATA / "clips.json").read_text())
    rows, source = {}, None
    for name, meta in clips.items():
        path = DATA / name
        ours = A.prepare_reference(path, RATE, HOP)
        raw, rate = A.decode(path.read_bytes(), name)
        ours_resampled = A.resample(raw, rate, RATE)
        ref_resampled, ref_prepared, source = upstream_reference(path)
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            A.prepare_reference(path, RATE, HOP)
            seconds.append(time.perf_counter() - start)
        median = statistics.median(seconds)
        rows[name] = {
            "rate": meta["rate"],
            "channels": meta["channels"],
            "resampled": agreement(ours_resampled, ref_resampled),
            "prepared": agreement(ours.audio, ref_prepared),
            "prepared_same_length": len(ours.audio) == len(ref_prepared),
            "prepare_median_s": median,
            "clip_seconds_per_second": len(raw) / rate / median,
        }
        print(f"{name:22s} {json.dumps(rows[name]['prepared'])} {median * 1e3:.1f} ms")

    result = {
        "what": "prepared reference clips vs upstream OmniVoice's preparation (soxr HQ vs torchaudio sinc)",
        "reference": source,
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "soxr": soxr.__version__,
        "torch": torch.__version__,
        "clips": rows,
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
