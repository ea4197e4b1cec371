"""The activation quantization at rank 16 (16 low-rank columns), as W4A4 generation runs it: without a
prologue at K = 1024, 2048 and 3072 (o_proj's and down_proj's inputs have K = 2048 and 3072), and with the
RMSNorm prologue at K = 1024 (beside it, for the kernels that share its code). Smoothing on, bf16, one GPU.

    python bench/quantize_rank16.py [--out bench/results/quantize-rank16-h200.json]
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
M_VALUES = (512, 2048, 8192, 32768)
RANK = 16


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/quantize-rank16-h200.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/quantize_rank16.py needs a CUDA GPU", file=sys.stderr)
        return 1
    g = torch.Generator(device="cuda").manual_seed(0)
    op = kops.load()
    rows = []
    for k in K_VALUES:
        smooth = torch.rand(k, generator=g, device="cuda") + 0.5
        smooth = torch.stack([smooth, 1 / smooth])
        pd_t = (torch.randn(RANK, k, generator=g, device="cuda") * 0.03).bfloat16()
        norm_w = (torch.rand(k, generator=g, device="cuda") + 0.5).bfloat16()
        for m in M_VALUES:
            x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
            plain = lambda x=x, s=smooth, p=pd_t: op.quantize_act_lora_down(x, s, p)  # noqa: E731
            row = {"M": m, "K": k, "R": RANK, "quantize_us": round(graph_time_us(plain), 2)}
            if k == 1024:
                normed = lambda x=x, w=norm_w, s=smooth, p=pd_t: op.rmsnorm_quantize_act_lora_down(
                    x, w, 1e-6, s, p
                )  # noqa: E731
                row["rmsnorm_quantize_us"] = round(graph_time_us(normed), 2)
            rows.append(row)
            print(row, flush=True)
    result = {
        "environment": environment("triton"),
        "notes": "quantize_act_lora_down (no prologue) and rmsnorm_quantize_act_lora_down at rank 16, bf16 "
        "input with smoothing; CUDA-graph replays, do_bench medians with L2 cleared.",
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
