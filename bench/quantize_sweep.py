"""The activation quantization across the grids that run 16-warp blocks on an H200 (M from 256 to 4096: fewer
than two 16-row sets per SM), at 16 and 32 low-rank columns without a prologue, K = 1024, 2048 and 3072.
Smoothing on, bf16, one GPU. bench/quantize_shapes.py covers M = 512 to 32768 and the RMSNorm prologue.

    python bench/quantize_sweep.py [--out bench/results/quantize-sweep-h200.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import graph_time_us  # noqa: E402
from bench.quantize_shapes import K_VALUES, run, smoothing  # noqa: E402

WIDTHS = (16, 32)
M_VALUES = (256, 512, 1024, 2048, 4096)


def measure_sweep(op, g: torch.Generator) -> list[dict]:
    rows = []
    for k in K_VALUES:
        for r in WIDTHS:
            pd_t = (torch.randn(r, k, generator=g, device="cuda") / k**0.5).bfloat16()
            smooth = smoothing(k, g)
            for m in M_VALUES:
                x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
                us = round(graph_time_us(lambda x=x, s=smooth, p=pd_t: op.quantize_act_lora_down(x, s, p)), 2)
                row = {"M": m, "K": k, "R": r, "quantize_us": us}
                rows.append(row)
                print(row, flush=True)
    return rows


def main() -> int:
    return run(
        __doc__,
        "bench/results/quantize-sweep-h200.json",
        "quantize_act_lora_down (R 16, 32), bf16 input with smoothing; CUDA-graph replays, do_bench medians "
        "with L2 cleared.",
        measure_sweep,
    )


if __name__ == "__main__":
    raise SystemExit(main())
