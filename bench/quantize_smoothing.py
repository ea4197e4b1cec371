"""What smoothing costs the activation quantization: the same calls with and without it, in the same run,
at 32 low-rank columns without a prologue (bench/kernels.py's linears; o_proj's K = 2048, down_proj's 3072)
and 48 with the RMSNorm prologue (K = 1024: the q/k/v group's). bf16, one GPU.

    python bench/quantize_smoothing.py [--out bench/results/quantize-smoothing-h200.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import graph_time_us  # noqa: E402
from bench.quantize_shapes import quantize_call, run, smoothing  # noqa: E402

SHAPES = ((1024, 48), (1024, 32), (2048, 32), (3072, 32))  # (K, low-rank columns); 48 with the prologue
M_VALUES = (2048, 8192, 32768)


def measure(op, g: torch.Generator) -> list[dict]:
    rows = []
    for k, r in SHAPES:
        smooth = smoothing(k, g)
        norm_w = (torch.rand(k, generator=g, device="cuda") + 0.5).bfloat16()
        pd_t = (torch.randn(r, k, generator=g, device="cuda") * 0.03).bfloat16()
        for m in M_VALUES:
            x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
            times = {
                name: round(graph_time_us(quantize_call(op, x, norm_w, s, pd_t, rmsnorm=r == 48)), 2)
                for name, s in (("smoothing_us", smooth), ("no_smoothing_us", None))
            }
            row = {"M": m, "K": k, "R": r, "rmsnorm": r == 48, **times}
            row["ratio"] = round(row["smoothing_us"] / row["no_smoothing_us"], 3)
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> int:
    return run(
        __doc__,
        "bench/results/quantize-smoothing-h200.json",
        "quantize_act_lora_down (R 32) and rmsnorm_quantize_act_lora_down (R 48), bf16 input, with and "
        "without smoothing in the same run (ratio: with / without); CUDA-graph replays, do_bench medians "
        "with L2 cleared.",
        measure,
    )


if __name__ == "__main__":
    raise SystemExit(main())
