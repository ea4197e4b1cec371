"""Summarize one Nsight Compute profile of the W4A4 GEMM into the text kept under bench/results/.

On the GPU machine (bench/gemm_once.py runs one linear):

    ncu --kernel-name regex:gemm --launch-skip 2 --launch-count 1 --set full --import-source yes \
        -o gemm python bench/gemm_once.py --m 8192 --layer qkv
    ncu -i gemm.ncu-rep --page details --csv > details.csv
    ncu -i gemm.ncu-rep --page source --csv --print-source sass > source.csv

then `python bench/ncu_summary.py details.csv source.csv --k-groups 16 --title "..."`. Prints the details
sections, the warp stall samples, the executed SASS instructions grouped by how often each runs per
warp (once per K group: the main loop), the most stalled instructions, and the loop's opcodes.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter, defaultdict
from pathlib import Path

SECTIONS = (
    "GPU Speed Of Light Throughput",
    "Compute Workload Analysis",
    "Memory Workload Analysis",
    "Scheduler Statistics",
    "Warp State Statistics",
    "Instruction Statistics",
    "Launch Statistics",
    "Occupancy",
)
TOP_STALLED = 25


def number(text: str) -> float:
    return float(text.replace(",", ""))


def details_lines(path: Path) -> tuple[list[str], int]:
    """The kept sections' metrics as aligned lines, and the number of warps the kernel ran."""
    by_section: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
    for row in csv.DictReader(path.open()):
        by_section[row["Section Name"]].append((row["Metric Name"], row["Metric Unit"], row["Metric Value"]))
    launch = {name: value for name, _, value in by_section["Launch Statistics"]}
    warps = int(number(launch["Grid Size"])) * int(number(launch["Block Size"])) // 32
    lines = []
    for section in SECTIONS:
        lines += ["", f"## {section}"]
        lines += [f"{name:<45} {unit:>12} {value:>12}" for name, unit, value in by_section[section] if name]
    return lines, warps


def opcode(sass: str) -> str:
    """`@!P0 IMAD.WIDE.U32 R2, ...` -> `IMAD`."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return re.split(r"[.\s]", words[0])[0] if words else "?"


def executed(record: dict) -> int:
    return int(record["Instructions Executed"])


def stall_samples(record: dict) -> int:
    return int(record["Warp Stall Sampling (All Samples)"])


def source_lines(path: Path, warps: int, k_groups: int) -> list[str]:
    rows = list(csv.reader(path.open()))
    header_at = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    header = rows[header_at]
    body = rows[header_at + 1 :]
    records = [dict(zip(header, row, strict=True)) for row in body if len(row) == len(header)]
    stall_columns = [c for c in header if c.startswith("stall_") and not c.endswith("(Not Issued)")]

    stalls = Counter({c: sum(int(r[c]) for r in records) for c in stall_columns})
    total_samples = sum(stalls.values())
    lines = ["", "## Warp stall samples (source page, all samples)"]
    lines += [f"{c:<26} {n:>7} {100 * n / total_samples:5.1f}%" for c, n in stalls.most_common() if n]

    # Bucket each instruction by how many times one warp runs it.
    buckets: dict[float, list[dict]] = defaultdict(list)
    for r in records:
        if executed(r):
            buckets[round(executed(r) / warps, 2)].append(r)
    total = sum(map(executed, records))
    lines += ["", f"## Executed warp instructions by runs per warp ({k_groups} K groups, {warps} warps)"]
    for per_warp, group in sorted(buckets.items(), key=lambda kv: -sum(map(executed, kv[1]))):
        count = sum(map(executed, group))
        label = {k_groups: "every K group", 1: "once"}.get(per_warp, f"{per_warp:g} times")
        lines.append(
            f"{label:<24} {count:>10} instr ({100 * count / total:4.1f}%), "
            f"{count / warps:7.1f} per warp, stall samples {sum(map(stall_samples, group))}"
        )

    lines += [
        "",
        f"## The {TOP_STALLED} most stalled instructions: runs per warp, samples, main reason, address",
    ]
    for r in sorted(records, key=stall_samples, reverse=True)[:TOP_STALLED]:
        reason = max(stall_columns, key=lambda c: int(r[c]))
        where = f"{r['Address'][-4:]}  {r['Source'].strip()}"
        lines.append(f"{executed(r) / warps:6.2f} {stall_samples(r):>6} {reason:<20} {where}")

    per_group, samples = Counter(), Counter()
    for r in buckets.get(float(k_groups), []):
        per_group[opcode(r["Source"])] += executed(r) / (warps * k_groups)
        samples[opcode(r["Source"])] += stall_samples(r)
    lines += ["", "## Instructions run every K group, by opcode: per warp and K group, stall samples"]
    lines += [f"{name:<10} {count:6.1f} {samples[name]:>7}" for name, count in per_group.most_common()]
    lines.append(f"{'total':<10} {sum(per_group.values()):6.1f} {sum(samples.values()):>7}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("details", type=Path, help="ncu --page details --csv output")
    parser.add_argument("source", type=Path, help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--k-groups", type=int, required=True, help="K / 64 of the profiled layer")
    parser.add_argument("--title", default="", help="first line(s) of the summary (what was profiled)")
    args = parser.parse_args()
    lines, warps = details_lines(args.details)
    print("\n".join([args.title, *lines, *source_lines(args.source, warps, args.k_groups)]).strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
