"""Build and load the CUDA extension in csrc/ (torch.utils.cpp_extension + ninja), cached on disk.

`python -m engine.kernels.build` builds it (same as `make build-ext`) and prints where it went. The build
directory is keyed by the sources' hash, the flags, the torch version and the CUDA version, so an edit or
an upgrade rebuilds and an unchanged tree loads the cached library directly (torch.ops.load_library).
Set OVBATCH_KERNEL_CACHE to move the cache (default: <$OVBATCH_CACHE or ~/.cache/ovbatch>/kernels, so
containers keep their builds on the shared volume); OVBATCH_KERNEL_DEFINES passes tuning knobs (see
`tuning_defines`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

from engine.config import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = (
    "binding.cpp",
    "quantize_act.cu",
    "w4a4_gemm.cu",
    "qk_norm_rope.cu",
    "rms_norm.cu",
    "silu_mul.cu",
    "snake.cu",
    "fp8_quantize.cu",
)
HEADERS = ("exact_division.cuh", "w4a4_common.cuh", "w4a4_launch.h", "wgmma.cuh")
EXTENSION_NAME = "ovbatch_w4a4"
# sm_90a: the GEMM uses wgmma (Hopper only); the rest is mma.sync and cp.async.
CUDA_FLAGS = ("-O3", "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo", "-Xptxas=-warn-spills")
# A toolchain that links libstdc++ statically (the H200 image's /opt/gcc has only libstdc++.a) would
# otherwise export that copy's symbols, which then mix with torch's libstdc++.so at run time: the first
# error message with a number in it (c10::str of a size) segfaulted. Keeping the copy private fixes it.
LINK_FLAGS = ("-Wl,--exclude-libs,ALL",)


def tuning_defines() -> list[str]:
    """Extra -D flags for tuning experiments (OVBATCH_KERNEL_DEFINES="-DW4A4_GEMM_STAGES=8 ..."), the
    `Tuning knob` #ifndef's in csrc/w4a4_gemm.cu and csrc/quantize_act.cu; empty in normal use."""
    return os.environ.get("OVBATCH_KERNEL_DEFINES", "").split()


def cache_dir() -> Path:
    root = Path(os.environ.get("OVBATCH_KERNEL_CACHE") or cache_root() / "kernels")
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join((*CUDA_FLAGS, *LINK_FLAGS, *tuning_defines())).encode())
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}-{digest.hexdigest()[:16]}"
    return root / tag.replace("+", "_")


@functools.lru_cache(maxsize=1)
def load_extension() -> tuple[bool, str]:
    """Build (if needed) and load the extension once per process -> (loaded, reason when not).

    A cache folder that already holds the built library loads it directly, without
    torch.utils.cpp_extension.load, which would run ninja and probe the compiler at every process start.
    A library that does not load (a build cut short) goes through the build."""
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} was built without CUDA"
    missing = [name for name in SOURCES + HEADERS if not (CSRC / name).is_file()]
    if missing:
        return False, f"the CUDA sources {missing} are not in {CSRC}: run from a source checkout"
    build_dir = cache_dir()
    start = time.perf_counter()
    library = build_dir / f"{EXTENSION_NAME}.so"
    if library.is_file():
        try:
            torch.ops.load_library(str(library))
        except Exception as exc:  # noqa: BLE001 - rebuilt below
            log.warning("the cached %s does not load (%s: %s): building it", library, type(exc).__name__, exc)
        else:
            log.info("loaded %s from %s in %.1f s", EXTENSION_NAME, build_dir, time.perf_counter() - start)
            return True, ""
    try:
        from torch.utils.cpp_extension import load
    except ImportError as exc:  # pragma: no cover - part of every torch
        return False, f"torch.utils.cpp_extension is unavailable: {exc}"
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return False, f"cannot create the kernel cache {build_dir} ({exc}): set OVBATCH_KERNEL_CACHE"
    try:
        load(
            name=EXTENSION_NAME,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cuda_cflags=[*CUDA_FLAGS, *tuning_defines()],
            extra_cflags=["-O3"],
            extra_ldflags=list(LINK_FLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=os.environ.get("OVBATCH_KERNEL_VERBOSE") == "1",
        )
    except Exception as exc:  # a failed compile or load: report it, the caller falls back
        return False, f"building the CUDA extension in {build_dir} failed: {type(exc).__name__}: {exc}"
    log.info("built and loaded %s in %s in %.1f s", EXTENSION_NAME, build_dir, time.perf_counter() - start)
    return True, ""


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok, reason = load_extension()
    if not ok:
        print(f"CUDA extension not built: {reason}", file=sys.stderr)
        return 1
    print(f"CUDA extension {EXTENSION_NAME} ready in {cache_dir()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
