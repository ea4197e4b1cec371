"""The bf16/fp16 gate/up GEMM that writes silu(gate) * up (engine/kernels/swiglu.py) and where the engine runs
it: CPU tests for the switch and the fallback, GPU tests (`-m gpu`) for the kernel against a float64
reference and for its dispatch."""

import logging

import pytest
import torch
import torch.nn.functional as F

from engine.config import FastPaths
from engine.loading import load_model
from engine.model import DenseLinear
from engine.model.layers import RMSNorm, silu_mul
from engine.tiny import ensure_tiny_checkpoint

gpu = pytest.mark.gpu


@pytest.mark.parametrize("switch", (True, False))
def test_the_switch_reaches_the_merged_gate_up_layer(switch, tmp_path):
    _, model = load_model(ensure_tiny_checkpoint(tmp_path), fast_paths=FastPaths(swiglu_gemm=switch))
    gate_up = model.llm.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, DenseLinear) and gate_up.swiglu_gemm is switch


def test_off_cuda_the_gate_up_layer_composes_silu_mul_of_its_outputs():
    g = torch.Generator().manual_seed(0)
    gate, up = DenseLinear(64, 48), DenseLinear(64, 48)
    merged = DenseLinear.merge([gate, up])
    x, norm = torch.randn(5, 64, generator=g), RMSNorm(64, 1e-6)
    with torch.no_grad():  # float32 GEMMs of 96 and of 48 rows: equal up to their summation order
        torch.testing.assert_close(merged.forward_swiglu(x, norm), F.silu(gate(norm(x))) * up(norm(x)))


def exact_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = (x.double() @ weight.double().T).chunk(2, dim=-1)
    return F.silu(gate) * up


@gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize(
    "m,width,k", [(1, 3072, 1024), (37, 3072, 1024), (333, 136, 48), (2049, 3072, 1024), (700, 1000, 2048)]
)
def test_the_kernel_against_a_float64_reference(dtype, m, width, k):
    """Fresh random inputs, odd M and widths that are not multiples of the tile: each element within one
    unit in the last place of the out dtype, plus 1e-3 of the RMS where float32 sums of K products that
    cancel differ by their order; and no further from the reference than cuBLAS + silu_mul, which rounds
    gate and up before the SiLU."""
    from engine.kernels.swiglu import can_run, swiglu_gemm

    g = torch.Generator(device="cuda")
    g.seed()
    x = (torch.randn(m, k, generator=g, device="cuda") * 2).to(dtype)
    weight = (torch.randn(2 * width, k, generator=g, device="cuda") / k**0.5).to(dtype)
    assert can_run(weight)
    got = swiglu_gemm(x, weight)
    exact = exact_swiglu(x, weight)
    assert got.dtype == dtype and got.shape == (m, width)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    err = (got.double() - exact).abs()
    assert (err <= ulp * exact.abs() + 1e-3 * exact.pow(2).mean().sqrt()).all(), err.max().item()
    gate, up = (x @ weight.T).chunk(2, dim=-1)
    before = F.silu(gate.float()) * up.float()  # what the silu_mul kernel computes from cuBLAS's outputs
    assert (got.double() - exact).norm() <= (before.double() - exact).norm()


@gpu
@pytest.mark.parametrize("switch", (True, False))
def test_the_mlp_runs_the_kernel_where_switched_on(switch, tmp_path):
    from engine.kernels.swiglu import swiglu_gemm

    tiny, paths = ensure_tiny_checkpoint(tmp_path), FastPaths(swiglu_gemm=switch)
    _, model = load_model(tiny, device="cuda", dtype=torch.bfloat16, fast_paths=paths)
    layer = model.llm.layers[0]
    gate_up, norm = layer.mlp.gate_up_proj, layer.post_attention_layernorm
    x = torch.randn(333, gate_up.in_features, device="cuda", dtype=gate_up.weight.dtype)
    got = gate_up.forward_swiglu(x, norm)
    if switch:
        want = swiglu_gemm(norm(x), gate_up.weight)
    else:
        want = silu_mul(*(norm(x) @ gate_up.weight.T).split(gate_up.splits, dim=-1), True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("version", ("3.3.1", "3.2.0", "2.3.1"))
def test_a_triton_without_what_the_kernel_uses_leaves_it_off(version, monkeypatch, caplog):
    """torch 2.7's Triton 3.3 has no tl.range(flatten=...): the kernel would fail at its first compile, in a
    forward, so the engine keeps cuBLAS + silu_mul there."""
    import sys
    import types

    from engine.model import linear

    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=version))
    linear._triton_module.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="engine.model.linear"):
            assert linear._triton_module("swiglu") is None
        assert f"Triton {version} is older than 3.4" in caplog.text
    finally:
        linear._triton_module.cache_clear()
