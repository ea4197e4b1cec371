"""bench/floors.py: the byte and operation counts behind docs/kernels.md's floors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.floors import (
    gemm_bytes,
    gemm_floor_us,
    gemm_issue_floor_us,
    overlapped_floor_us,
    quantize_bytes,
    quantize_floor_us,
    quantize_issue_floor_us,
)

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_bytes_of_the_o_projection_at_8192_tokens():
    m, n, k = 8192, 1024, 2048
    activations = m * k + m * 32 * 4 + m * 32 * 4  # int8 tiles, 32 groups' scales, 32 low-rank floats a row
    assert quantize_bytes(m, k) == 2 * m * k + activations
    assert gemm_bytes(m, n, k) == activations + n * k // 2 + n * 32 * 8 + n * 32 * 4 + 2 * m * n
    assert quantize_floor_us(m, k) == pytest.approx(1e6 * (2 * m * k + activations) / 4.3e12)
    assert gemm_floor_us(m, n, k) == pytest.approx(1e6 * 2 * m * n * k / 1979e12)  # tensor-bound


KERNEL_ROWS = json.loads((RESULTS / "kernels-h200.json").read_text())["rows"]


@pytest.mark.parametrize("row", KERNEL_ROWS, ids=lambda r: f"{r['layer']}-{r['M']}")
def test_the_committed_kernel_results_carry_these_floors(row):
    m, n, k = row["M"], row["N"], row["K"]
    assert round(overlapped_floor_us(m, n, k), 2) == row["w4a4_floor_us"]
    assert quantize_floor_us(m, k) + gemm_floor_us(m, n, k) >= overlapped_floor_us(m, n, k)


def test_issue_floors_of_the_down_projection_at_8192_tokens():
    m, n, k = 8192, 1024, 3072
    issue_per_us = 4 * 132 * 1.98e3  # warp instructions a microsecond
    gemm_warp_groups = (m // 256) * (n // 64) * 4 * (k // 64)  # 256-row tiles, 4 warps each, 48 K groups
    assert gemm_issue_floor_us(m, n, k) == pytest.approx(gemm_warp_groups * 255 / issue_per_us)
    assert quantize_issue_floor_us(m, k) == pytest.approx((m // 16) * (k // 64) * 463 / issue_per_us)
