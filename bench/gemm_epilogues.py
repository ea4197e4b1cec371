"""The bf16 Triton GEMMs with epilogues against the paths they replaced, at OmniVoice's shapes (K = 1024), one
GPU, CUDA-graph replays timed like bench/kernels.py:

- `swiglu` (engine/kernels/swiglu.py): gate/up [6144 x 1024] writing h = silu(gate) * up, against cuBLAS's
  gate/up GEMM [M, 6144] then the silu_mul kernel;
- `qkv_rope` (engine/kernels/qkv_rope.py): q/k/v [4096 x 1024] writing q and k head-normed (RMSNorm) and
  rotated (RoPE), against cuBLAS's q/k/v GEMM then the qk_norm_rope kernel.

Each output's error against a float64 reference (relative, Frobenius), and over a B = 32 generation (M =
18,944 rows, 28 layers x 32 steps) the ms each path takes.

    python bench/gemm_epilogues.py [--m 2048 8192 18944] [--out bench/results/gemm-epilogues-<gpu>.json]
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
from engine.kernels import ops as kops  # noqa: E402
from engine.kernels.qkv_rope import qkv_rope_gemm  # noqa: E402
from engine.kernels.swiglu import swiglu_gemm  # noqa: E402
from engine.model.layers import rope_cos_sin, silu_mul  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, EPS = 1024, 3072, 16, 8, 128, 1e-6
CALLS_PER_GENERATION, GENERATION_M = 28 * 32, 18944


def swiglu_case(m: int, g: torch.Generator):
    """(timed paths, their outputs, the float64 reference) of gate/up to h."""
    x = torch.randn(m, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(2 * INTERMEDIATE, HIDDEN, generator=g, device="cuda") / HIDDEN**0.5).to(torch.bfloat16)
    paths = {
        "before": lambda: silu_mul(*(x @ w.T).split(INTERMEDIATE, dim=-1), True),
        "epilogue": lambda: swiglu_gemm(x, w),
    }
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    return paths, {name: path() for name, path in paths.items()}, F.silu(gate) * up


def qkv_rope_case(m: int, g: torch.Generator):
    """(timed paths, their outputs as [q | k | v] rows, the float64 reference) of q/k/v with q/k rotated."""
    q_end, k_end = HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM
    x = torch.randn(m, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(k_end + KV_HEADS * HEAD_DIM, HIDDEN, generator=g, device="cuda") / HIDDEN**0.5).to(
        x.dtype
    )
    q_w, k_w = ((torch.rand(HEAD_DIM, generator=g, device="cuda") + 0.5).to(x.dtype) for _ in range(2))
    cos, sin = rope_cos_sin(torch.randint(0, 4000, (m,), generator=g, device="cuda"), HEAD_DIM, 1e6, x.dtype)
    ops = kops.load()

    def before():  # as the model ran it: q/k/v on cuBLAS, then the kernel on q and k
        y = x @ w.T
        q, k = y[:, :q_end].view(m, HEADS, HEAD_DIM), y[:, q_end:k_end].view(m, KV_HEADS, HEAD_DIM)
        return (*ops.qk_norm_rope(q, k, q_w, k_w, cos, sin, EPS), y[:, k_end:])

    paths = {
        "before": before,
        "epilogue": lambda: qkv_rope_gemm(x, w, q_w, k_w, cos, sin, EPS, HEADS, KV_HEADS),
    }
    outputs = {"before": torch.cat([t.reshape(m, -1) for t in before()], -1), "epilogue": paths["epilogue"]()}

    def exact_heads(t, weight, heads):
        t = t.reshape(m, heads, HEAD_DIM)
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
        rotated = torch.cat((-t[..., HEAD_DIM // 2 :], t[..., : HEAD_DIM // 2]), -1)
        return (t * cos.double()[:, None] + rotated * sin.double()[:, None]).reshape(m, -1)

    y = x.double() @ w.double().T
    q, k = exact_heads(y[:, :q_end], q_w, HEADS), exact_heads(y[:, q_end:k_end], k_w, KV_HEADS)
    return paths, outputs, torch.cat([q, k, y[:, k_end:]], -1)


CASES = {"swiglu": swiglu_case, "qkv_rope": qkv_rope_case}


def bench_m(case: str, m: int, g: torch.Generator) -> dict:
    paths, outputs, exact = CASES[case](m, g)
    row = {"case": case, "M": m}
    for name, path in paths.items():
        row[f"{name}_us"] = round(graph_time_us(path), 2)
        row[f"{name}_rel_err"] = round(((outputs[name].double() - exact).norm() / exact.norm()).item(), 6)
    row["speedup"] = round(row["before_us"] / row["epilogue_us"], 3)
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[2048, 8192, GENERATION_M])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [bench_m(case, m, g) for case in CASES for m in args.m]
    result = {"bench": "gemm_epilogues", "environment": environment(), "rows": rows}
    result["per_generation_ms"] = {
        r["case"]: {
            name: round(r[f"{name}_us"] * CALLS_PER_GENERATION / 1e3, 1) for name in ("before", "epilogue")
        }
        for r in rows
        if r["M"] == GENERATION_M
    }
    write_result(args.out or results_path("gemm-epilogues"), result)


if __name__ == "__main__":
    main()
