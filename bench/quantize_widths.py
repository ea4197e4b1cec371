"""The activation quantization (RMSNorm prologue, smoothing) at each low-rank width it is built for: 16 and
32 (one layer), 48, 64 and 96 (q/k/v or gate/up as one group of rank 16 or 32), on one GPU.

What a group's wider low-rank product costs: the grouped q/k/v at rank 32 quantizes with 96 columns.

    python bench/quantize_widths.py [--out bench/results/quantize-widths-h200.json] [--m 2048 8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, write_result  # noqa: E402
from bench.kernels import graph_time_us  # noqa: E402
from engine.kernels import ops as kops  # noqa: E402

WIDTHS = (16, 32, 48, 64, 96)
K = 1024  # the hidden size: what q/k/v and gate/up read


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/quantize-widths-h200.json"))
    parser.add_argument("--m", type=int, nargs="+", default=[2048, 8192, 32768])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/quantize_widths.py needs a CUDA GPU", file=sys.stderr)
        return 1
    g = torch.Generator(device="cuda").manual_seed(0)
    op = kops.load()
    norm_w = (torch.rand(K, generator=g, device="cuda") + 0.5).bfloat16()
    smooth = torch.rand(K, generator=g, device="cuda") + 0.5
    smooth = torch.stack([smooth, 1 / smooth])
    rows = []
    for m in args.m:
        x = torch.randn(m, K, generator=g, device="cuda").bfloat16()
        for r in WIDTHS:
            pd_t = (torch.randn(r, K, generator=g, device="cuda") * 0.03).bfloat16()
            call = lambda x=x, pd_t=pd_t: op.rmsnorm_quantize_act_lora_down(x, norm_w, 1e-6, smooth, pd_t)
            us = graph_time_us(call)
            rows.append({"M": m, "K": K, "R": r, "quantize_us": round(us, 2)})
            print(f"M {m:>6} R {r:>3}: {us:8.2f} us", flush=True)
    result = {
        "environment": environment("triton"),
        "notes": "rmsnorm_quantize_act_lora_down, bf16 input with smoothing; CUDA-graph replays, do_bench "
        "medians with L2 cleared.",
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
