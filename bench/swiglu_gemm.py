"""The bf16 gate/up GEMM that writes silu(gate) * up (engine/kernels/swiglu.py) against the path it replaced:
cuBLAS's gate/up GEMM [M, 6144] then the silu_mul kernel -> h [M, 3072], at OmniVoice's shapes (K = 1024,
I = 3072), one GPU, CUDA-graph replays timed like bench/kernels.py. Also each h's error against a float64
reference (relative, Frobenius), and over a B = 32 generation (M = 18,944 rows, 28 layers x 32 steps) the ms
each path takes.

    python bench/swiglu_gemm.py [--m 2048 8192 18944] [--out bench/results/swiglu-gemm-<gpu>.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, results_path, write_result  # noqa: E402
from bench.kernels import graph_time_us  # noqa: E402
from engine.kernels.swiglu import swiglu_gemm  # noqa: E402
from engine.model.layers import silu_mul  # noqa: E402

HIDDEN, INTERMEDIATE, CALLS_PER_GENERATION, GENERATION_M = 1024, 3072, 28 * 32, 18944


def bench_m(m: int, g: torch.Generator) -> dict:
    x = torch.randn(m, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(2 * INTERMEDIATE, HIDDEN, generator=g, device="cuda") / HIDDEN**0.5).to(torch.bfloat16)
    paths = {
        "cublas_silu_mul": lambda: silu_mul(*(x @ w.T).split(INTERMEDIATE, dim=-1), True),
        "swiglu_gemm": lambda: swiglu_gemm(x, w),
    }
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    exact = F.silu(gate) * up
    row = {"M": m}
    for name, path in paths.items():
        row[f"{name}_us"] = round(graph_time_us(path), 2)
        row[f"{name}_rel_err"] = round(((path().double() - exact).norm() / exact.norm()).item(), 6)
    row["speedup"] = round(row["cublas_silu_mul_us"] / row["swiglu_gemm_us"], 3)
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[2048, 8192, GENERATION_M])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [bench_m(m, g) for m in args.m]
    result = {"bench": "swiglu_gemm", "environment": environment(), "rows": rows}
    at_generation = [r for r in rows if r["M"] == GENERATION_M]
    if at_generation:
        result["per_generation_ms"] = {
            name: round(at_generation[0][f"{name}_us"] * CALLS_PER_GENERATION / 1e3, 1)
            for name in ("cublas_silu_mul", "swiglu_gemm")
        }
    write_result(args.out or results_path("swiglu-gemm"), result)


if __name__ == "__main__":
    main()
