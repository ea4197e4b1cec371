"""The activation quantization across the grids that run 16-warp blocks on an H200 (M from 256 to 4096: fewer
than two 16-row sets per SM), at 16 and 32 low-rank columns without a prologue, K = 1024, 2048 and 3072.
Smoothing on, bf16, one GPU. bench/quantize_shapes.py covers M = 512 to 32768 and the RMSNorm prologue.

    python bench/quantize_sweep.py [--out bench/results/quantize-sweep-h200.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quantize_shapes import measure_shapes, run  # noqa: E402

M_VALUES = (256, 512, 1024, 2048, 4096)


def main() -> int:
    return run(
        __doc__,
        "bench/results/quantize-sweep-h200.json",
        "quantize_act_lora_down (R 16, 32), bf16 input with smoothing; CUDA-graph replays, do_bench medians "
        "with L2 cleared.",
        lambda op, g: measure_shapes(op, g, widths=(16, 32), m_values=M_VALUES),
    )


if __name__ == "__main__":
    raise SystemExit(main())
