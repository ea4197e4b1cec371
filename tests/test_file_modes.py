"""What is written under a temporary name and renamed into place gets the mode of a plain open() or
mkdir() under the process umask (issue 44, item 11): a quantized checkpoint, the tiny checkpoint and a
job's files are readable by the other users of a shared volume."""

from __future__ import annotations

import contextlib
import io
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.fsmodes import process_umask
from engine.tiny import ensure_tiny_checkpoint
from engine.w4a4.format import QuantMeta, write_w4a4_safetensors
from pipeline import atomic, quantize_command


@pytest.fixture
def umask():
    """os.umask for one test: the previous umask is put back after it."""
    before = os.umask(0o022)
    yield os.umask
    os.umask(before)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _modes(root: Path) -> dict[str, int]:
    """Every entry under root (root itself as '.') -> its permission bits."""
    return {".": _mode(root), **{str(p.relative_to(root)): _mode(p) for p in root.rglob("*")}}


def _expected(root: Path, mask: int) -> dict[str, int]:
    return {name: (0o777 if (root / name).is_dir() else 0o666) & ~mask for name in _modes(root)}


def test_the_umask_is_read_without_changing_it(umask):
    umask(0o027)
    assert process_umask() == 0o027
    assert process_umask() == 0o027


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002], ids=["022", "027", "002"])
def test_atomic_writes_follow_the_umask(tmp_path: Path, umask, mask: int):
    umask(mask)
    atomic.write_bytes_atomic(tmp_path / "x.json", b"{}")
    atomic.write_wav_atomic(tmp_path / "x.wav", np.zeros(240, dtype=np.float32), 24000)
    assert _mode(tmp_path / "x.json") == _mode(tmp_path / "x.wav") == 0o666 & ~mask


def test_a_w4a4_safetensors_file_is_readable_by_others(tmp_path: Path, umask):
    umask(0o022)
    layer = "llm.layers.0.mlp.up_proj"
    write_w4a4_safetensors(
        tmp_path / "model.safetensors",
        {"llm.norm.weight": torch.ones(8)},
        QuantMeta(rank=16, source_hash="feed", layers=(layer,)),
    )
    assert _mode(tmp_path / "model.safetensors") == 0o644


def test_the_tiny_checkpoint_is_readable_by_others(tmp_path: Path, umask):
    umask(0o022)
    ckpt = ensure_tiny_checkpoint(tmp_path / "cache")
    assert _modes(ckpt) == _expected(ckpt, 0o022)
    assert _mode(ckpt) == 0o755 and _mode(ckpt / "model.safetensors") == 0o644


def test_ovbatch_quantize_output_is_readable_by_others(tmp_path: Path, umask):
    umask(0o022)
    tiny = ensure_tiny_checkpoint(tmp_path / "cache")
    out = tmp_path / "shared" / "tiny-w4a4"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small ops: a second thread on a shared 2-core machine only contends
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            argv = [str(tiny), "--out", str(out), "--samples", "4", "--eval-requests", "1", "--device", "cpu"]
            assert quantize_command.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    assert _mode(out) == 0o755 and _mode(out / "model.safetensors") == 0o644
    assert _modes(out) == _expected(out, 0o022)
