"""report/ opens anywhere: its players reach audio inside report/ (hard links, copies) or inside the page."""

import base64
import re
import shutil
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest
from ab_job import make_ab_job

from pipeline import media
from pipeline.atomic import write_wav_atomic
from pipeline.config import CompareConfig
from pipeline.report import write_report


def _sources(page: str) -> list[str]:
    return re.findall(r'<audio controls preload="metadata" src="([^"]+)"', page)


@pytest.mark.parametrize("mode", ["link", "copy"])
def test_the_report_folder_alone_plays_every_player(tmp_path: Path, mode: str):
    job = make_ab_job(tmp_path / "job")
    write_report(job, CompareConfig(audio=mode))
    moved = shutil.copytree(job.report_dir, tmp_path / "elsewhere" / "report")
    shutil.rmtree(job.path)  # the job's wavs are gone: only what report/ holds can play
    sources = _sources((moved / "index.html").read_text())
    assert len(sources) == 10
    for src in sources:
        assert not src.startswith(("/", "..", "file:")) and (moved / unquote(src)).stat().st_size > 1000


def test_link_mode_hard_links_and_copy_mode_copies(tmp_path: Path):
    job = make_ab_job(tmp_path)
    wav, placed = job.wav_path("w4a4", "u0"), job.report_dir / "audio" / "w4a4" / "u0.wav"
    write_report(job, CompareConfig(audio="link"))
    assert placed.samefile(wav)
    write_report(job, CompareConfig(audio="copy"))
    assert not placed.samefile(wav) and placed.read_bytes() == wav.read_bytes()


def test_a_link_that_the_file_system_refuses_becomes_a_copy(tmp_path: Path, monkeypatch):
    def refuse(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(media.os, "link", refuse)
    job = make_ab_job(tmp_path)
    write_report(job, CompareConfig(audio="link"))
    placed = job.report_dir / "audio" / "fp16" / "u0.wav"
    assert placed.read_bytes() == job.wav_path("fp16", "u0").read_bytes() and placed.stat().st_nlink == 1


def test_embed_mode_puts_the_audio_in_the_page_and_no_files_beside_it(tmp_path: Path):
    job = make_ab_job(tmp_path)
    write_report(job, CompareConfig(audio="link"))
    assert (job.report_dir / "audio").is_dir()
    page = write_report(job, CompareConfig(audio="embed")).read_text()
    sources = _sources(page)
    assert len(sources) == 10 and all(s.startswith("data:audio/wav;base64,") for s in sources)
    assert base64.b64decode(sources[0].split(",", 1)[1])[:4] == b"RIFF"
    assert not (job.report_dir / "audio").exists()  # the files the link mode placed are gone


def test_audio_no_longer_played_is_removed_and_odd_ids_are_escaped(tmp_path: Path):
    job = make_ab_job(tmp_path, ids=["a b#1", "c%d", "plain"])
    page = write_report(job, CompareConfig()).read_text()
    assert 'src="audio/fp16/a%20b%231.wav"' in page and 'src="audio/fp16/c%25d.wav"' in page
    stale = job.report_dir / "audio" / "fp16" / "old-row.wav"
    stale.write_bytes(b"x")
    write_report(job, CompareConfig())
    assert not stale.exists() and (job.report_dir / "audio" / "fp16" / "plain.wav").is_file()


def test_a_replaced_wav_is_placed_again(tmp_path: Path):
    job = make_ab_job(tmp_path)
    write_report(job, CompareConfig(audio="copy"))
    write_wav_atomic(job.wav_path("fp16", "u0"), np.zeros(24000, np.float32), 24000)
    write_report(job, CompareConfig(audio="copy"))
    assert (job.report_dir / "audio/fp16/u0.wav").read_bytes() == job.wav_path("fp16", "u0").read_bytes()


def test_single_variant_samples_are_portable_too(tmp_path: Path):
    job = make_ab_job(tmp_path, variants=("default",))
    sources = _sources(write_report(job, CompareConfig()).read_text())
    assert len(sources) == 5 and all((job.report_dir / unquote(s)).is_file() for s in sources)


def test_ovbatch_report_takes_compare_settings_on_the_command_line(tmp_path: Path, capsys):
    from pipeline.cli import main

    job = make_ab_job(tmp_path)
    assert main(["report", str(job.path), "compare.audio=embed"]) == 0
    assert capsys.readouterr().out.strip() == str(job.report_dir / "index.html")
    assert all(s.startswith("data:") for s in _sources((job.report_dir / "index.html").read_text()))
    assert main(["report", str(job.path), "compare.audio=inline"]) == 2
    assert "compare.audio='inline': choose link, copy or embed" in capsys.readouterr().err
