"""CPU side of the fast paths: the switches fixed at load, merging at load, and that each Linear
implementation's composed fallback is the unfused math.

The kernels themselves are tested on the GPU in tests/test_fused_kernels.py.
"""

import pytest
import torch

from engine.config import EngineConfig, FastPaths
from engine.errors import InputError
from engine.kernels.fused import fused_ops
from engine.loading import backbone_to_fp8, load_model
from engine.model import DenseLinear
from engine.model.layers import RMSNorm
from engine.quantizer.rtn import w4a4_copy
from engine.tiny import ensure_tiny_checkpoint
from engine.w4a4.linear import W4A4Group, W4A4Linear


def test_fused_kernels_cannot_take_cpu_tensors():
    assert fused_ops(torch.zeros(2, 64, dtype=torch.bfloat16)) is None
    assert fused_ops(torch.zeros(2, 64), (torch.float32,)) is None


def test_the_codecs_snakes_are_fused_only_where_asked_and_compute_the_same_off_cuda(tmp_path):
    from engine.codec.acoustic import Snake
    from engine.codec.model import Codec

    codec_dir = ensure_tiny_checkpoint(tmp_path) / "audio_tokenizer"
    snakes = [m for m in Codec.from_dir(codec_dir, fused=True).modules() if isinstance(m, Snake)]
    assert snakes and all(s.fused for s in snakes)
    assert not any(m.fused for m in Codec.from_dir(codec_dir).modules() if isinstance(m, Snake))
    snake, x = snakes[0], torch.randn(2, snakes[0].alpha.shape[1], 33)
    want = x + (snake.alpha + 1e-9).reciprocal() * torch.sin(snake.alpha * x).pow(2)
    assert torch.equal(snake(x), want)  # a CPU input takes torch's ops
    # with a conv's bias added first and the padding past each item's length zeroed, as the kernel does
    bias = torch.randn(x.shape[1])
    got = snake(x, bias=bias, lengths=[33, 20])
    shifted = x + bias[:, None]
    want = shifted + (snake.alpha + 1e-9).reciprocal() * torch.sin(snake.alpha * shifted).pow(2)
    want[1, :, 20:] = 0
    assert torch.equal(got, want)


def test_fast_paths_are_fixed_at_load(tmp_path):
    tiny = ensure_tiny_checkpoint(tmp_path)
    _, model = load_model(tiny, fast_paths=FastPaths(fused_kernels=False, grouped_projections=False))
    flags = [m.fused for m in model.modules() if hasattr(m, "fused")]
    assert flags and not any(flags)
    assert model.llm.layers[0].self_attn.qkv_proj is None and model.llm.layers[0].mlp.gate_up_proj is None
    _, model = load_model(tiny)
    assert all(m.fused for m in model.modules() if hasattr(m, "fused"))
    with pytest.raises(InputError, match="w4a4_backend='fast'"):
        EngineConfig(fast_paths=FastPaths(w4a4_backend="fast"))


def test_projections_are_merged_once_at_load_with_the_same_outputs(tmp_path):
    tiny = ensure_tiny_checkpoint(tmp_path)
    _, apart = load_model(tiny, fast_paths=FastPaths(grouped_projections=False))
    _, merged = load_model(tiny)
    attn, mlp = merged.llm.layers[0].self_attn, merged.llm.layers[0].mlp
    assert isinstance(attn.qkv_proj, DenseLinear) and not hasattr(attn, "q_proj")
    assert (
        attn.qkv_proj.splits == (attn.num_heads * attn.head_dim,) + (attn.num_kv_heads * attn.head_dim,) * 2
    )
    assert isinstance(mlp.gate_up_proj, DenseLinear) and not hasattr(mlp, "up_proj")
    names = {n for n, _ in merged.named_parameters()}
    assert "llm.layers.0.self_attn.qkv_proj.weight" in names
    assert not any("q_proj" in n or "gate_proj" in n for n in names)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, attn.qkv_proj.in_features, generator=g)
    norm = merged.llm.layers[0].input_layernorm
    q, k, v = attn.project(x, norm)
    ref = apart.llm.layers[0].self_attn
    torch.testing.assert_close(q, ref.q_proj(norm(x)), rtol=0, atol=1e-5)
    torch.testing.assert_close(v, ref.v_proj(norm(x)), rtol=0, atol=1e-5)
    torch.testing.assert_close(
        stream(mlp(x.clone(), None, norm)),
        stream(apart.llm.layers[0].mlp(x.clone(), None, norm)),
        rtol=0,
        atol=1e-5,
    )  # fp32 on the CPU: one GEMM or three differ only in summation order


def stream(pair):
    """The residual stream x + delta a block hands on as (x, delta)."""
    x, delta = pair
    return x if delta is None else x + delta


def test_dense_merge_keeps_biases_and_declines_mixed_inputs():
    g = torch.Generator().manual_seed(0)
    a, b = DenseLinear(16, 8, bias=True), DenseLinear(16, 4)
    for p in (a.weight, a.bias, b.weight):
        p.data = torch.randn(p.shape, generator=g)
    merged = DenseLinear.merge([a, b])
    x = torch.randn(3, 16, generator=g)
    torch.testing.assert_close(merged(x), torch.cat([a(x), b(x)], dim=-1))
    assert merged.splits == (8, 4)
    assert DenseLinear.merge([a, DenseLinear(8, 4)]) is None


def test_w4a4_copy_keeps_biases_and_merges_groups(tmp_path):
    _, model = load_model(ensure_tiny_checkpoint(tmp_path))
    quantized = w4a4_copy(model, rank=8)
    attn, mlp = quantized.llm.layers[0].self_attn, quantized.llm.layers[0].mlp
    assert isinstance(attn.qkv_proj, W4A4Group) and isinstance(mlp.gate_up_proj, W4A4Group)
    assert isinstance(attn.o_proj, W4A4Linear) and attn.o_proj.rank == 8
    assert isinstance(model.llm.layers[0].self_attn.o_proj, DenseLinear), "the original is kept"
    linear = DenseLinear(64, 32, bias=True)
    torch.nn.init.normal_(linear.bias)
    holder = torch.nn.Module()
    holder.llm = torch.nn.Module()
    holder.llm.layers = torch.nn.ModuleList([torch.nn.Module()])
    holder.llm.layers[0].proj = linear
    copy = w4a4_copy(holder).llm.layers[0].proj
    assert copy.bias is not None and torch.equal(copy.bias, linear.bias.float())
    x = torch.randn(4, 64)
    assert (copy(x) - linear(x)).abs().max() < 0.5 * linear(x).abs().max()


def w4a4_layer(tmp_path):
    _, model = load_model(ensure_tiny_checkpoint(tmp_path), fast_paths=FastPaths(grouped_projections=False))
    return w4a4_copy(model).llm.layers[0]


def test_composed_rmsnorm_equals_the_unfused_math(tmp_path):
    q_proj = w4a4_layer(tmp_path).self_attn.q_proj
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, q_proj.in_features, generator=g)
    norm = RMSNorm(q_proj.in_features, 1e-6)
    norm.weight.data = torch.rand(q_proj.in_features, generator=g) + 0.5
    assert torch.equal(q_proj.forward_normed(x, norm), q_proj(norm(x)))


def test_composed_residual_add_equals_the_unfused_math(tmp_path):
    o_proj = w4a4_layer(tmp_path).self_attn.o_proj
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, o_proj.in_features, generator=g)
    x = torch.randn(5, o_proj.out_features, generator=g)
    assert torch.equal(o_proj(h, residual=x), x + o_proj(h))


def test_w4a4_group_on_the_reference_runs_its_members_one_by_one(tmp_path):
    layer = w4a4_layer(tmp_path)
    members = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
    group = W4A4Linear.merge(members)
    x = torch.randn(6, group.in_features)
    assert torch.equal(group(x), torch.cat([m(x) for m in members], dim=-1))
    norm = layer.input_layernorm
    assert torch.equal(group.forward_normed(x, norm), torch.cat([m(norm(x)) for m in members], dim=-1))


@pytest.mark.parametrize("precision", ("dense", "fp8", "w4a4"))
@pytest.mark.parametrize("grouped", (False, True))
def test_a_pending_residual_add_lands_in_x_before_the_norm(precision, grouped, tmp_path):
    """forward_normed / forward_swiglu with delta (the previous block's output not yet added): x + delta is
    written over x, and the result is the Linear of norm(x + delta), as the torch composition gives it."""
    _, model = load_model(ensure_tiny_checkpoint(tmp_path), fast_paths=FastPaths(grouped_projections=grouped))
    model = {"dense": lambda m: m, "fp8": backbone_to_fp8, "w4a4": w4a4_copy}[precision](model)
    layer = model.llm.layers[0]
    attn, mlp, norm = layer.self_attn, layer.mlp, layer.input_layernorm
    linear = attn.qkv_proj if grouped else attn.q_proj
    g = torch.Generator().manual_seed(1)
    x, delta = (torch.randn(7, linear.in_features, generator=g) for _ in range(2))
    stream = x.clone()
    assert torch.equal(linear.forward_normed(stream, norm, delta), linear(norm(x + delta)))
    assert torch.equal(stream, x + delta)
    if grouped:
        stream = x.clone()
        want = mlp.down_proj(mlp.gate_up_proj.forward_swiglu(x + delta, norm))  # fp8 hands on codes
        assert torch.equal(mlp.down_proj(mlp.gate_up_proj.forward_swiglu(stream, norm, delta)), want)
        assert torch.equal(stream, x + delta)
