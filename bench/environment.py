"""The machine and library versions every benchmark records beside its numbers, and how it writes them."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

# Packages whose kernels the engine runs on the GPU beside torch's, recorded by every GPU benchmark: the
# attention backends attention=auto picks first (flash4, then flash: engine/model/attention.py) and Triton
# (the bf16 GEMM epilogues, the guided argmax).
GPU_PACKAGES = ("flash-attn-4", "flash-attn", "triton")


def _driver() -> str:
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return " ".join(dict.fromkeys(out)) or "unknown"  # one line per GPU: each distinct version once


def environment(*packages: str) -> dict:
    """Python, torch, CUDA, the GPU and its driver, the date, and the versions of `packages` (on a GPU, of
    GPU_PACKAGES too)."""
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for name in (*packages, *(GPU_PACKAGES if torch.cuda.is_available() else ())):
        try:
            env[name] = version(name)
        except PackageNotFoundError:
            env[name] = "not installed"
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["driver"] = _driver()
    return env


def gpu_tag() -> str:
    """The GPU's model as a file name's part ("h100", "h200", "a100"; "cpu" where torch sees no GPU)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower().replace("nvidia", "")
    model = re.search(r"\b[a-z]+\d+[a-z]*\b", name)  # "h100" of "nvidia h100 80gb hbm3"
    return model.group() if model else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def results_path(bench: str) -> Path:
    """A benchmark's default result file, bench/results/<bench>-<gpu>.json: one per GPU model, so that a run
    on another card never overwrites the figures of the card a document quotes."""
    return Path("bench/results") / f"{bench}-{gpu_tag()}.json"


def write_result(path: str | Path, result: dict) -> None:
    """A benchmark's JSON at `path` (parents created), and a line saying where it went."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
