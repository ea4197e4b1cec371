"""The Triton GEMMs of engine/kernels (swiglu.py, qkv_rope.py) on the CPU under Triton's interpreter, run by
tests/test_triton_interpret.py in a process of its own (TRITON_INTERPRET=1 must be set before Triton compiles
anything). fp16 only: the interpreter cannot store bf16 through tensor descriptors; the kernels' code is one
for both types. Fresh random inputs at odd M and widths that are not multiples of a tile, against the float64
references and tolerances of the GPU tests (tests/test_swiglu_gemm.py, tests/test_qkv_rope_gemm.py).

    TRITON_INTERPRET=1 python tests/interpret_kernels.py swiglu|qkv_rope
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from test_qkv_rope_gemm import EPS, exact_qkv_rope  # noqa: E402
from test_swiglu_gemm import exact_swiglu  # noqa: E402

from engine.model.layers import rope_cos_sin  # noqa: E402

DTYPE, ULP = torch.float16, 2**-10


def check(name: str, got: torch.Tensor, exact: torch.Tensor, seed: int) -> None:
    err = (got.double() - exact).abs()
    bound = ULP * exact.abs() + 1e-3 * exact.pow(2).mean().sqrt()
    assert got.dtype == DTYPE and got.shape == exact.shape, f"{name}: {got.dtype} {tuple(got.shape)}"
    assert (err <= bound).all(), f"{name} (seed {seed}): worst error {err.max().item():.3g}"
    print(f"{name}: worst error {err.max().item():.3g}, within the bound")


def swiglu(g: torch.Generator, seed: int) -> None:
    from engine.kernels.swiglu import swiglu_gemm

    for m, width, k in ((1, 136, 48), (37, 3072, 1024), (333, 1000, 96)):
        x = (torch.randn(m, k, generator=g) * 2).to(DTYPE)
        weight = (torch.randn(2 * width, k, generator=g) / k**0.5).to(DTYPE)
        check(f"swiglu M={m} I={width} K={k}", swiglu_gemm(x, weight), exact_swiglu(x, weight), seed)


def qkv_rope(g: torch.Generator, seed: int) -> None:
    from engine.kernels.qkv_rope import qkv_rope_gemm

    for m, (q_heads, kv_heads, d, k) in (
        (1, (8, 4, 64, 48)),
        (333, (16, 8, 128, 1024)),
        (37, (4, 2, 128, 64)),
    ):
        n = (q_heads + 2 * kv_heads) * d
        x = (torch.randn(m, k, generator=g) * 2).to(DTYPE)
        weight = (torch.randn(n, k, generator=g) / k**0.5).to(DTYPE)
        q_weight, k_weight = ((torch.rand(d, generator=g) + 0.5).to(DTYPE) for _ in range(2))
        cos, sin = rope_cos_sin(torch.randint(0, 4000, (m,), generator=g), d, 1e6, DTYPE)
        got = qkv_rope_gemm(x, weight, q_weight, k_weight, cos, sin, EPS, q_heads, kv_heads)
        exact = exact_qkv_rope(x, weight, q_weight, k_weight, cos, sin, q_heads, kv_heads)
        check(f"qkv_rope M={m} heads={q_heads}+{kv_heads}x{d} K={k}", got, exact, seed)


if __name__ == "__main__":
    generator = torch.Generator()
    {"swiglu": swiglu, "qkv_rope": qkv_rope}[sys.argv[1]](generator, generator.seed())
