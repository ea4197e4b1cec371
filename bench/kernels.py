"""W4A4 linear (activation quantization + wgmma GEMM + low-rank branch) against cuBLAS bf16 and
FP8 `torch._scaled_mm`, at OmniVoice's layer shapes, in one run on one GPU.

Every variant is captured in a CUDA graph (what the engine replays) and timed with
`triton.testing.do_bench` (median; it clears the L2 before each replay, so weights come from HBM).
FP8 is the GEMM alone on pre-quantized per-tensor e4m3 operands (its activation quantization is not
counted, which favours it). The W4A4 column is the whole linear: both kernels, rank 32, with smoothing.

    python bench/kernels.py [--out bench/results/kernels-<gpu>.json] [--m 512 2048 ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, results_path, write_result  # noqa: E402
from bench.floors import (  # noqa: E402
    BF16_FLOPS_PER_S,
    HBM_BYTES_PER_S,
    RANK,
    WGMMA_S8_OPS_PER_S,
    linear_bytes,
    overlapped_floor_us,
)
from engine.kernels import CudaW4A4Backend  # noqa: E402
from engine.kernels import ops as kops  # noqa: E402
from engine.w4a4.format import W4A4Tensors, pack_int4  # noqa: E402
from engine.w4a4.reference import w4a4_linear_reference  # noqa: E402

LAYERS = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
M_VALUES = (512, 2048, 8192, 32768)


def random_layer(n: int, k: int, g: torch.Generator, rank: int = RANK) -> W4A4Tensors:
    dev = "cuda"
    return W4A4Tensors(
        qweight=pack_int4(torch.randint(-8, 8, (n, k), generator=g, device=dev)),
        wscales=(torch.rand(n, k // 64, generator=g, device=dev) * 0.02 + 1e-4).half(),
        proj_down=(torch.randn(k, rank, generator=g, device=dev) / k**0.5).half(),
        proj_up=(torch.randn(n, rank, generator=g, device=dev) * 0.05).half(),
        smooth=(torch.rand(k, generator=g, device=dev) * 2 + 0.25).half(),
    )


def graph_time_us(fn) -> float:
    """Median microseconds of one replay of a CUDA graph holding one call of fn."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * do_bench(graph.replay, warmup=10, rep=100, return_mode="median")


def bench_shape(layer: str, m: int, g: torch.Generator) -> dict:
    n, k = LAYERS[layer]
    t = random_layer(n, k, g)
    backend = CudaW4A4Backend()
    packed = backend.prepare(t)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    x8, w8 = x.to(torch.float8_e4m3fn), (w * 50).to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")

    ops = kops.load()
    p = packed
    quant = lambda: ops.quantize_act_lora_down(x, p.smooth, p.pd_t[torch.bfloat16])
    qact, aratios, amax, lora = quant()
    gemm = lambda: ops.gemm_lora_up(
        qact, aratios, amax, lora, p.qweight, p.wscales, p.proj_up, None, m, n, x.dtype
    )

    y = backend.forward(x, packed)
    ref = w4a4_linear_reference(x, t)
    rel = ((y.float() - ref.float()).norm() / ref.float().norm()).item()

    w4a4_us = graph_time_us(lambda: backend.forward(x, packed))
    row = {
        "M": m,
        "layer": layer,
        "N": n,
        "K": k,
        "w4a4_us": round(w4a4_us, 2),
        "quantize_us": round(graph_time_us(quant), 2),
        "gemm_us": round(graph_time_us(gemm), 2),
        "bf16_us": round(graph_time_us(lambda: x @ w.t()), 2),
        "fp8_us": round(
            graph_time_us(
                lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            ),
            2,
        ),
        "rel_err_vs_reference": rel,
    }
    ops_count = 2.0 * m * n * k
    nbytes = linear_bytes(m, n, k)
    row.update(
        w4a4_tops=round(ops_count / w4a4_us / 1e6, 1),
        w4a4_floor_us=round(overlapped_floor_us(m, n, k), 2),
        bf16_tflops=round(ops_count / row["bf16_us"] / 1e6, 1),
        fp8_tflops=round(ops_count / row["fp8_us"] / 1e6, 1),
        speedup_vs_bf16=round(row["bf16_us"] / w4a4_us, 3),
        speedup_vs_fp8=round(row["fp8_us"] / w4a4_us, 3),
    )
    row["w4a4_tbytes_per_s"] = round(nbytes / (w4a4_us * 1e-6) / 1e12, 3)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=results_path("kernels"))
    parser.add_argument("--m", type=int, nargs="+", default=list(M_VALUES))
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 1
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    header = (
        f"{'M':>6} {'layer':>8} {'w4a4':>8} {'quant':>7} {'gemm':>8} {'bf16':>8} {'fp8':>8} {'x bf16':>7} "
    )
    print(header + f"{'x fp8':>6} {'TOPS':>6} {'floor':>7} {'err':>8}")
    for m in args.m:
        for layer in args.layers:
            r = bench_shape(layer, m, g)
            rows.append(r)
            print(
                f"{m:>6} {layer:>8} {r['w4a4_us']:>8.1f} {r['quantize_us']:>7.1f} {r['gemm_us']:>8.1f} "
                f"{r['bf16_us']:>8.1f} {r['fp8_us']:>8.1f} "
                f"{r['speedup_vs_bf16']:>7.2f} {r['speedup_vs_fp8']:>6.2f} "
                f"{r['w4a4_tops']:>6.0f} {r['w4a4_floor_us']:>7.1f} {r['rel_err_vs_reference']:>8.1e}",
                flush=True,
            )
    result = {
        "environment": environment("triton"),
        "ceilings": {
            "hbm_bytes_per_s": HBM_BYTES_PER_S,
            "wgmma_s8_ops_per_s": WGMMA_S8_OPS_PER_S,
            "bf16_flops_per_s": BF16_FLOPS_PER_S,
        },
        "notes": "W4A4 = whole linear (quantize + GEMM + low-rank, rank 32, smoothing); fp8 = GEMM only; "
        "CUDA-graph replays, do_bench medians with L2 cleared.",
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
