"""The activation quantization at the widths W4A4 generation and bench/kernels.py run: 16 and 32 low-rank
columns without a prologue, 48 (a rank-16 q/k/v group) with the RMSNorm prologue, at K = 1024, 2048 and
3072. Smoothing on, bf16, one GPU.

    python bench/quantize_shapes.py [--out bench/results/quantize-shapes-h200.json]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, write_result  # noqa: E402
from bench.kernels import graph_time_us  # noqa: E402
from engine.kernels import ops as kops  # noqa: E402

K_VALUES = (1024, 2048, 3072)
WIDTHS = (16, 32, 48)  # 48: with the RMSNorm prologue
M_VALUES = (512, 2048, 8192, 32768)


def smoothing(k: int, g: torch.Generator) -> torch.Tensor:
    """A random smoothing vector and its reciprocal, [2, k] float32, as the quantize kernels take them."""
    smooth = torch.rand(k, generator=g, device="cuda") + 0.5
    return torch.stack([smooth, 1 / smooth])


def quantize_call(op, x, norm_w, smooth, pd_t, rmsnorm: bool) -> Callable[[], object]:
    """One quantize call on x: with the RMSNorm prologue (weights norm_w, eps 1e-6) or without."""
    if rmsnorm:
        return lambda: op.rmsnorm_quantize_act_lora_down(x, norm_w, 1e-6, smooth, pd_t)
    return lambda: op.quantize_act_lora_down(x, smooth, pd_t)


def run(doc: str, default_out: str, notes: str, measure: Callable[[object, torch.Generator], list]) -> int:
    """The quantize benchmarks' command line: --out, a GPU check, measure(ops, generator) -> rows, JSON."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(default_out))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"{sys.argv[0]} needs a CUDA GPU", file=sys.stderr)
        return 1
    rows = measure(kops.load(), torch.Generator(device="cuda").manual_seed(0))
    write_result(args.out, {"environment": environment("triton"), "notes": notes, "rows": rows})
    return 0


def measure_shapes(op, g: torch.Generator, widths=WIDTHS, m_values=M_VALUES) -> list[dict]:
    rows = []
    for k in K_VALUES:
        smooth = smoothing(k, g)
        norm_w = (torch.rand(k, generator=g, device="cuda") + 0.5).bfloat16()
        for r in widths:
            pd_t = (torch.randn(r, k, generator=g, device="cuda") * 0.03).bfloat16()
            for m in m_values:
                x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
                us = round(graph_time_us(quantize_call(op, x, norm_w, smooth, pd_t, rmsnorm=r == 48)), 2)
                row = {"M": m, "K": k, "R": r, "rmsnorm": r == 48, "quantize_us": us}
                rows.append(row)
                print(row, flush=True)
    return rows


def main() -> int:
    return run(
        __doc__,
        "bench/results/quantize-shapes-h200.json",
        "quantize_act_lora_down (R 16, 32) and rmsnorm_quantize_act_lora_down (R 48), bf16 input "
        "with smoothing; CUDA-graph replays, do_bench medians with L2 cleared.",
        measure_shapes,
    )


if __name__ == "__main__":
    raise SystemExit(main())
