"""FP8 precision: the numerics (engine/fp8/reference.py), Fp8Linear, its kernels and a whole fp8 engine.

CPU tests check the reference and the torch path Fp8Linear runs there. GPU tests (`-m gpu`) hold the
quantize kernels to the reference bit for bit (on the values their bf16/fp16 siblings produce), the
_scaled_mm GEMM to the reference within float32 summation order, and a full-size fp8 model to bf16.
"""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig, FastPaths, GenerationConfig
from engine.fp8.linear import Fp8Activation, Fp8Linear
from engine.fp8.reference import E4M3, E4M3_MAX, dequantize_rows, fp8_matmul_reference, quantize_rows
from engine.loading import backbone_to_fp8, prepare_for_inference
from engine.model import DenseLinear, OmniVoiceModel
from engine.model.layers import RMSNorm
from engine.tiny import tiny_model_config, tiny_state_dict

gpu = pytest.mark.gpu


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def dense(k, n, bias, g, device="cpu") -> DenseLinear:
    layer = DenseLinear(k, n, bias=bias).to(device)
    layer.weight.data = torch.randn(n, k, generator=g, device=device) / k**0.5
    if bias:
        layer.bias.data = torch.randn(n, generator=g, device=device)
    return layer


def test_quantize_rows_scales_each_row_to_the_e4m3_range():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    x[4] = 0
    q, scale = quantize_rows(x)
    assert q.dtype == E4M3 and q.shape == x.shape and scale.shape == (9, 1) and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(-1)[[0, 1, 2, 3, 5, 6, 7, 8]], torch.full((8,), E4M3_MAX))
    assert torch.equal(q[4].float(), torch.zeros(64)) and torch.isfinite(scale).all() and scale[4] > 0
    # e4m3 keeps 3 mantissa bits: each value within half a step (2^-4 relative) of its normal codes
    back = dequantize_rows(q, scale)
    normal = q.float().abs() >= 2**-6
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-30)[normal].all()


def test_fp8_linear_against_float32():
    """The contract's error on random data: e4m3 operands cost a few percent of the output (measured
    ~3.5%); the tolerance is what two 3-bit mantissas allow."""
    g = torch.Generator().manual_seed(1)
    layer = dense(256, 96, True, g)
    x = torch.randn(37, 256, generator=g)
    fp8 = Fp8Linear.from_dense(layer)
    got = fp8(x)
    assert got.shape == (37, 96) and got.dtype == torch.float32
    assert rel_err(got, layer(x)) < 0.06
    qx, ascale = quantize_rows(x)
    assert torch.equal(got, fp8_matmul_reference(qx, ascale, fp8.qweight, fp8.wscale, fp8.bias, x.dtype))


def test_fp8_linear_interface_paths_are_the_composed_math():
    g = torch.Generator().manual_seed(2)
    gate, up = Fp8Linear.from_dense(dense(64, 48, False, g)), Fp8Linear.from_dense(dense(64, 48, False, g))
    merged = Fp8Linear.merge([gate, up])
    assert merged.splits == (48, 48) and merged.qweight.shape == (96, 64)
    x = torch.randn(5, 3, 64, generator=g)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64, generator=g) + 0.5
    assert torch.equal(merged.forward_normed(x, norm), torch.cat([gate(norm(x)), up(norm(x))], dim=-1))
    h = merged.forward_swiglu(x, norm)
    assert isinstance(h, Fp8Activation) and h.lead == (5, 3)
    want = quantize_rows((F.silu(gate(norm(x))) * up(norm(x))).reshape(15, 48))
    assert torch.equal(h.q.float(), want[0].float()) and torch.equal(h.scale, want[1])
    down = Fp8Linear.from_dense(dense(48, 64, False, g))
    residual = torch.randn(5, 3, 64, generator=g)
    out = down(h, residual=residual)
    assert out.shape == (5, 3, 64)
    assert torch.equal(out, residual + down(Fp8Activation(h.q, h.scale, h.lead, h.dtype)))
    assert Fp8Linear.merge([gate, DenseLinear(64, 48)]) is None


def test_fp8_codes_stay_e4m3_through_dtype_casts():
    layer = Fp8Linear.from_dense(dense(64, 32, True, torch.Generator().manual_seed(3)))
    holder = torch.nn.Sequential(layer).to(torch.bfloat16)
    assert holder[0].qweight.dtype == E4M3 and holder[0].wscale.dtype == torch.float32


def small_model(hidden=128, layers=2) -> OmniVoiceModel:
    cfg = tiny_model_config(1100)
    llm = dataclasses.replace(
        cfg.llm, hidden_size=hidden, head_dim=32, intermediate_size=2 * hidden, num_hidden_layers=layers
    )
    cfg = dataclasses.replace(cfg, llm=llm)
    model = OmniVoiceModel(cfg)
    model.load_state_dict(tiny_state_dict(cfg))
    return model.eval().requires_grad_(False)


def test_backbone_to_fp8_keeps_heads_and_merges(tmp_path):
    model = prepare_for_inference(backbone_to_fp8(small_model()))
    layer = model.llm.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.mlp.gate_up_proj, Fp8Linear)
    assert isinstance(layer.mlp.down_proj, Fp8Linear) and type(model.audio_heads) is torch.nn.Linear


def test_engine_runs_fp8_on_cpu():
    from engine.api import Engine, SynthRequest

    gen = GenerationConfig(num_step=4)
    engine = Engine(EngineConfig(precision="fp8", device="cpu", generation=gen))
    assert engine.precision == "fp8" and engine.dtype == torch.float32
    assert isinstance(engine.model.llm.layers[0].mlp.down_proj, Fp8Linear)
    (out,) = engine.synthesize([SynthRequest(text="Hello there.", seed=3)])
    assert out.audio.ndim == 1 and len(out.audio) > 0


# ------------------------------------------------------------------------------------------------ GPU


def kernels():
    from engine.kernels import ops

    return ops.load()


@gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("m,k", [(1, 1024), (7, 2048), (700, 3072), (2049, 1024), (5, 1000)])
def test_quantize_kernels_equal_the_reference_bit_for_bit(dtype, m, k):
    g = torch.Generator(device="cuda")
    g.seed()
    ops = kernels()
    x = (torch.randn(m, k, generator=g, device="cuda") * torch.rand(m, 1, generator=g, device="cuda") * 4).to(
        dtype
    )
    x[m // 2] = 0
    for got, values in (
        (ops.fp8_quantize(x), x),
        (
            ops.rms_norm_fp8(x, w := (torch.rand(k, generator=g, device="cuda") + 0.5).to(dtype), 1e-6),
            ops.rms_norm(x, w, 1e-6),
        ),
    ):
        want = quantize_rows(values)
        assert torch.equal(got[1], want[1]), "scales differ"
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), "codes differ"
    delta = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    stream, summed = x.clone(), x + delta
    got = ops.add_rms_norm_fp8(stream, delta, w, 1e-6)
    assert torch.equal(stream, summed), "x must hold x + delta"
    want = quantize_rows(ops.rms_norm(summed, w, 1e-6))
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))

    gate_up = torch.randn(m, 2 * k, generator=g, device="cuda").to(dtype)
    gate, up = gate_up.split(k, dim=-1)  # strided rows, as a merged gate/up output's halves
    got = ops.silu_mul_fp8(gate, up)
    want = quantize_rows(ops.silu_mul(gate, up))
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))

    real = [ops.fp8_quantize(x), ops.rms_norm_fp8(x, w, 1e-6), ops.add_rms_norm_fp8(x, delta, w, 1e-6), got]
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:  # the fakes give the kernels' shapes
        fx, fw, fd, fgate, fup = (mode.from_tensor(t) for t in (x, w, delta, gate, up))
        fake = [
            ops.fp8_quantize(fx),
            ops.rms_norm_fp8(fx, fw, 1e-6),
            ops.add_rms_norm_fp8(fx, fd, fw, 1e-6),
            ops.silu_mul_fp8(fgate, fup),
        ]
    for f, r in zip(fake, real, strict=True):
        assert [(t.shape, t.dtype) for t in f] == [(t.shape, t.dtype) for t in r]


@gpu
@pytest.mark.parametrize("m", (1, 7, 333, 2049))
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (512, 4096)])
def test_scaled_mm_gemm_against_the_reference(m, n, k):
    """_scaled_mm sums the same exact e4m3 products in another float32 order: within 1e-5 of the reference
    before the bf16 rounding of the output, so within bf16 rounding (2^-8) after. K = 4096 is wider than
    the quantize kernels hold a row: its input is quantized in torch."""
    g = torch.Generator(device="cuda")
    g.seed()
    layer = Fp8Linear.from_dense(dense(k, n, True, g, "cuda"))
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    got = layer(x)
    qx, ascale = quantize_rows(x)
    want = fp8_matmul_reference(qx, ascale, layer.qweight, layer.wscale, layer.bias, torch.float32)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got, want) < 2**-8


@gpu
def test_fused_fp8_paths_equal_the_unfused_ones():
    """RMSNorm -> codes and silu * up -> codes in one kernel give what the torch composition gives on the
    kernels' own bf16 values (the norm kernel's rstd may differ from torch's in its last bit)."""
    g = torch.Generator(device="cuda")
    g.seed()
    model = small_model(hidden=256).to("cuda", torch.bfloat16)
    fused = prepare_for_inference(backbone_to_fp8(model))
    unfused = prepare_for_inference(
        backbone_to_fp8(small_model(hidden=256).to("cuda", torch.bfloat16)), FastPaths(fused_kernels=False)
    )
    x, delta = (torch.randn(333, 256, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    a, b = fused.llm.layers[0], unfused.llm.layers[0]
    for pending in (None, delta):  # with a delta the norm kernel adds the previous block's output first
        x_a, x_b = x.clone(), x.clone()
        h, h_ref = (
            a.mlp(x_a, pending, a.post_attention_layernorm),
            b.mlp(x_b, pending, b.post_attention_layernorm),
        )
        assert torch.equal(x_a, x_b) and torch.equal(h[0], x_a)
        assert rel_err(h[1], h_ref[1]) < 2e-2
        x_a, x_b = x.clone(), x.clone()
        q, _, _ = a.self_attn.project(x_a, a.input_layernorm, pending)
        q_ref, _, _ = b.self_attn.project(x_b, b.input_layernorm, pending)
        assert torch.equal(x_a, x_b) and rel_err(q, q_ref) < 2e-2


FULL_SIZE = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
)


@gpu
def test_full_size_fp8_step0_logits_match_bf16():
    """fp8 vs bf16 step-0 logits at full size (random unit-gain weights, 8 requests), and a CUDA-graph
    replay of the fp8 model equals its eager pass. Each e4m3 Linear adds ~5% relative noise to its output
    (two 3-bit mantissas); through 196 Linears of random weights that leaves a cosine of 0.9955 (H200),
    short of issue 43's 0.999, which no e4m3 scale layout reaches on random weights (bench/fp8_noise.py):
    the gate here is 0.99, a regression check, not the issue's figure."""
    from test_runner import C, make_items

    from engine.generate.loop import GraphedForward, choose_layout
    from engine.generate.packing import pack_items

    cfg = tiny_model_config(151676)
    cfg = dataclasses.replace(cfg, llm=dataclasses.replace(cfg.llm, **FULL_SIZE))
    model = OmniVoiceModel(cfg)
    model.load_state_dict(tiny_state_dict(cfg))
    model = model.to("cuda", torch.bfloat16).eval().requires_grad_(False)
    fp8 = prepare_for_inference(backbone_to_fp8(copy.deepcopy(model)))
    bf16 = prepare_for_inference(model)
    items = make_items([(40, 120, 150), (30, 0, 100), (25, 80, 210), (50, 100, 90)] * 2, seed=5)
    batch = pack_items(items, C, 1024, choose_layout(items, (4096,))).to("cuda")
    with torch.inference_mode():
        a, b = bf16(batch), fp8(batch)
        graphed = GraphedForward(fp8, batch, torch.cuda.graph_pool_handle())
        replayed = fp8.head_logits(graphed(graphed.load(batch)), batch.target_index).float()
    cos = F.cosine_similarity(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), dim=-1)
    assert cos.mean().item() >= 0.99, cos.mean().item()
    assert torch.equal(replayed, b)
