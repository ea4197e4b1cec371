"""The fused kernels against what they replace, at OmniVoice's shapes, in one run on one GPU.

- rms_norm: RMSNorm of [M, 1024] rows, torch (float32 intermediates) against the kernel.
- norm_qkv: RMSNorm(x) -> the q/k/v projection (N 4096, K 1024). bf16: the RMSNorm kernel + cuBLAS;
  W4A4 unfused: the RMSNorm kernel + the W4A4 linear; W4A4 fused: the norm inside activation quantization.
- group_qkv, group_gate_up: RMSNorm(x) -> the q, k, v (2048, 1024, 1024) or gate, up (3072, 3072)
  projections, K 1024, as separate layers (how the engine ran them before groups) and as one grouped GEMM:
  bf16 (the RMSNorm kernel + cuBLAS) and W4A4 (the norm inside activation quantization).
- silu_mul: silu(gate) * up of [M, 3072], torch (two kernels) against the kernel.
- swiglu: RMSNorm(x) -> silu(gate) * up (gate, up 3072 x 1024, rank 16: the SwiGLU GEMM's rank). bf16: the
  RMSNorm kernel + one cuBLAS GEMM + the silu_mul kernel; W4A4: the grouped GEMM + the silu_mul kernel, and
  the SwiGLU GEMM (silu(gate) * up in its epilogue).
- residual_o, residual_down: x + linear(h) for o (1024 x 2048) and down (1024 x 3072). bf16: cuBLAS + torch's
  add; W4A4: the linear + torch's add, and the add in the GEMM's epilogue.
- qk_norm_rope: q/k head RMSNorm + RoPE on the q/k/v output (16 + 8 heads of 128): torch against the kernel.
- snake: the codec's Snake activation (float32) on 16 clips of 10 s where its DAC runs at 24 kHz with 64
  channels and at 3 kHz with 512: torch (five kernels) against the kernel.

CUDA-graph replays timed like bench/kernels.py (do_bench medians, L2 cleared).

    python bench/fused.py [--out bench/results/fused-<gpu>.json] [--m 512 2048 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.environment import environment, results_path, write_result  # noqa: E402
from bench.kernels import M_VALUES, graph_time_us, random_layer  # noqa: E402
from engine.codec.acoustic import Snake  # noqa: E402
from engine.kernels import CudaW4A4Backend  # noqa: E402
from engine.kernels import ops as kops  # noqa: E402
from engine.model.layers import RMSNorm, apply_rope, rms_norm, rope_cos_sin  # noqa: E402

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 1024, 3072, 16, 8, 128


def rel_err(a, b) -> float:
    """Relative Frobenius error of a against b (tensors, or tuples of tensors taken together)."""
    a, b = (torch.cat([t.flatten() for t in v]) if isinstance(v, tuple) else v for v in (a, b))
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def timed(variants: dict, check: tuple[str, str]) -> dict:
    """Median us per variant, ratios to the first one, and the relative error between the `check` pair."""
    row = {f"{name}_us": round(graph_time_us(fn), 2) for name, fn in variants.items()}
    base = next(iter(variants))
    for name in list(variants)[1:]:
        row[f"speedup_{name}_vs_{base}"] = round(row[f"{base}_us"] / row[f"{name}_us"], 3)
    a, b = (variants[name]() for name in check)
    row[f"rel_err_{check[0]}_vs_{check[1]}"] = rel_err(a, b)
    return row


def rms_norm_row(m: int, g: torch.Generator) -> dict:
    x = torch.randn(m, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    norm = RMSNorm(HIDDEN, 1e-6).to("cuda", torch.bfloat16)
    ops = kops.load()
    variants = {
        "torch": lambda: rms_norm(x, norm.weight, norm.eps),
        "fused": lambda: ops.rms_norm(x, norm.weight, norm.eps),
    }
    return {"M": m, "case": "rms_norm", **timed(variants, ("fused", "torch"))}


def silu_mul_row(m: int, g: torch.Generator) -> dict:
    gate, up = (torch.randn(m, INTERMEDIATE, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    ops = kops.load()
    variants = {"torch": lambda: F.silu(gate) * up, "fused": lambda: ops.silu_mul(gate, up)}
    return {"M": m, "case": "silu_mul", **timed(variants, ("fused", "torch"))}


def norm_qkv(m: int, g: torch.Generator) -> dict:
    n, k = HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN
    backend = CudaW4A4Backend()
    packed = backend.prepare(random_layer(n, k, g))
    norm = RMSNorm(k, 1e-6).to("cuda", torch.bfloat16)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    variants = {
        "bf16": lambda: norm(x) @ w.t(),
        "w4a4_unfused": lambda: backend.forward(norm(x), packed),
        "w4a4_fused": lambda: backend.forward_rmsnorm(x, norm.weight, norm.eps, packed),
    }
    return {"M": m, "case": "norm_qkv", "N": n, "K": k, **timed(variants, ("w4a4_fused", "w4a4_unfused"))}


def norm_group(m: int, g: torch.Generator, case: str, widths: tuple[int, ...]) -> dict:
    k = HIDDEN
    backend = CudaW4A4Backend()
    layers = [random_layer(n, k, g) for n in widths]
    layers = [dataclasses.replace(t, smooth=layers[0].smooth) for t in layers]  # one input, one smoothing
    packed = [backend.prepare(t) for t in layers]
    group = backend.prepare_group(layers)
    norm = RMSNorm(k, 1e-6).to("cuda", torch.bfloat16)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(sum(widths), k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    ws = w.split(list(widths))

    def bf16_separate():
        h = norm(x)
        return tuple(h @ wi.t() for wi in ws)

    variants = {
        "bf16_separate": bf16_separate,
        "bf16_grouped": lambda: norm(x) @ w.t(),
        "w4a4_separate": lambda: tuple(backend.forward_rmsnorm(x, norm.weight, norm.eps, p) for p in packed),
        "w4a4_grouped": lambda: backend.forward_rmsnorm(x, norm.weight, norm.eps, group).split(widths, -1),
    }
    row = {"M": m, "case": case, "widths": list(widths), "K": k}
    row.update(timed(variants, ("w4a4_grouped", "w4a4_separate")))
    return row


def swiglu(m: int, g: torch.Generator) -> dict:
    k = HIDDEN
    backend = CudaW4A4Backend()
    gate = random_layer(INTERMEDIATE, k, g, rank=16)
    up = dataclasses.replace(random_layer(INTERMEDIATE, k, g, rank=16), smooth=gate.smooth)
    group, fused = backend.prepare_group([gate, up]), backend.prepare_swiglu([gate, up])
    norm = RMSNorm(k, 1e-6).to("cuda", torch.bfloat16)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(2 * INTERMEDIATE, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    ops = kops.load()

    def silu_mul_of(gate_up: torch.Tensor) -> torch.Tensor:
        return ops.silu_mul(*gate_up.split(INTERMEDIATE, dim=-1))

    variants = {
        "bf16": lambda: silu_mul_of(norm(x) @ w.t()),
        "w4a4_silu_mul": lambda: silu_mul_of(backend.forward_rmsnorm(x, norm.weight, norm.eps, group)),
        "w4a4_swiglu_gemm": lambda: backend.forward_rmsnorm(x, norm.weight, norm.eps, fused),
    }
    row = {"M": m, "case": "swiglu", "N": 2 * INTERMEDIATE, "K": k, "rank": 16}
    row.update(timed(variants, ("w4a4_swiglu_gemm", "w4a4_silu_mul")))
    return row


def residual(m: int, g: torch.Generator, case: str, k: int) -> dict:
    n = HIDDEN
    backend = CudaW4A4Backend()
    packed = backend.prepare(random_layer(n, k, g))
    h = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(m, n, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    variants = {
        "bf16": lambda: x + h @ w.t(),
        "w4a4_add": lambda: x + backend.forward(h, packed),
        "w4a4_fused": lambda: backend.forward(h, packed, residual=x),
    }
    return {"M": m, "case": case, "N": n, "K": k, **timed(variants, ("w4a4_fused", "w4a4_add"))}


def qk_norm_rope(m: int, g: torch.Generator) -> dict:
    qkv = torch.randn(m, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
    q = qkv[:, : HEADS * HEAD_DIM].view(m, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(m, KV_HEADS, HEAD_DIM)
    q_norm, k_norm = (RMSNorm(HEAD_DIM, 1e-6).to("cuda", torch.bfloat16) for _ in range(2))
    cos, sin = rope_cos_sin(torch.arange(m, device="cuda"), HEAD_DIM, 1e6, torch.bfloat16)
    ops = kops.load()
    variants = {
        "torch": lambda: (apply_rope(q_norm(q), cos, sin), apply_rope(k_norm(k), cos, sin)),
        "fused": lambda: ops.qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, sin, 1e-6),
    }
    return {"M": m, "case": "qk_norm_rope", **timed(variants, ("fused", "torch"))}


def snake_row(shape: tuple[int, int, int], g: torch.Generator) -> dict:
    """The codec's Snake module as it runs, with its `fused` flag off and on."""
    x = torch.randn(shape, generator=g, device="cuda")
    torch_snake, fused_snake = Snake(shape[1]).cuda(), Snake(shape[1]).cuda()
    with torch.no_grad():
        torch_snake.alpha.copy_(torch.rand(1, shape[1], 1, generator=g, device="cuda") + 0.5)
    fused_snake.load_state_dict(torch_snake.state_dict())
    fused_snake.fused = True
    variants = {"torch": lambda: torch_snake(x), "fused": lambda: fused_snake(x)}
    return {"shape": list(shape), "case": "snake", **timed(variants, ("fused", "torch"))}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=results_path("fused"))
    parser.add_argument("--m", type=int, nargs="+", default=list(M_VALUES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/fused.py needs a CUDA GPU", file=sys.stderr)
        return 1
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m in args.m:
        for case in (
            rms_norm_row,
            silu_mul_row,
            norm_qkv,
            functools.partial(norm_group, case="group_qkv", widths=(2048, 1024, 1024)),
            functools.partial(norm_group, case="group_gate_up", widths=(INTERMEDIATE, INTERMEDIATE)),
            swiglu,
            functools.partial(residual, case="residual_o", k=HEADS * HEAD_DIM),
            functools.partial(residual, case="residual_down", k=INTERMEDIATE),
            qk_norm_rope,
        ):
            rows.append(case(m, g))
            print(json.dumps(rows[-1]), flush=True)
    for shape in ((16, 64, 240_000), (16, 512, 30_000)):
        rows.append(snake_row(shape, g))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "environment": environment("triton"),
        "notes": "CUDA-graph replays, do_bench medians with L2 cleared; W4A4 rank 32 with smoothing.",
        "rows": rows,
    }
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
