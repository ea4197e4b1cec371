"""CPU side of the fused paths: when they are taken, and that the composed fallback is the unfused math.

The kernels themselves are tested on the GPU in tests/test_fused_kernels.py.
"""

import torch

from engine.checkpoint import load_model
from engine.kernels.fused import fused_enabled, fused_ops
from engine.model.layers import RMSNorm
from engine.quant.linear import W4A4Linear
from engine.quant.rtn import w4a4_copy
from engine.tiny import ensure_tiny_checkpoint


def test_fused_kernels_are_off_on_cpu_and_by_switch(monkeypatch):
    assert fused_ops(torch.zeros(2, 64, dtype=torch.bfloat16)) is None
    assert fused_enabled()
    monkeypatch.setenv("OVBATCH_FUSED_KERNELS", "0")
    assert not fused_enabled()


def test_w4a4_copy_replaces_backbone_linears_only(tmp_path):
    _, model = load_model(ensure_tiny_checkpoint(tmp_path))
    quantized = w4a4_copy(model, rank=8)
    kinds = {name: type(m) for name, m in quantized.named_modules()}
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    backbone = [n for n in linears if n.startswith("llm.")]
    assert backbone and all(kinds[n] is W4A4Linear for n in backbone)
    assert all(isinstance(model.get_submodule(n), torch.nn.Linear) for n in backbone), "the original is kept"
    assert all(quantized.get_submodule(n).rank == 8 for n in backbone)


def test_composed_rmsnorm_equals_the_unfused_math(tmp_path):
    _, model = load_model(ensure_tiny_checkpoint(tmp_path))
    layer = w4a4_copy(model).llm.layers[0]
    q_proj = layer.self_attn.q_proj
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, q_proj.in_features, generator=g)
    norm = RMSNorm(q_proj.in_features, 1e-6)
    norm.weight.data = torch.rand(q_proj.in_features, generator=g) + 0.5
    assert not q_proj.fuses_rmsnorm(x)
    assert torch.equal(q_proj.forward_rmsnorm(x, norm), q_proj(norm(x)))


def test_composed_residual_add_equals_the_unfused_math(tmp_path):
    _, model = load_model(ensure_tiny_checkpoint(tmp_path))
    o_proj = w4a4_copy(model).llm.layers[0].self_attn.o_proj
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, o_proj.in_features, generator=g)
    x = torch.randn(5, o_proj.out_features, generator=g)
    assert not o_proj.fuses_residual(h)
    assert torch.equal(o_proj.forward_plus(h, x), x + o_proj(h))
