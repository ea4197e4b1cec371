"""The Triton kernels of engine/kernels (swiglu.py, qkv_rope.py, guided_argmax.py) on the CPU under Triton's
interpreter, run by tests/test_triton_interpret.py in a process of its own (TRITON_INTERPRET=1 must be set
before Triton compiles anything), on fresh random inputs, with the GPU tests' references and tolerances
(tests/test_swiglu_gemm.py, test_qkv_rope_gemm.py, test_guided_argmax.py). The GEMMs in fp16 only, at odd M
and widths that are not multiples of a tile: the interpreter cannot store bf16 through tensor descriptors, and
the kernels' code is one for both types.

    TRITON_INTERPRET=1 python tests/interpret_kernels.py swiglu|qkv_rope|guided_argmax
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from test_guided_argmax import MASK, C, V  # noqa: E402
from test_qkv_rope_gemm import EPS, exact_qkv_rope  # noqa: E402
from test_swiglu_gemm import exact_swiglu  # noqa: E402

from engine.generate.decoding import guided_log_probs, predict  # noqa: E402
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


def guided_argmax(g: torch.Generator, seed: int) -> None:
    """As tests/test_guided_argmax.py: confidences within 1e-5 of torch's float32 path, its tokens wherever
    its two best classes differ by more, a tied class elsewhere; never MASK."""
    from engine.kernels.guided_argmax import guided_argmax as kernel

    for dtype in (torch.bfloat16, torch.float16):
        for rows, guidance in ((1, 2.0), (7, 0.0), (33, 0.7)):
            cond, uncond = ((3 * torch.randn(rows, C, V, generator=g)).to(dtype) for _ in range(2))
            tokens, confidence = kernel(cond, uncond, guidance, MASK)
            log_probs = guided_log_probs(cond.float(), uncond.float(), guidance, MASK)
            want_tokens, want_confidence = predict(log_probs, 0.0, None)
            name = f"guided_argmax {dtype} rows={rows} guidance={guidance} (seed {seed})"
            assert (confidence - want_confidence).abs().max().item() <= 1e-5, name
            best, second = log_probs.topk(2, dim=-1).values.unbind(-1)
            clear = best - second > 1e-5
            assert torch.equal(tokens[clear], want_tokens[clear]), name
            picked = log_probs.gather(-1, tokens[..., None]).squeeze(-1)
            assert (picked >= best - 1e-5).all() and not (tokens == MASK).any(), name
            print(f"{name}: as torch's path")


if __name__ == "__main__":
    generator = torch.Generator()
    cases = {"swiglu": swiglu, "qkv_rope": qkv_rope, "guided_argmax": guided_argmax}
    cases[sys.argv[1]](generator, generator.seed())
