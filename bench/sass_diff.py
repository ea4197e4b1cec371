"""Which kernels a source change touches, without a GPU: compile csrc/*.cu for sm_90a at a git revision and as
in the working tree, and report, kernel by kernel, whether the machine code differs and how the registers,
spills and the static instruction counts of its loops (the GEMM's K-group loop, say) changed.

    python bench/sass_diff.py --base HEAD [--defines "-DW4A4_GEMM_STAGES=8"] [csrc/w4a4_gemm.cu ...]

Needs nvcc (CUDA 13) and nvdisasm (on PATH, or `--nvdisasm`; without a CUDA toolkit, the nvidia-cuda-nvdisasm
wheel from PyPI has it). ptxas's codegen of every kernel in a file moves with small source changes, so a
measurement of one build says nothing of another whose machine code differs (docs/kernels.md, v54); this is
how "the committed source compiles to the measured build's machine code" is checked. The comparison ignores
instruction addresses, the anonymous-namespace hash in symbol names and label numbering.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NVCC_FLAGS = ["-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-Xptxas", "-v"]


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_stores: int
    spill_loads: int


def short_name(symbol: str) -> str:
    """A mangled kernel symbol without the per-file anonymous-namespace part (it hashes the file's path)."""
    return re.sub(r"_GLOBAL__N__\w+?_cu_[0-9a-f]+", "", symbol)


def parse_ptxas_log(text: str) -> dict[str, Resources]:
    """Registers and spill bytes per kernel from `ptxas -v` output."""
    out: dict[str, Resources] = {}
    name, spills = None, (0, 0)
    for line in text.splitlines():
        if m := re.search(r"(?:Compiling entry function|Function properties for) '?([\w$]+)'?", line):
            name = short_name(m.group(1))
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spills = (int(m.group(1)), int(m.group(2)))
        elif (m := re.search(r"Used (\d+) registers", line)) and name is not None:
            out[name] = Resources(int(m.group(1)), *spills)
            name, spills = None, (0, 0)
    return out


def renumber_labels(body: str) -> str:
    """Labels numbered in order of first use within one kernel (nvdisasm numbers them across the file)."""
    labels: dict[str, str] = {}
    return re.sub(r"\.L_x_\d+", lambda m: labels.setdefault(m.group(0), f"L{len(labels)}"), body)


def kernel_bodies(sass: str) -> dict[str, str]:
    """Each kernel's instructions from `nvdisasm -c` output, addresses, symbol hashes and label numbers
    normalized, so that the same machine code in two builds compares equal."""
    out = {}
    for section in re.split(r"\n\s*\.text\.", sass)[1:]:
        header, _, body = section.partition("\n")
        body = re.sub(r"/\*[0-9a-f]{4,}\*/", "", body)
        body = re.sub(r"_GLOBAL__N__\w+?_cu_[0-9a-f]+", "", body)
        out[short_name(header.split(":", 1)[0])] = renumber_labels(body)
    return out


def loop_sizes(body: str) -> list[int]:
    """Static instruction count of each loop in a kernel body from `kernel_bodies`: from a label to the
    branch back to it, both included, in code order (the bodies' conditional paths counted too). The
    self-branch that pads a kernel's end is no loop."""
    sizes, label_at, count = [], {}, 0
    for line in body.splitlines():
        line = line.strip()
        if m := re.fullmatch(r"(L\d+):", line):
            label_at[m.group(1)] = count
        elif line.endswith(";"):
            count += 1
            target = re.search(r"BRA `\((L\d+)\)", line)
            if target and target.group(1) in label_at and count - label_at[target.group(1)] > 1:
                sizes.append(count - label_at[target.group(1)])
    return sizes


def compile_file(source: Path, include: Path, defines: list[str], nvdisasm: str) -> tuple[str, str]:
    """(ptxas log, nvdisasm -c text) of one .cu file."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cmd = ["nvcc", *NVCC_FLAGS, *defines, f"-I{include}", "-o", str(cubin), str(source)]
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{built.stderr}")
        sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    return built.stderr, sass


def compare(files: list[str], base_dir: Path, defines: list[str], nvdisasm: str) -> list[str]:
    """One line per kernel whose machine code or resources differ, and a count per file."""
    jobs = [(tree, name) for name in files for tree in (base_dir, REPO)]
    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        results = list(
            pool.map(lambda job: compile_file(job[0] / job[1], job[0] / "csrc", defines, nvdisasm), jobs)
        )
    lines = []
    for i, name in enumerate(files):
        (base_log, base_sass), (new_log, new_sass) = results[2 * i], results[2 * i + 1]
        base_res, new_res = parse_ptxas_log(base_log), parse_ptxas_log(new_log)
        base_code, new_code = kernel_bodies(base_sass), kernel_bodies(new_sass)
        same = sorted(k for k in base_code if new_code.get(k) == base_code[k])
        changed = sorted(k for k in base_code if k in new_code and new_code[k] != base_code[k])
        only = sorted(set(base_code) ^ set(new_code))
        lines.append(
            f"{name}: {len(same)} kernels same machine code, {len(changed)} differ,"
            f" {len(only)} in one build only"
        )
        for k in changed + only:
            a, b = base_res.get(k), new_res.get(k)
            loops = [loop_sizes(code[k]) if k in code else [] for code in (base_code, new_code)]
            lines.append(f"  {k}: {describe(a)} -> {describe(b)}; loop instructions {loops[0]} -> {loops[1]}")
    return lines


def describe(r: Resources | None) -> str:
    if r is None:
        return "absent"
    return f"{r.registers} registers, spills {r.spill_stores}/{r.spill_loads} B"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="*", help="csrc files to compare (default: every csrc/*.cu)")
    parser.add_argument("--base", default="HEAD", help="git revision to compare the working tree against")
    parser.add_argument(
        "--defines", default="", help="extra nvcc flags for both builds, as OVBATCH_KERNEL_DEFINES"
    )
    parser.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "nvdisasm")
    args = parser.parse_args()
    files = args.files or sorted(str(p.relative_to(REPO)) for p in (REPO / "csrc").glob("*.cu"))
    with tempfile.TemporaryDirectory() as base_dir:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.base, "csrc"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", base_dir], input=archive.stdout, check=True)
        for line in compare(files, Path(base_dir), args.defines.split(), args.nvdisasm):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
