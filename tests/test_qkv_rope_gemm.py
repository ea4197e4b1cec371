"""The bf16/fp16 q/k/v GEMM that norms and rotates q and k in its epilogue (engine/kernels/qkv_rope.py) and
where the model runs it: CPU tests for the switch and the fallback, GPU tests (`-m gpu`) for the kernel
against a float64 reference and for the attention block with it on and off."""

import dataclasses

import pytest
import torch

from engine.config import FastPaths
from engine.loading import prepare_for_inference
from engine.model import OmniVoiceModel
from engine.model.layers import rope_cos_sin
from engine.tiny import tiny_model_config, tiny_state_dict

gpu = pytest.mark.gpu
EPS = 1e-6


def model_with_heads(q_heads=4, kv_heads=2, head_dim=128, switch=True, device="cpu", dtype=torch.float32):
    cfg = tiny_model_config(1100)
    llm = dataclasses.replace(
        cfg.llm, hidden_size=256, head_dim=head_dim, num_attention_heads=q_heads, num_key_value_heads=kv_heads
    )
    model = OmniVoiceModel(dataclasses.replace(cfg, llm=llm))
    model.load_state_dict(tiny_state_dict(model.cfg))
    model = model.to(device, dtype).eval().requires_grad_(False)
    return prepare_for_inference(model, FastPaths(qkv_rope_gemm=switch))


@pytest.mark.parametrize("switch", (True, False))
def test_the_switch_reaches_the_merged_qkv_layer(switch):
    assert model_with_heads(switch=switch).llm.layers[0].self_attn.qkv_proj.qkv_rope_gemm is switch


def test_off_cuda_the_block_composes_qk_norm_rope():
    layer = model_with_heads().llm.layers[0]
    attn, norm = layer.self_attn, layer.input_layernorm
    x = torch.randn(7, 256)
    cos, sin = rope_cos_sin(torch.arange(7), 128, 1e6, x.dtype)
    assert attn.qkv_proj.forward_qkv_rope(x, norm, None, attn.q_norm, attn.k_norm, cos, sin, (4, 2)) is None


def exact_qkv_rope(x, weight, q_weight, k_weight, cos, sin, q_heads, kv_heads):
    y = x.double() @ weight.double().T
    m, d = y.shape[0], cos.shape[-1]

    def norm_rope(t, w, heads):
        t = t.reshape(m, heads, d)
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
        rotated = torch.cat((-t[..., d // 2 :], t[..., : d // 2]), -1)
        return (t * cos.double()[:, None] + rotated * sin.double()[:, None]).reshape(m, -1)

    q_end, k_end = q_heads * d, (q_heads + kv_heads) * d
    return torch.cat(
        [
            norm_rope(y[:, :q_end], q_weight, q_heads),
            norm_rope(y[:, q_end:k_end], k_weight, kv_heads),
            y[:, k_end:],
        ],
        -1,
    )


@gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("m", (1, 37, 333, 2049))
@pytest.mark.parametrize("heads", ((16, 8, 128, 1024), (8, 4, 64, 48)))
def test_the_kernel_against_a_float64_reference(dtype, m, heads):
    """Fresh random inputs, odd M: within one unit in the last place of the out dtype plus 1e-3 of the RMS
    (float32 sums of K products in another order), and no further from the reference than cuBLAS + the
    qk_norm_rope kernel, which rounds the GEMM's output and the normed heads."""
    from engine.kernels.fused import fused_ops
    from engine.kernels.qkv_rope import can_run, qkv_rope_gemm

    q_heads, kv_heads, d, k = heads
    g = torch.Generator(device="cuda")
    g.seed()
    n = (q_heads + 2 * kv_heads) * d
    x = (torch.randn(m, k, generator=g, device="cuda") * 2).to(dtype)
    weight = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(dtype)
    q_weight, k_weight = ((torch.rand(d, generator=g, device="cuda") + 0.5).to(dtype) for _ in range(2))
    positions = torch.randint(0, 4000, (m,), generator=g, device="cuda")
    cos, sin = rope_cos_sin(positions, d, 1e6, dtype)
    assert can_run(weight, q_heads, kv_heads, d)
    got = qkv_rope_gemm(x, weight, q_weight, k_weight, cos, sin, EPS, q_heads, kv_heads)
    exact = exact_qkv_rope(x, weight, q_weight, k_weight, cos, sin, q_heads, kv_heads)
    assert got.dtype == dtype and got.shape == (m, n)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    err = (got.double() - exact).abs()
    assert (err <= ulp * exact.abs() + 1e-3 * exact.pow(2).mean().sqrt()).all(), err.max().item()
    y = x @ weight.T
    q_end, k_end = q_heads * d, (q_heads + kv_heads) * d
    q, kk = fused_ops(y).qk_norm_rope(
        y[:, :q_end].view(m, q_heads, d),
        y[:, q_end:k_end].view(m, kv_heads, d),
        q_weight,
        k_weight,
        cos,
        sin,
        EPS,
    )
    before = torch.cat([q.reshape(m, -1), kk.reshape(m, -1), y[:, k_end:]], -1)
    assert (got.double() - exact).norm() <= (before.double() - exact).norm()


@gpu
def test_a_model_with_the_kernel_on_and_off():
    """Same weights (2 layers, 4 + 2 heads of 128): q/k/v from the kernel (on) against cuBLAS + qk_norm_rope
    (off) within their roundings; the logits through attention on the kernel's strided q and k likewise;
    and a CUDA-graph replay equals the eager pass."""
    from test_runner import C, make_items

    from engine.generate.loop import GraphedForward, choose_layout
    from engine.generate.packing import pack_items

    on, off = (model_with_heads(switch=s, device="cuda", dtype=torch.bfloat16) for s in (True, False))
    g = torch.Generator(device="cuda")
    g.seed()
    x = torch.randn(333, 256, generator=g, device="cuda", dtype=torch.bfloat16)
    cos, sin = rope_cos_sin(torch.arange(333, device="cuda"), 128, 1e6, torch.bfloat16)
    layers = on.llm.layers[0], off.llm.layers[0]
    got, want = (
        layer.self_attn.project_rope(x.clone(), layer.input_layernorm, None, cos, sin) for layer in layers
    )
    for a, b in zip(got, want, strict=True):
        a, b = a.reshape(333, -1).float(), b.reshape(333, -1).float()
        assert ((a - b).norm() / b.norm()).item() < 1e-2
    items = make_items([(40, 120, 150), (30, 0, 100), (25, 80, 210)], seed=5)
    batch = pack_items(items, C, 1024, choose_layout(items, (2048,))).to("cuda")
    with torch.inference_mode():
        a, b = on(batch).float(), off(batch).float()
        graphed = GraphedForward(on, batch, torch.cuda.graph_pool_handle())
        replayed = on.head_logits(graphed(graphed.load(batch)), batch.target_index).float()
    cos_ab = torch.nn.functional.cosine_similarity(
        a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), dim=-1
    )
    assert cos_ab.mean().item() > 0.999, cos_ab.mean().item()
    assert torch.equal(replayed, a)
