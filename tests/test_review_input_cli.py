"""The command line's own arguments: a value that cannot mean anything is refused, naming it."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.cli import EXIT_ERROR, main


def test_manifest_check_refuses_a_negative_limit(tmp_path: Path, capsys):
    """--limit -1 printed all rejected rows but the last, then '... and 3 more' of two."""
    m = tmp_path / "m.parquet"
    empty = ["", ""]
    pq.write_table(pa.table({"id": ["a", "b"], "text": empty, "ref_audio": empty, "ref_text": empty}), m)
    with pytest.raises(SystemExit) as e:
        main(["manifest", "check", str(m), "--limit", "-1"])
    assert e.value.code == EXIT_ERROR
    assert "argument --limit: '-1' is not a count: give 0 or more rows to print" in capsys.readouterr().err
    assert main(["manifest", "check", str(m), "--limit", "0"]) == 1
    assert "... and 2 more" in capsys.readouterr().out
