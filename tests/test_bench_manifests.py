"""The distinct-clip manifests the planning and end-to-end benchmarks run on."""

import hashlib

import soundfile as sf

from bench.manifests import RATES, write_distinct_clip_manifest
from pipeline.manifest import load


def test_every_row_gets_its_own_readable_clip_of_3_to_10_seconds(tmp_path):
    path = write_distinct_clip_manifest(tmp_path / "m.parquet", tmp_path / "clips", rows=12, seed=3)
    manifest = load(path)
    assert not manifest.rejected and len(manifest.rows) == 12
    clips = [row.ref_audio for row in manifest.rows]
    assert len({hashlib.sha256(open(c, "rb").read()).hexdigest() for c in clips}) == 12
    for clip in clips:
        info = sf.info(clip)
        assert info.samplerate in RATES and 3.0 <= info.duration <= 10.0 + 1.0 / info.samplerate
    assert all(row.text and row.ref_text for row in manifest.rows)
    again = load(
        write_distinct_clip_manifest(tmp_path / "again.parquet", tmp_path / "again", rows=12, seed=3)
    )
    for a, b in zip(manifest.rows, again.rows, strict=True):  # the same files, whichever process wrote them
        assert open(a.ref_audio, "rb").read() == open(b.ref_audio, "rb").read() and a.text == b.text
