"""The activation quantization at the widths W4A4 generation and bench/kernels.py run: 16 and 32 low-rank
columns without a prologue, 48 (a rank-16 q/k/v group) with the RMSNorm prologue, at K = 1024, 2048 and
3072. Smoothing on, bf16, one GPU.

    python bench/quantize_shapes.py [--out bench/results/quantize-shapes-h200.json]
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

K_VALUES = (1024, 2048, 3072)
WIDTHS = (16, 32, 48)  # 48: with the RMSNorm prologue
M_VALUES = (512, 2048, 8192, 32768)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/quantize-shapes-h200.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/quantize_shapes.py needs a CUDA GPU", file=sys.stderr)
        return 1
    g = torch.Generator(device="cuda").manual_seed(0)
    op = kops.load()
    rows = []
    for k in K_VALUES:
        smooth = torch.rand(k, generator=g, device="cuda") + 0.5
        smooth = torch.stack([smooth, 1 / smooth])
        norm_w = (torch.rand(k, generator=g, device="cuda") + 0.5).bfloat16()
        for r in WIDTHS:
            pd_t = (torch.randn(r, k, generator=g, device="cuda") * 0.03).bfloat16()
            for m in M_VALUES:
                x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
                if r == 48:
                    call = lambda x=x, w=norm_w, s=smooth, p=pd_t: op.rmsnorm_quantize_act_lora_down(  # noqa: E731
                        x, w, 1e-6, s, p
                    )
                else:
                    call = lambda x=x, s=smooth, p=pd_t: op.quantize_act_lora_down(x, s, p)  # noqa: E731
                us = round(graph_time_us(call), 2)
                row = {"M": m, "K": k, "R": r, "rmsnorm": r == 48, "quantize_us": us}
                rows.append(row)
                print(row, flush=True)
    result = {
        "environment": environment("triton"),
        "notes": "quantize_act_lora_down (R 16, 32) and rmsnorm_quantize_act_lora_down (R 48), bf16 input "
        "with smoothing; CUDA-graph replays, do_bench medians with L2 cleared.",
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
