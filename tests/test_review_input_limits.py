"""Engine limits that make no sense are refused before any work: one line naming the value, exit 2."""

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
