"""Device time of each kernel of a W4A4 linear and of cuBLAS bf16, beside bench/kernels.py's graph times.

bench/kernels.py times a CUDA-graph replay with `triton.testing.do_bench`, which includes the replay's fixed
cost (a graph of one trivial kernel is timed too, for scale). Here the same graphs replay under
torch.profiler, L2 cleared before each, and each kernel's mean device time comes from its CUDA activity
records (real clocks, unlike ncu's locked ones). `--tag` names the build, e.g. one of the scratch ablation
builds of bench/results/ablation-h200-v36.patch.

    python bench/kernel_times.py [--out bench/results/kernel-times-h200.json] [--shapes qkv:512 o:2048]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, write_result  # noqa: E402
from bench.kernels import LAYERS, graph_time_us, random_layer  # noqa: E402
from engine.kernels import CudaW4A4Backend  # noqa: E402
from engine.kernels import ops as kops  # noqa: E402

SHAPES = ("qkv:128", "qkv:512", "qkv:2048", "o:512", "o:2048", "down:512", "down:2048")
REPLAYS = 40


def captured(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_us(graph: torch.cuda.CUDAGraph, l2_flush: torch.Tensor) -> dict[str, float]:
    """Mean device microseconds of each kernel in one replay of `graph` (the L2 flush's kernel left out)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        l2_flush.zero_()
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            l2_flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    flush_names = ("zero", "fill", "memset")
    return {
        e.key[:60]: round(e.self_device_time_total / e.count, 2)
        for e in prof.key_averages()
        if e.self_device_time_total > 0 and not any(n in e.key.lower() for n in flush_names)
    }


def measure(shape: str, ops, g: torch.Generator, l2_flush: torch.Tensor) -> dict:
    layer, m = shape.split(":")
    m = int(m)
    n, k = LAYERS[layer]
    p = CudaW4A4Backend().prepare(random_layer(n, k, g))
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
    quant = lambda: ops.quantize_act_lora_down(x, p.smooth, p.pd_t[torch.bfloat16])
    qact, aratios, amax, lora = quant()
    calls = {
        "quantize": quant,
        "gemm": lambda: ops.gemm_lora_up(
            qact, aratios, amax, lora, p.qweight, p.wscales, p.proj_up, None, m, n, x.dtype
        ),
        "bf16": lambda: x @ w.t(),
    }
    return {
        "shape": shape,
        "harness_us": {name: round(graph_time_us(fn), 2) for name, fn in calls.items()},
        "kernel_us": {name: kernel_us(captured(fn), l2_flush) for name, fn in calls.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/kernel-times-h200.json"))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="layer:M, e.g. qkv:512")
    parser.add_argument("--tag", default="", help="the build measured (a knob of the ablation patch, say)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernel_times.py needs a CUDA GPU", file=sys.stderr)
        return 1
    g = torch.Generator(device="cuda").manual_seed(0)
    l2_flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")  # as do_bench's
    trivial = torch.zeros(1, device="cuda")
    rows = [{"shape": "trivial", "harness_us": round(graph_time_us(lambda: trivial.add_(1)), 2)}]
    ops = kops.load()
    for shape in args.shapes:
        rows.append(measure(shape, ops, g, l2_flush))
        print(rows[-1], flush=True)
    notes = "Rank 32, smoothing, bf16; harness_us: bench/kernels.py's graph time; kernel_us: the profiler's."
    result = {"environment": environment("triton"), "tag": args.tag, "notes": notes, "rows": rows}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
