"""README's "Using it" (issue 44): after `make demo`, every command of its bash block runs as written, in
order, in a temporary copy of the checkout with a fresh home (so `~/.cache/ovbatch` starts empty).

The whole run took 11 minutes on 2 shared cores, so it runs where OVBATCH_README_RUN=1 (`make using-it`,
which CI's .ci/run calls) and is skipped, with that reason, in `make test`. What is cheap runs always:
every `ovbatch` command README shows parses with the CLI as it is, and `make demo` says how to put
`ovbatch` on PATH.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RUN_ALL = os.environ.get("OVBATCH_README_RUN") == "1"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def section(text: str, heading: str) -> str:
    """The text under a `## heading`, up to the next `## ` heading."""
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def code_blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in _FENCE.findall(text) if lang == language]


def commands(block: str) -> list[list[str]]:
    """The commands of a shell block as argv lists: continuation lines joined, comments dropped."""
    joined = block.replace("\\\n", " ")
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def using_it_block() -> str:
    blocks = code_blocks(section(README.read_text(), "Using it"), "bash")
    assert len(blocks) == 1, (
        "README's 'Using it' should hold one bash block: the commands that run as written"
    )
    return blocks[0]


def shown_ovbatch_commands() -> list[list[str]]:
    """Every `ovbatch` command in README's Quick start and Using it blocks, runnable or example."""
    text = section(README.read_text(), "Quick start") + section(README.read_text(), "Using it")
    blocks = code_blocks(text, "bash") + code_blocks(text, "text")
    return [argv for block in blocks for argv in commands(block) if argv[0] == "ovbatch"]


def test_using_it_starts_by_putting_ovbatch_on_path():
    first = commands(using_it_block())[0]
    assert first == ["source", ".venv/bin/activate"]
    assert "source .venv/bin/activate" in section(README.read_text(), "Quick start")


def test_make_demo_says_how_to_put_ovbatch_on_path():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    recipe = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "source .venv/bin/activate" in recipe.stdout


@pytest.mark.parametrize("argv", shown_ovbatch_commands(), ids=lambda argv: " ".join(argv[:3]))
def test_every_command_readme_shows_parses(argv: list[str]):
    from pipeline.cli import _stray_arguments, build_parser

    if argv[1] == "quantize":  # its options are pipeline/quantize_command.py's parser's
        from pipeline.quantize_command import build_parser as quantize_parser

        quantize_parser().parse_args(argv[2:])
        return
    args, extra = build_parser().parse_known_args(argv[1:])
    _stray_arguments(args, extra)


def _checkout_copy(dest: Path) -> Path:
    """The checkout's files, without what a fresh clone does not have."""
    ignored = shutil.ignore_patterns(
        ".git", ".venv", "out", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info", "build", "*.so"
    )
    return Path(shutil.copytree(ROOT, dest, ignore=ignored))


def _venv(clone: Path) -> None:
    """clone/.venv: the checkout's own (made by `make setup`) where there is one, else a stand-in whose
    bin/ovbatch runs this interpreter on the copy's code, with the same `activate` contract."""
    real = ROOT / ".venv"
    if (real / "bin" / "ovbatch").is_file() and (real / "bin" / "activate").is_file():
        (clone / ".venv").symlink_to(real)
        return
    bin_dir = clone / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    ovbatch = bin_dir / "ovbatch"
    ovbatch.write_text(f'#!/bin/sh\nPYTHONPATH="{clone}" exec "{sys.executable}" -m pipeline.cli "$@"\n')
    ovbatch.chmod(0o755)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')


@pytest.mark.skipif(not RUN_ALL, reason="11 min on 2 cores: `make using-it` (CI) runs it")
def test_make_demo_then_every_using_it_command_runs_as_written(tmp_path: Path):
    clone = _checkout_copy(tmp_path / "clone")
    _venv(clone)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("OVBATCH_CACHE", "RAY_ADDRESS", "PYTHONPATH")}
    env["HOME"] = str(home)
    # `make demo` runs .venv/bin/ovbatch demo; then the block, as one shell session, stopping at a failure
    script = "set -euo pipefail\n.venv/bin/ovbatch demo\n" + using_it_block()
    log = tmp_path / "session.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            ["bash", "-x", "-c", script],
            cwd=clone,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=3600,
        )
    assert proc.returncode == 0, (
        f"a README command failed (exit {proc.returncode}):\n{log.read_text()[-6000:]}"
    )
    for made in (
        "out/demo/summary.json",
        "out/demo-ab/report/index.html",
        "out/job1/report/index.html",
        "out/ab/report/index.html",
        "out/hello.wav",
        "out/tiny-w4a4/model.safetensors",
    ):
        assert (clone / made).is_file(), f"{made} was not written:\n{log.read_text()[-3000:]}"
