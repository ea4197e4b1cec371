"""Manifests whose rows each bring their own reference clip, for the planning and end-to-end benchmarks.

Real voice-clone manifests often give every row its own clip; the repo has six. Each clip here is made
from 1-3 of them: every piece starts at a random offset, the pieces are joined, scaled by a random
gain, cut to 3-10 s, and written as 16-bit wav at one of the common rates, so every file is distinct
(its own content hash) and planning or encoding can reuse nothing. The transcript joins the pieces'
transcripts (a cut clip ends mid-sentence: good enough to size a row, not to judge cloning). Texts to
speak have log-normal target lengths around 4 s (1-20 s) at about 14 characters a second.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import soundfile as sf

from engine.frontend.audio import decode, resample
from pipeline.demo import CLIPS_DIR, demo_clips

RATES = (16000, 22050, 24000, 44100, 48000)
SOURCE_RATE = 24000
CHARS_PER_SECOND = 14.0
WORDS = (
    "the harbour was quiet before dawn and the boats rocked gently against the old stone pier while "
    "a fisherman counted his nets twice because the weather had turned twice in one night nobody on the "
    "island remembered a winter as mild as this one not even the oldest baker by noon the market filled "
    "with voices bargaining over apples wool and freshly smoked fish"
).split()


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


def target_text(rng: random.Random) -> str:
    seconds = min(20.0, max(1.0, rng.lognormvariate(math.log(4.0), 0.6)))
    words: list[str] = []
    while len(" ".join(words)) < seconds * CHARS_PER_SECOND:
        words.append(rng.choice(WORDS))
    return " ".join(words).capitalize() + "."


def write_distinct_clip_manifest(path: Path, clip_dir: Path, rows: int, seed: int = 0) -> Path:
    """A manifest of `rows` rows, each with its own clip file under clip_dir."""
    rng = random.Random(seed)
    sources = source_clips()
    clip_dir.mkdir(parents=True, exist_ok=True)
    clips, transcripts, texts = [], [], []
    for i in range(rows):
        audio, rate, transcript = distinct_clip(sources, rng)
        clip = clip_dir / f"clip-{seed}-{i:06d}.wav"
        sf.write(clip, audio, rate, subtype="PCM_16")
        clips.append(str(clip))
        transcripts.append(transcript)
        texts.append(target_text(rng))
    table = pa.table(
        {
            "id": [f"row-{i:06d}" for i in range(rows)],
            "text": texts,
            "ref_audio": clips,
            "ref_text": transcripts,
            "language": ["en"] * rows,
        }
    )
    pq.write_table(table, path)
    return path
