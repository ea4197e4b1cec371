"""Manifests whose rows each bring their own reference clip, for the planning and end-to-end benchmarks.

Real voice-clone manifests often give every row its own clip; the repo has six. Each clip here is made
from 1-3 of them: every piece starts at a random offset, the pieces are joined, scaled by a random
gain, cut to 3-10 s, and written as 16-bit wav at one of the common rates, so every file is distinct
(its own content hash) and planning or encoding can reuse nothing. The transcript joins the pieces'
transcripts (a cut clip ends mid-sentence: good enough to size a row, not to judge cloning). Texts to
speak (manifest_texts, also bench/scaling.py's) have log-normal speech lengths around 4 s (1-20 s).
"""

from __future__ import annotations

import math
import os
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

from engine.frontend.audio import decode, resample
from pipeline.demo import CLIPS_DIR, demo_clips

RATES = (16000, 22050, 24000, 44100, 48000)
SOURCE_RATE = 24000


def source_clips() -> list[tuple[np.ndarray, str]]:
    """The repo's speech clips at 24 kHz with their transcripts."""
    out = []
    for name, transcript in sorted(demo_clips().items()):
        audio, rate = decode((CLIPS_DIR / name).read_bytes(), name)
        out.append((resample(audio, rate, SOURCE_RATE), transcript))
    return out


def distinct_clip(sources: list[tuple[np.ndarray, str]], rng: random.Random) -> tuple[np.ndarray, int, str]:
    """(audio, rate, transcript) of one new clip of 3-10 s."""
    seconds = rng.uniform(3.0, 10.0)
    pieces, words = [], []
    while sum(len(p) for p in pieces) < seconds * SOURCE_RATE:
        audio, transcript = rng.choice(sources)
        pieces.append(audio[int(rng.uniform(0.0, 0.5) * SOURCE_RATE) :])
        words.append(transcript)
    clip = np.concatenate(pieces)[: int(seconds * SOURCE_RATE)] * rng.uniform(0.5, 1.5)
    rate = rng.choice(RATES)
    return np.clip(resample(clip.astype(np.float32), SOURCE_RATE, rate), -1.0, 1.0), rate, " ".join(words)


# Speech length of a row: log-normal around a 4 s median, clipped to [1, 20] s (about 1% of the draws
# below, 0.4% above); a text gets chars_per_second characters per second of it, which the engine's
# duration rule turns back into about the same seconds with the repo's clips (the JSON shows both).
LENGTHS = {"median_s": 4.0, "sigma": 0.6, "min_s": 1.0, "max_s": 20.0, "chars_per_second": 15}
PASSAGE = (
    "The morning ferry was late again, so we waited on the pier with our coffee and watched the gulls. "
    "Nobody minded much. A boy counted the boats out loud, and his sister corrected him every time he "
    "skipped a number. When the ferry finally came round the headland, the whole queue cheered as if it "
    "had won a race. On the crossing the wind picked up, the windows fogged, and an old man told us how "
    "the harbour looked before the new bridge was built. His stories were long, but the trip was longer. "
    "By noon we had reached the island, found the little bakery near the church, and bought more bread "
    "than four people could ever eat. Thank you, we said, and the baker laughed. Please come back soon."
)


def speech_seconds(rows: int, seed: int) -> list[float]:
    """The drawn speech length of every row (seconds), seeded."""
    rng = random.Random(seed)
    median, sigma = LENGTHS["median_s"], LENGTHS["sigma"]
    draws = (rng.lognormvariate(math.log(median), sigma) for _ in range(rows))
    return [min(max(s, LENGTHS["min_s"]), LENGTHS["max_s"]) for s in draws]


def text_of_length(chars: int, start: int) -> str:
    """Consecutive words of PASSAGE from word `start` (cycling) until `chars` characters, as one line
    that starts with a capital and ends with a full stop."""
    words = PASSAGE.split()
    picked: list[str] = []
    i = start
    while sum(len(w) + 1 for w in picked) <= chars:
        picked.append(words[i % len(words)])
        i += 1
    text = " ".join(picked).rstrip(",.")
    return text[0].upper() + text[1:] + "."


def manifest_texts(rows: int, seed: int) -> tuple[list[str], list[float]]:
    """Texts for `rows` rows and the speech seconds each was drawn for."""
    seconds = speech_seconds(rows, seed)
    starts = random.Random(seed + 1)
    n_words = len(PASSAGE.split())
    texts = [
        text_of_length(round(s * LENGTHS["chars_per_second"]), starts.randrange(n_words)) for s in seconds
    ]
    return texts, seconds


_sources: list[tuple[np.ndarray, str]] = []  # source_clips(), in each clip-writing process


def _load_sources() -> None:
    _sources[:] = source_clips()


def write_clip(clip: Path, seed: int, index: int) -> str:
    """Clip `index` of a manifest seeded `seed` (its own random stream, so any process makes the same
    file); returns its transcript."""
    audio, rate, transcript = distinct_clip(_sources, random.Random(f"{seed}-{index}"))
    sf.write(clip, audio, rate, subtype="PCM_16")
    return transcript


def write_distinct_clip_manifest(path: Path, clip_dir: Path, rows: int, seed: int = 0) -> Path:
    """A manifest of `rows` rows, each with its own clip file under clip_dir, the clips written by one
    process per core."""
    clip_dir.mkdir(parents=True, exist_ok=True)
    clips = [clip_dir / f"clip-{seed}-{i:06d}.wav" for i in range(rows)]
    with ProcessPoolExecutor(len(os.sched_getaffinity(0)), initializer=_load_sources) as pool:
        transcripts = list(pool.map(write_clip, clips, [seed] * rows, range(rows), chunksize=64))
    texts, _ = manifest_texts(rows, seed)
    table = pa.table(
        {
            "id": [f"row-{i:06d}" for i in range(rows)],
            "text": texts,
            "ref_audio": [str(c) for c in clips],
            "ref_text": transcripts,
            "language": ["en"] * rows,
        }
    )
    pq.write_table(table, path)
    return path
