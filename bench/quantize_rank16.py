"""The activation quantization at rank 16 (16 low-rank columns), as W4A4 generation runs it: without a
prologue at K = 1024, 2048 and 3072 (o_proj's and down_proj's inputs have K = 2048 and 3072), and with the
RMSNorm prologue at K = 1024 (beside it, for the kernels that share its code). Smoothing on, bf16, one GPU.

    python bench/quantize_rank16.py [--out bench/results/quantize-rank16-h200.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import graph_time_us  # noqa: E402
from bench.quantize_shapes import quantize_call, run, smoothing  # noqa: E402

K_VALUES = (1024, 2048, 3072)
M_VALUES = (512, 2048, 8192, 32768)
RANK = 16


def measure_rank16(op, g: torch.Generator) -> list[dict]:
    rows = []
    for k in K_VALUES:
        smooth = smoothing(k, g)
        pd_t = (torch.randn(RANK, k, generator=g, device="cuda") * 0.03).bfloat16()
        norm_w = (torch.rand(k, generator=g, device="cuda") + 0.5).bfloat16()
        for m in M_VALUES:
            x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
            plain = quantize_call(op, x, norm_w, smooth, pd_t, rmsnorm=False)
            row = {"M": m, "K": k, "R": RANK, "quantize_us": round(graph_time_us(plain), 2)}
            if k == 1024:
                normed = quantize_call(op, x, norm_w, smooth, pd_t, rmsnorm=True)
                row["rmsnorm_quantize_us"] = round(graph_time_us(normed), 2)
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> int:
    return run(
        __doc__,
        "bench/results/quantize-rank16-h200.json",
        "quantize_act_lora_down (no prologue) and rmsnorm_quantize_act_lora_down at rank 16, bf16 "
        "input with smoothing; CUDA-graph replays, do_bench medians with L2 cleared.",
        measure_rank16,
    )


if __name__ == "__main__":
    raise SystemExit(main())
