"""A variant whose checkpoint cannot exist is refused before the job is planned or any file is written:
the plan, once written, ties the job to its settings, and rerun refuses a changed checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_review_job_faults import _cfg, _manifest, _sizer

from engine.checkpoint import check_checkpoint_path
from engine.errors import CheckpointError
from pipeline.job import submit


def test_a_missing_checkpoint_of_a_later_variant_stops_submit_before_its_files(tmp_path: Path):
    cfg = _cfg(
        _manifest(tmp_path / "m.parquet", 3),
        "engine_factory=engine.api:Engine",
        "variants.a.checkpoint=tiny",
        f"variants.b.checkpoint={tmp_path / 'nope'}",
    )
    with pytest.raises(CheckpointError, match="variants.b.checkpoint: .*nope"):
        submit(cfg, tmp_path / "job", _sizer)
    assert not (tmp_path / "job").exists() or not any((tmp_path / "job").iterdir())


def test_what_can_be_known_without_the_network(tmp_path: Path):
    check_checkpoint_path(None)  # the embedded tiny checkpoint
    check_checkpoint_path(tmp_path)  # a directory: loading says whether it is a checkpoint
    check_checkpoint_path("k2-fsa/OmniVoice")  # a repo id: fetched (or refused) at load
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file"):
        check_checkpoint_path(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="neither an existing directory"):
        check_checkpoint_path(str(tmp_path / "a" / "b" / "c"))
