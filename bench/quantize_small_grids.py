"""The activation quantization on the smallest grids (M <= 1024: 16-warp blocks of 16 or 8 rows): every
low-rank width at K = 1024 with and without the RMSNorm prologue, and 16 and 32 columns at K = 2048 and 3072,
M = 1024. Kernel times from the profiler (bench/kernel_times.py's method: L2 flushed before each replay).
Smoothing on, bf16, one GPU.

    python bench/quantize_small_grids.py [--out bench/results/quantize-small-grids-h200.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_times import captured, kernel_us  # noqa: E402
from bench.quantize_shapes import quantize_call, run, smoothing  # noqa: E402

# (K, low-rank widths, M values); the RMSNorm prologue only at K = 1024, the hidden size it normalizes.
SHAPES = (
    (1024, (16, 32, 48, 64), (128, 256, 512, 1024)),
    (2048, (16, 32), (1024,)),
    (3072, (16, 32), (1024,)),
)


def measure_small_grids(op, g: torch.Generator) -> list[dict]:
    l2_flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    rows = []
    for k, widths, m_values in SHAPES:
        smooth = smoothing(k, g)
        norm_w = (torch.rand(k, generator=g, device="cuda") + 0.5).bfloat16()
        for r in widths:
            pd_t = (torch.randn(r, k, generator=g, device="cuda") / k**0.5).bfloat16()
            for m in m_values:
                x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
                for rmsnorm in (False, True) if k == 1024 else (False,):
                    call = quantize_call(op, x, norm_w, smooth, pd_t, rmsnorm)
                    us = sum(kernel_us(captured(call), l2_flush).values())
                    row = {"M": m, "K": k, "R": r, "rmsnorm": rmsnorm, "kernel_us": round(us, 2)}
                    rows.append(row)
                    print(row, flush=True)
    return rows


def main() -> int:
    return run(
        __doc__,
        "bench/results/quantize-small-grids-h200.json",
        "quantize_act_lora_down and rmsnorm_quantize_act_lora_down on the 16-warp grids, bf16 input with "
        "smoothing; kernel_us: the profiler's mean device time of one call, L2 cleared before each.",
        measure_small_grids,
    )


if __name__ == "__main__":
    raise SystemExit(main())
