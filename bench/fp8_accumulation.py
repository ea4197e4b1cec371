"""What FP8 fast accumulation would buy: a question for DESIGN's FP8 contract, which asks for float32 sums.

Hopper's FP8 tensor cores keep ~13 bits of a running sum (docs/kernels.md), so a float32 sum means adding
each few k steps' products into float32 registers apart from the tensor cores: cuBLASLt does so unless asked
for fast accumulation (`torch._scaled_mm(use_fast_accum=True)`), Triton's `tl.dot` only when given
`max_num_imprecise_acc`. One GPU, CUDA-graph replays timed like bench/kernels.py, per M (18,944 rows is the
B = 32 bucket of bench/generate.py):

- `gemms`: each backbone GEMM (q/k/v, o, gate/up, down) on cuBLASLt, float32 sums against fast accumulation;
- `gate_up_to_codes`: gate/up to down_proj's codes. `cublas`: cuBLASLt + the engine's silu_mul_fp8 kernel
  (the engine's path); `triton_*`: one Triton GEMM over gate and up rows interleaved a tile apart that writes
  h = silu(gate) * up from its sums (cuBLASLt has no such epilogue; h is half gate and up's bytes), then the
  engine's copy kernel quantizes h; `float32` promotes the sums every 128-deep k step, `tensor_core` keeps
  the tensor cores' sums;
- errors against a float32 reference of the same codes: relative (Frobenius), and the worst element in bf16
  units in the last place of |reference| (elements near zero measured against 1e-5 of the largest);
- `per_generation_ms`: at M = 18,944, the backbone GEMMs and gate/up's SiLU and quantization over 28 layers
  x 32 steps, for each way of summing.

    python bench/fp8_accumulation.py [--m 8192 18944] [--out bench/results/fp8-accumulation-<gpu>.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, results_path, write_result  # noqa: E402
from bench.kernels import graph_time_us  # noqa: E402
from engine.fp8.reference import quantize_rows  # noqa: E402
from engine.kernels import ops as kops  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, STEPS, GENERATION_M = 1024, 3072, 28, 32, 18944
GEMMS = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (2 * INTERMEDIATE, 1024), "down": (1024, 3072)}
BM, HALF, BK, STAGES, WARPS = (
    128,
    128,
    128,
    4,
    8,
)  # the fastest of the tiles tried on an H100 (commit message)


@triton.jit
def _swiglu_kernel(
    x_desc, w_desc, h_desc, x_scale, w_scale, M, N, K, programs,
    BM: tl.constexpr, HALF: tl.constexpr, BK: tl.constexpr, FLOAT32_SUMS: tl.constexpr,
):  # fmt: skip
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, HALF)
    per_group = 8 * tiles_n  # 8 row tiles walk the columns together, so weight tiles stay in L2
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, programs, flatten=True):
        first = (tile // per_group) * 8
        rows_in_group = tl.minimum(tiles_m - first, 8)
        off_m = (first + tile % rows_in_group) * BM
        off_n = ((tile % per_group) // rows_in_group) * HALF
        sums = tl.zeros((BM, 2 * HALF), tl.float32)
        for k in range(tl.cdiv(K, BK)):
            x = x_desc.load([off_m, k * BK])
            w = w_desc.load([2 * off_n, k * BK])
            if FLOAT32_SUMS:
                sums = tl.dot(x, w.T, sums, max_num_imprecise_acc=BK)
            else:
                sums = tl.dot(x, w.T, sums)
        rows = off_m + tl.arange(0, BM)
        sums = sums * tl.load(x_scale + rows, mask=rows < M, other=0.0)[:, None]
        sums = sums * tl.load(w_scale + 2 * off_n + tl.arange(0, 2 * HALF))[None, :]
        gate, up = sums.reshape(BM, 2, HALF).permute(0, 2, 1).split()
        h_desc.store([off_m, off_n], (gate / (1.0 + tl.exp(-gate)) * up).to(tl.bfloat16))


def interleave(t: torch.Tensor) -> torch.Tensor:
    """Rows [gate; up] -> blocks of HALF gate rows and the same outputs' up rows, alternating."""
    gate, up = (part.reshape(-1, HALF, *t.shape[1:]) for part in t.chunk(2))
    return torch.stack([gate, up], 1).reshape(t.shape).contiguous()


def triton_swiglu(qx, x_scale, qw, w_scale, float32_sums: bool):
    m, k = qx.shape
    h = torch.empty(m, INTERMEDIATE, device=qx.device, dtype=torch.bfloat16)
    w_il, s_il = interleave(qw), interleave(w_scale)
    descs = (
        TensorDescriptor.from_tensor(qx, [BM, BK]),
        TensorDescriptor.from_tensor(w_il, [2 * HALF, BK]),
        TensorDescriptor.from_tensor(h, [BM, HALF]),
    )
    programs = torch.cuda.get_device_properties(qx.device).multi_processor_count

    def run():
        _swiglu_kernel[(programs,)](
            *descs, x_scale.reshape(-1), s_il, m, INTERMEDIATE, k, programs,
            BM=BM, HALF=HALF, BK=BK, FLOAT32_SUMS=float32_sums, num_warps=WARPS, num_stages=STAGES,
        )  # fmt: skip
        return h

    return run


def errors(got: torch.Tensor, exact: torch.Tensor) -> dict:
    got, floor = got.float(), 1e-5 * exact.abs().max()
    return {
        "rel_err": round(((got - exact).norm() / exact.norm()).item(), 6),
        "worst_bf16_ulps": round(((got - exact).abs() / (exact.abs() * 2**-7 + floor)).max().item(), 2),
    }


def operands(m: int, n: int, k: int, g: torch.Generator):
    x = torch.randn(m, k, generator=g, device="cuda") * (torch.rand(m, 1, generator=g, device="cuda") + 0.5)
    qx, x_scale = quantize_rows(x.to(torch.bfloat16))
    qw, w_scale = quantize_rows(torch.randn(n, k, generator=g, device="cuda") / k**0.5)
    return qx, x_scale, qw, w_scale.reshape(-1).contiguous()


def scaled_mm(qx, x_scale, qw, w_scale, fast: bool, out_dtype=torch.bfloat16):
    return torch._scaled_mm(
        qx, qw.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=out_dtype, use_fast_accum=fast
    )


def bench_gemms(m: int, g: torch.Generator) -> dict:
    rows = {}
    for name, (n, k) in GEMMS.items():
        args = operands(m, n, k, g)
        qx, x_scale, qw, w_scale = args
        exact = (qx.float() @ qw.float().T) * x_scale * w_scale[None, :]
        row = {}
        for label, fast in (("float32", False), ("fast_accum", True)):
            row[f"{label}_us"] = round(graph_time_us(lambda a=args, f=fast: scaled_mm(*a, f)), 2)
            row[label] = errors(scaled_mm(*args, fast, torch.float32), exact)
        row["speedup_fast_accum"] = round(row["float32_us"] / row["fast_accum_us"], 3)
        rows[name] = row
        print(m, name, row, flush=True)
    return rows


def bench_gate_up(m: int, g: torch.Generator) -> dict:
    ops = kops.load()
    qx, x_scale, qw, w_scale = operands(m, 2 * INTERMEDIATE, HIDDEN, g)
    gate, up = ((qx.float() @ qw.float().T) * x_scale * w_scale[None, :]).chunk(2, dim=-1)
    exact = F.silu(gate) * up

    def cublas(fast: bool):
        y = scaled_mm(qx, x_scale, qw, w_scale, fast)
        return ops.silu_mul_fp8(y[:, :INTERMEDIATE], y[:, INTERMEDIATE:])

    variants = {
        "cublas_float32": (lambda: cublas(False), None),
        "cublas_fast_accum": (lambda: cublas(True), None),
        "triton_float32": (None, triton_swiglu(qx, x_scale, qw, w_scale, True)),
        "triton_tensor_core": (None, triton_swiglu(qx, x_scale, qw, w_scale, False)),
    }
    rows = {}
    for label, (path, gemm) in variants.items():
        if gemm is not None:
            path = lambda gemm=gemm: ops.fp8_quantize(gemm())  # noqa: E731
            h = errors(gemm(), exact)
        else:  # cuBLAS's h as the engine's silu_mul kernel sees it: silu of the bf16 gate and up
            y = scaled_mm(qx, x_scale, qw, w_scale, label.endswith("fast_accum"))
            h = errors(F.silu(y[:, :INTERMEDIATE].float()) * y[:, INTERMEDIATE:].float(), exact)
        rows[label] = {"us": round(graph_time_us(path), 2), "h": h}
        print(m, label, rows[label], flush=True)
    base = rows["cublas_float32"]["us"]
    for row in rows.values():
        row["speedup"] = round(base / row["us"], 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[8192, GENERATION_M])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {str(m): {"gemms": bench_gemms(m, g), "gate_up_to_codes": bench_gate_up(m, g)} for m in args.m}
    result = {"bench": "fp8_accumulation", "environment": environment(), "cases": cases}
    if str(GENERATION_M) in cases:  # the backbone's GEMMs, gate/up to down_proj's codes, per generation
        case, calls = cases[str(GENERATION_M)], LAYERS * STEPS / 1e3
        gemms, gate_up = case["gemms"], case["gate_up_to_codes"]

        def total(accumulation: str, gate_up_variant: str) -> float:
            others = sum(row[f"{accumulation}_us"] for name, row in gemms.items() if name != "gate_up")
            return round(calls * (others + gate_up[gate_up_variant]["us"]), 1)

        result["per_generation_ms"] = {
            "float32_sums (the contract; the engine's path)": total("float32", "cublas_float32"),
            "float32_sums, gate/up on the Triton GEMM": total("float32", "triton_float32"),
            "fast accumulation on cuBLASLt": total("fast_accum", "cublas_fast_accum"),
            "fast accumulation, gate/up on the Triton GEMM": total("fast_accum", "triton_tensor_core"),
        }
    write_result(args.out or results_path("fp8-accumulation"), result)


if __name__ == "__main__":
    main()
