"""Bad job settings, and engine limits that make no sense, are refused before any work: one line on stderr
naming the value, exit 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import EXIT_ERROR, main


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "override, message",
    [
        ("variants.a=1", "variants.a=1: give it as a mapping of engine settings"),
        ("variants.a=[fp16]", "variants.a=['fp16']: give it as a mapping of engine settings"),
        ("variants=[1]", "'variants=[1]' gives a list where a mapping belongs, or the reverse"),
        ("engine.buckets={a:1}", "'engine.buckets={a:1}' gives a list where a mapping belongs"),
    ],
)
def test_a_setting_of_the_wrong_shape_is_one_line(tmp_path: Path, capsys, override: str, message: str):
    argv = ["submit", str(tmp_path / "m.parquet"), "--out", str(tmp_path / "j"), override]
    assert main(argv) == EXIT_ERROR
    assert message in _error_line(capsys)
    assert not (tmp_path / "j").exists()


def test_variants_of_the_wrong_shape_in_a_config_file_are_one_line(tmp_path: Path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text("variants:\n  fast: bf16\n")
    assert main(["manifest", "check", str(tmp_path / "m.parquet"), "--config", str(config)]) == EXIT_ERROR
    assert "variants.fast='bf16': give it as a mapping of engine settings" in _error_line(capsys)
    config.write_text("variants: [fp16, fp8]\n")
    assert main(["manifest", "check", str(tmp_path / "m.parquet"), "--config", str(config)]) == EXIT_ERROR
    assert f"config file {str(config)!r} gives a list where a mapping belongs" in _error_line(capsys)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "engine.buckets=[512,x]",
            "job config: 'engine.buckets=[512,x]': a list item could not be converted",
        ),
        (
            "engine.buckets=[512,1.5]",
            "'engine.buckets=[512,1.5]': a list item could not be converted to Integer",
        ),
        ("variants.a.buckets=[1,x]", "variants.a: a list item could not be converted to Integer"),
    ],
)
def test_a_bad_list_item_names_its_setting(tmp_path: Path, capsys, override: str, message: str):
    """omegaconf leaves its message for a list item unformatted: "Value '$VALUE' of type '$VALUE_TYPE' could
    not be converted to Integer", naming neither the value nor the key."""
    argv = ["manifest", "check", str(tmp_path / "m.parquet"), "engine.device=cpu", override]
    assert main(argv) == EXIT_ERROR
    line = _error_line(capsys)
    assert message in line and "$VALUE" not in line


def test_a_bad_list_item_in_a_config_file_names_the_file(tmp_path: Path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text("engine:\n  buckets: [512, x]\n")
    assert main(["manifest", "check", str(tmp_path / "m.parquet"), "--config", str(config)]) == EXIT_ERROR
    assert f"config file {str(config)!r}: a list item could not be converted to Integer" in _error_line(
        capsys
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("engine.max_text_chars=0", "max_text_chars=0: give the longest text a request may have"),
        ("engine.max_text_chars=-1", "max_text_chars=-1: give the longest text a request may have"),
        ("engine.max_ref_seconds=0", "max_ref_seconds=0: give the longest reference clip"),
        ("engine.max_ref_seconds=-1", "max_ref_seconds=-1: give the longest reference clip"),
        ("engine.max_ref_seconds=nan", "max_ref_seconds=nan: give the longest reference clip"),
        ("variants.a.max_ref_seconds=-5", "max_ref_seconds=-5: give the longest reference clip"),
    ],
)
def test_limits_that_would_reject_every_row_or_none_are_refused(
    tmp_path: Path, capsys, override: str, message: str
):
    """A limit of 0 or below rejected every row one by one ("over the -1 s limit"); NaN turned the reference
    clip limit off without a word."""
    argv = ["manifest", "check", str(tmp_path / "m.parquet"), override]
    assert main(argv) == EXIT_ERROR
    assert message in _error_line(capsys)
