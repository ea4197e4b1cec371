"""bench/ncu_summary.py on hand-made Nsight Compute CSV exports: opcodes from SASS lines, the warp count
from the launch statistics, instructions bucketed by runs per warp, and the loop's opcode table."""

from __future__ import annotations

import csv
from pathlib import Path

from bench.ncu_summary import details_lines, opcode, source_lines

SOURCE_HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
STALLS = ["stall_wait", "stall_barrier", "stall_wait (Not Issued)"]


def write_details(path: Path, grid: int, block: int) -> None:
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Section Name", "Metric Name", "Metric Unit", "Metric Value"])
        out.writerow(["Launch Statistics", "Block Size", "", str(block)])
        out.writerow(["Launch Statistics", "Grid Size", "", f"{grid:,}"])
        out.writerow(["Occupancy", "", "", ""])
        out.writerow(["Scheduler Statistics", "Issued Warp Per Scheduler", "", "0.56"])
        out.writerow(["PM Sampling", "Maximum Buffer Size", "Mbyte", "31.00"])


def write_source(path: Path, rows: list[tuple[str, int, int, int, int]]) -> None:
    """rows: (sass, stall samples, executed, stall_wait, stall_barrier)."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["Kernel Name", "gemm"])
        out.writerow(SOURCE_HEADER + STALLS)
        for i, (sass, samples, executed, wait, barrier) in enumerate(rows):
            out.writerow([hex(i * 16), sass, samples, executed, wait, barrier, 0])


def test_opcode_drops_predicates_and_modifiers():
    assert opcode("      @!P0 IMAD.WIDE.U32 R2, R3, 0x4, R4") == "IMAD"
    assert opcode("FFMA R1, R2, R3, R1") == "FFMA"
    assert opcode("  QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24") == "QGMMA"
    assert opcode("") == "?"


def test_details_count_warps_and_keep_named_metrics(tmp_path):
    write_details(tmp_path / "details.csv", grid=4096, block=128)
    lines, warps = details_lines(tmp_path / "details.csv")
    assert warps == 4096 * 4
    text = "\n".join(lines)
    assert "Issued Warp Per Scheduler" in text and "0.56" in text
    assert "Maximum Buffer Size" not in text  # a section the summary leaves out
    assert not [line for line in lines if line.isspace()]  # unnamed metric rows are dropped


def test_source_buckets_by_runs_per_warp(tmp_path):
    warps, groups = 8, 4
    write_source(
        tmp_path / "source.csv",
        [
            ("LDC R1, c[0x0][0x28]", 5, warps, 5, 0),  # once per warp
            ("FMUL R2, R3, R4", 7, warps * groups, 3, 4),  # every group
            ("FFMA R5, R2, R6, R5", 1, warps * groups, 1, 0),
            ("FFMA R7, R2, R6, R7", 2, warps * groups, 0, 2),
            ("@P0 LDGSTS.E [R1], [R2.64]", 4, warps * (groups - 1), 4, 0),  # every refill
            ("EXIT", 0, 0, 0, 0),  # never run
        ],
    )
    lines = source_lines(tmp_path / "source.csv", warps, groups)
    # 13 of 19 samples wait, 6 wait at a barrier; the "(Not Issued)" column is not counted twice
    assert "stall_wait                      13  68.4%" in lines
    assert "stall_barrier                    6  31.6%" in lines
    # 96 of 128 instructions run every group, 24 every refill, 8 once
    assert "every K group                    96 instr (75.0%),    12.0 per warp, stall samples 10" in lines
    assert "3 times                          24 instr (18.8%),     3.0 per warp, stall samples 4" in lines
    assert "once                              8 instr ( 6.2%),     1.0 per warp, stall samples 5" in lines
    heading = "## The 25 most stalled instructions: runs per warp, samples, main reason, address"
    stalled = lines[lines.index(heading) + 1 :]
    assert stalled[:2] == [
        "  4.00      7 stall_barrier        0x10  FMUL R2, R3, R4",
        "  1.00      5 stall_wait           0x0  LDC R1, c[0x0][0x28]",
    ]
    assert lines[-4].startswith("## Instructions run every K group, by opcode")
    assert lines[-3:] == [
        "FFMA          2.0       3",
        "FMUL          1.0       7",
        "total         3.0      10",
    ]
