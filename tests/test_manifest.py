"""Manifest loading: whole-manifest errors refuse the file; row problems reject only that row."""

import shutil
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.config import EngineConfig
from pipeline.manifest import (
    ManifestError,
    check_id,
    default_seed,
    engine_settings,
    load,
    resolve_location,
    row_key,
)

DATA = Path(__file__).parent / "data"
CLIP = "en_24k_mono.wav"
TRANSCRIPT = "The quick brown fox jumps over the lazy dog."


def _write(path: Path, **columns) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "clips").mkdir()
    shutil.copy(DATA / CLIP, tmp_path / "clips" / CLIP)
    shutil.copy(DATA / "en_16k_mono.wav", tmp_path / "clips" / "other.wav")
    (tmp_path / "clips" / "corrupt.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunkjunkjunk" * 8)
    (tmp_path / "clips" / "empty.wav").write_bytes(b"")
    return tmp_path


def test_good_rows_resolve_relative_clips_against_the_manifest_folder(workdir: Path):
    m = _write(
        workdir / "m.parquet",
        id=["a", "b"],
        text=["Hello.", "World, again."],
        ref_audio=[f"clips/{CLIP}", str(workdir / "clips" / "other.wav")],
        ref_text=[TRANSCRIPT, "Hi."],
        language=["en", "English"],
        speed=[None, 1.2],
        seed=[7, None],
    )
    out = load(m)
    assert out.rejected == []
    a, b = out.rows
    assert a.ref_audio == str(workdir / "clips" / CLIP)
    assert a.language == "en" and b.language == "en"
    assert a.seed == 7 and b.seed == default_seed("b")
    assert b.speed == pytest.approx(1.2)
    assert 2.0 < a.ref_seconds < 10.0
    assert a.clip_sha256 and a.clip_sha256 != b.clip_sha256


def test_manifest_as_a_file_uri(workdir: Path):
    m = _write(
        workdir / "m.parquet", id=["a"], text=["Hello."], ref_audio=[f"clips/{CLIP}"], ref_text=[TRANSCRIPT]
    )
    out = load(f"file://{m}")
    assert [r.id for r in out.rows] == ["a"]
    assert out.rows[0].ref_audio == str(workdir / "clips" / CLIP)


def test_columns_as_pandas_and_polars_write_them(workdir: Path):
    """Categoricals (dictionaries), string views, integer seeds with missing values (float64), a clip as a
    percent-encoded file:// URI, and a column the job does not read that does not convert to Python."""
    spaced = workdir / "my clips" / "a clip.wav"
    spaced.parent.mkdir()
    shutil.copy(DATA / CLIP, spaced)
    m = _write(
        workdir / "m.parquet",
        id=pa.array(["a", "b", "c", "d"], pa.string_view()),
        text=pa.array(["One.", "Two.", "Three.", "Four."]).dictionary_encode(),
        ref_audio=[spaced.as_uri()] * 4,
        ref_text=[TRANSCRIPT] * 4,
        language=pa.array(["en", None, "English", "en"]).dictionary_encode(),
        seed=[7.0, float("nan"), 2.5, float("inf")],
        recorded=pa.array([1, 2, 3, 4], pa.timestamp("ns")),  # 1 ns past the epoch: no Python datetime
    )
    out = load(m)
    assert [(r.id, r.text, r.language, r.seed) for r in out.rows] == [
        ("a", "One.", "en", 7),
        ("b", "Two.", None, default_seed("b")),
    ]
    assert all(r.ref_audio == str(spaced) for r in out.rows)
    assert [(r.id, r.reason) for r in out.rejected] == [
        ("c", "seed=2.5 must be a non-negative integer below 2**63, or null"),
        ("d", "seed=inf must be a non-negative integer below 2**63, or null"),
    ]


def test_resolve_location_handles_uris_and_relative_paths():
    assert resolve_location("x/y.wav", "s3://bucket/dir") == "s3://bucket/dir/x/y.wav"
    assert resolve_location("../y.wav", "gs://b/d/e") == "gs://b/d/y.wav"
    assert resolve_location("s3://other/z.wav", "/data") == "s3://other/z.wav"
    assert resolve_location("/abs/z.wav", "/data") == "/abs/z.wav"
    assert resolve_location("z.wav", "/data") == "/data/z.wav"


@pytest.mark.parametrize("columns, needle", [
    ({"id": ["a"], "text": ["t"], "ref_audio": ["x.wav"]}, "ref_text"),
    ({"id": [1], "text": ["t"], "ref_audio": ["x.wav"], "ref_text": ["r"]}, "'id' has type int64"),
    ({"id": ["a"], "text": ["t"], "ref_audio": ["x.wav"], "ref_text": ["r"], "speed": ["fast"]}, "'speed'"),
    ({"id": ["a"], "text": ["t"], "ref_audio": ["x.wav"], "ref_text": ["r"], "seed": ["7"]}, "'seed'.*Int64"),
])  # fmt: skip
def test_whole_manifest_problems_refuse_the_file(tmp_path: Path, columns, needle):
    m = _write(tmp_path / "m.parquet", **columns)
    with pytest.raises(ManifestError, match=needle):
        load(m)


def test_a_decimal_duration_column_is_refused_with_the_cast_that_fixes_it(tmp_path: Path):
    """A decimal is a number to its writer: the message says which types are taken and how to cast."""
    duration = pa.array([Decimal("2.50")], pa.decimal128(5, 2))
    columns = {"id": ["a"], "text": ["t"], "ref_audio": ["x.wav"], "ref_text": ["r"], "duration": duration}
    pq.write_table(pa.table(columns), tmp_path / "m.parquet")
    with pytest.raises(ManifestError, match=r"'duration' has type decimal128\(5, 2\).*astype\('float64'\)"):
        load(tmp_path / "m.parquet")


def test_unreadable_and_missing_manifests(tmp_path: Path):
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(ManifestError, match="not a readable Parquet file"):
        load(tmp_path / "bad.parquet")
    with pytest.raises(ManifestError, match="not found"):
        load(tmp_path / "nope.parquet")
    with pytest.raises(ManifestError, match="directory"):
        load(tmp_path)


ROW_PROBLEMS = [
    # id, text, ref_audio, ref_text, language, duration, speed, expected reason fragment (None = ok)
    ("ok1", "Fine text.", f"clips/{CLIP}", TRANSCRIPT, None, None, None, None),
    ("dup", "One.", f"clips/{CLIP}", TRANSCRIPT, None, None, None, "appears 2 times"),
    ("dup", "Two.", f"clips/{CLIP}", TRANSCRIPT, None, None, None, "appears 2 times"),
    ("empty", "   ", f"clips/{CLIP}", TRANSCRIPT, None, None, None, "text is empty"),
    ("missing", "Text.", "clips/nothere.wav", TRANSCRIPT, None, None, None, "not found"),
    ("folder", "Text.", "clips", TRANSCRIPT, None, None, None, "unreadable (Cannot open for reading"),
    ("corrupt", "Text.", "clips/corrupt.wav", TRANSCRIPT, None, None, None, "not a readable audio file"),
    ("zero", "Text.", "clips/empty.wav", TRANSCRIPT, None, None, None, "empty (0 bytes)"),
    ("../escape", "Text.", f"clips/{CLIP}", TRANSCRIPT, None, None, None, "path separator"),
    ("/abs", "Text.", f"clips/{CLIP}", TRANSCRIPT, None, None, None, "path separator"),
    ("..", "Text.", f"clips/{CLIP}", TRANSCRIPT, None, None, None, "starts with '.'"),
    ("bell\x07", "Text.", f"clips/{CLIP}", TRANSCRIPT, None, None, None, "invisible character U+0007"),
    ("lang", "Text.", f"clips/{CLIP}", TRANSCRIPT, "klingonish", None, None, "language 'klingonish'"),
    ("dur", "Text.", f"clips/{CLIP}", TRANSCRIPT, None, -2.0, None, "duration=-2.0"),
    ("speed", "Text.", f"clips/{CLIP}", TRANSCRIPT, None, None, 0.0, "speed=0.0"),
    ("noref", "Text.", f"clips/{CLIP}", "", None, None, None, "ref_text is empty"),
    ("ok2", "Also fine.", f"clips/{CLIP}", TRANSCRIPT, "en", 3.0, None, None),
]


def _row_problems_manifest(workdir: Path) -> Path:
    cols = list(zip(*ROW_PROBLEMS))
    return _write(
        workdir / "m.parquet",
        id=list(cols[0]),
        text=list(cols[1]),
        ref_audio=list(cols[2]),
        ref_text=list(cols[3]),
        language=pa.array(cols[4], pa.string()),
        duration=pa.array(cols[5], pa.float64()),
        speed=pa.array(cols[6], pa.float64()),
    )


def test_row_problems_reject_only_their_rows(workdir: Path):
    rows = ROW_PROBLEMS
    out = load(_row_problems_manifest(workdir))
    assert [r.id for r in out.rows] == ["ok1", "ok2"]
    by_index = {r.row_index: r for r in out.rejected}
    assert len(out.rejected) == len(rows) - 2
    for i, row in enumerate(rows):
        if row[-1] is None:
            continue
        assert row[-1] in by_index[i].reason, (row[0], by_index[i].reason)
    assert out.num_rows == len(rows)


def test_voice_design_rows_without_a_reference(workdir: Path):
    m = _write(
        workdir / "m.parquet",
        id=["design", "badstyle", "half"],
        text=["Hello."] * 3,
        ref_audio=pa.array([None, None, ""], pa.string()),
        ref_text=pa.array([None, None, "words"]),
        instruct=["female, low pitch", "purple voice", None],
    )
    out = load(m)
    assert [(r.id, r.ref_audio, r.instruct) for r in out.rows] == [("design", None, "female, low pitch")]
    reasons = {r.id: r.reason for r in out.rejected}
    assert "instruct 'purple voice' is not usable" in reasons["badstyle"]
    assert "ref_text is set but ref_audio is empty" in reasons["half"]


def test_check_id_accepts_ordinary_ids():
    for good in ("utt-001", "a.b", "Émile_3", "中文"):
        assert check_id(good) is None
    for bad in ("", None, 5, " lead", "x" * 300, "a\u200bb"):
        assert check_id(bad) is not None


def test_row_key_is_stable_and_tracks_inputs_and_engine_settings(workdir: Path):
    m = _write(
        workdir / "m.parquet",
        id=["a", "b"],
        text=["Same.", "Same."],
        ref_audio=[f"clips/{CLIP}"] * 2,
        ref_text=[TRANSCRIPT] * 2,
        seed=[1, 1],
    )
    a, b = load(m).rows
    a2 = load(m).rows[0]
    settings = engine_settings(EngineConfig())
    assert row_key(a, settings) == row_key(a2, settings)
    assert row_key(a, settings) == row_key(b, settings)  # same inputs and seed: same output expected
    assert row_key(a, settings) != row_key(a, engine_settings(EngineConfig(precision="fp16")))
    # run-only settings do not change what a row sounds like
    assert row_key(a, settings) == row_key(
        a, engine_settings(EngineConfig(max_batch_tokens=1024, device="cpu"))
    )
    a.text = "Different."
    assert row_key(a, settings) != row_key(b, settings)


def test_remote_clips_are_copied_once_into_the_job(workdir: Path, monkeypatch):
    from pipeline import manifest as manifest_mod

    data = (DATA / CLIP).read_bytes()
    reads: list[str] = []

    def fake_remote(location: str) -> bytes:  # stands in for pyarrow.fs.S3FileSystem
        reads.append(location)
        assert location == "s3://bucket/voices/anna.wav"
        return data

    monkeypatch.setattr(manifest_mod, "read_bytes", fake_remote)
    m = _write(
        workdir / "m.parquet",
        id=["a", "b"],
        text=["One.", "Two."],
        ref_audio=["s3://bucket/voices/anna.wav"] * 2,
        ref_text=[TRANSCRIPT] * 2,
    )
    checked = load(m)
    assert [r.ref_audio for r in checked.rows] == ["s3://bucket/voices/anna.wav"] * 2
    out = load(m, clip_dir=workdir / "job" / "clips")
    copies = list((workdir / "job" / "clips").iterdir())
    assert len(copies) == 1 and copies[0].read_bytes() == data and copies[0].suffix == ".wav"
    assert {r.ref_audio for r in out.rows} == {str(copies[0])}
    assert reads.count("s3://bucket/voices/anna.wav") == 2  # once per load, not once per row


def test_reference_length_limit_is_the_engines_max_ref_seconds(workdir: Path):
    m = _write(
        workdir / "m.parquet", id=["a"], text=["Hello."], ref_audio=[f"clips/{CLIP}"], ref_text=[TRANSCRIPT]
    )
    seconds = load(m).rows[0].ref_seconds
    assert [r.id for r in load(m, max_ref_seconds=seconds + 1).rows] == ["a"]
    (rejection,) = load(m, max_ref_seconds=seconds / 2).rejected
    assert rejection.id == "a" and f"over the {seconds / 2:g} s limit" in rejection.reason
