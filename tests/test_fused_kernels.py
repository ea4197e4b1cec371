"""The fused kernels against the unfused torch path they replace (GPU only; `pytest -m gpu`).

RMSNorm -> quantize, RMSNorm, SiLU(gate) * up and the q/k head norm + RoPE on fresh random inputs, odd M,
poisoned outputs; then whole models with the fused paths on and off (FastPaths.fused_kernels).
SiLU(gate) * up is exact. The norms sum squares in
another order than torch's reduction, so rstd may differ in its last bit and, rarely, a bf16 rounding of
a normed value flips.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_kernels import (
    DEV,
    ODD_M,
    fresh_generator,
    poison,
    random_activations,
    random_layer,
    rel_err,
)
from test_runner import C, make_items

from engine.config import FastPaths
from engine.generate.loop import choose_layout
from engine.generate.packing import pack_items
from engine.kernels import CudaW4A4Backend
from engine.kernels import ops as kops
from engine.loading import load_model, prepare_for_inference
from engine.model.layers import RMSNorm, apply_rope, rms_norm, rope_cos_sin
from engine.quantizer.rtn import w4a4_copy
from engine.tiny import ensure_tiny_checkpoint

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float16)
REPO = Path(__file__).resolve().parents[1]


def quantize_outputs_poisoned(m, k, rank):
    m_pad, groups = kops.padded_rows(m), k // 64
    poison(
        ((m_pad // 128, groups, 8192), torch.int8),
        ((groups, m_pad), torch.float16),
        ((m_pad,), torch.float32),
        ((m_pad, rank), torch.float32),
    )


def assert_quantized_close(fused, unfused, m, max_flips):
    """Quantized values, scales (ratios and row maxima) and low-rank activations of the fused kernel against
    the unfused one."""
    (qf, rf, af, lf), (qu, ru, au, lu) = fused, unfused
    differ = (qf != qu).sum().item()
    assert differ <= max_flips, f"{differ} quantized values differ"
    assert torch.isfinite(rf).all() and torch.isfinite(af).all() and torch.isfinite(lf).all()
    assert rel_err(rf[:, :m], ru[:, :m]) < 1e-3 and rel_err(af[:m], au[:m]) < 1e-3
    assert rel_err(lf[:m], lu[:m]) < 1e-3


def random_norm(k, dtype, g) -> RMSNorm:
    norm = RMSNorm(k, 1e-6).to(DEV)
    norm.weight.data = (torch.rand(k, generator=g, device=DEV) + 0.5).to(dtype)
    return norm


def residual_stream(m, k, dtype, g):
    """Rows of very different magnitudes, as a residual stream has."""
    x = random_activations(m, k, torch.float32, g)
    return (x * torch.exp(torch.randn(m, 1, generator=g, device=DEV))).to(dtype)  # finite in fp16


@pytest.mark.parametrize("m", (*ODD_M, 17001))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smooth", (False, True))
def test_rmsnorm_quantize_matches_norm_then_quantize(m, dtype, smooth):
    g = fresh_generator()
    k = 1024
    packed = CudaW4A4Backend().prepare(random_layer(2048, k, 32, smooth=smooth, bias=False, g=g))
    x, norm = residual_stream(m, k, dtype, g), random_norm(k, dtype, g)
    ops = kops.load()
    normed = rms_norm(x, norm.weight, norm.eps)  # torch's
    unfused = ops.quantize_act_lora_down(normed, packed.smooth, packed.pd_t[dtype])
    quantize_outputs_poisoned(m, k, 32)
    fused = ops.rmsnorm_quantize_act_lora_down(x, norm.weight, norm.eps, packed.smooth, packed.pd_t[dtype])
    torch.cuda.synchronize()
    # a flipped rounding changes a group's max at worst: allow one word in 2000 to differ
    assert_quantized_close(fused, unfused, m, max_flips=max(2, fused[0].numel() // 2000))


@pytest.mark.parametrize("tokens", (*ODD_M, 17001))
@pytest.mark.parametrize("dtype", DTYPES)
# (20, 2, 64): 22 heads, 4 or 16 a warp: the last warp of each token part empty
@pytest.mark.parametrize(
    "heads,kv_heads,d", ((16, 8, 128), (4, 2, 16), (3, 1, 64), (2, 2, 256), (5, 1, 32), (20, 2, 64))
)
def test_qk_norm_rope_matches_torch(tokens, dtype, heads, kv_heads, d):
    g = fresh_generator()
    qkv = residual_stream(tokens, (heads + 2 * kv_heads) * d, dtype, g)
    q = qkv[:, : heads * d].view(tokens, heads, d)  # views into the fused projection output
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
    q_norm, k_norm = random_norm(d, dtype, g), random_norm(d, dtype, g)
    positions = torch.randint(0, 4096, (tokens,), generator=g, device=DEV)
    cos, sin = rope_cos_sin(positions, d, 1e6, dtype)
    want_q, want_k = apply_rope(q_norm(q), cos, sin), apply_rope(k_norm(k), cos, sin)
    poison(((tokens, heads, d), dtype), ((tokens, kv_heads, d), dtype))
    got_q, got_k = kops.load().qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, sin, q_norm.eps)
    torch.cuda.synchronize()
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.shape == want.shape and got.is_contiguous() and torch.isfinite(got).all()
        # a last-bit rstd difference can flip roundings across one head row: small tensors may show a row
        differ = (got != want).sum().item()
        assert differ <= max(d, got.numel() // 1000), f"{differ} of {got.numel()} values differ"
        assert rel_err(got, want) < 1e-3


@pytest.mark.parametrize("m", (*ODD_M, 17001))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", (64, 1024, 1032))
def test_rms_norm_matches_torch(m, dtype, k):
    g = fresh_generator()
    x, norm = residual_stream(m, k, dtype, g), random_norm(k, dtype, g)
    want = rms_norm(x, norm.weight, norm.eps)
    poison(((m, k), dtype))
    got = kops.load().rms_norm(x, norm.weight, norm.eps)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    # rstd sums the squares in another order than torch, so a row's rstd can differ in its last bits and
    # flip roundings along that row: small tensors may show a row (7 x 1024 once showed 10 values)
    differ = (got != want).sum().item()
    assert differ <= max(k, got.numel() // 1000), f"{differ} of {got.numel()} values differ"
    assert rel_err(got, want) < 1e-3


@pytest.mark.parametrize("m", (*ODD_M, 17001))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", (64, 1024, 1032))
def test_add_rms_norm_equals_the_add_then_the_norm_kernel(m, dtype, k):
    """The residual add inside the norm: x + delta written over x as torch's add rounds it, and the norm of
    that bit for bit as the plain norm kernel gives it (the same summation order)."""
    g = fresh_generator()
    x, delta = residual_stream(m, k, dtype, g), residual_stream(m, k, dtype, g)
    norm = random_norm(k, dtype, g)
    summed = x + delta
    want = kops.load().rms_norm(summed, norm.weight, norm.eps)
    poison(((m, k), dtype))
    got = kops.load().add_rms_norm(x, delta, norm.weight, norm.eps)
    torch.cuda.synchronize()
    assert torch.equal(x, summed), "x must hold x + delta"
    assert torch.equal(got, want)


def test_add_rms_norm_rejects_a_delta_of_another_shape():
    x = torch.ones(4, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"delta \[3, 64\] must have x's shape \[4, 64\]"):
        kops.load().add_rms_norm(x, x[:3].clone(), x[0], 1e-6)
    with pytest.raises(RuntimeError, match="delta must be contiguous"):
        kops.load().add_rms_norm(x[:, :32].contiguous(), x[:, 32:], x[0, :32], 1e-6)


@pytest.mark.parametrize("m", (*ODD_M, 17001))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", (64, 1032, 3072, 5000))  # a row: 1 to 3 pieces a thread, or 2 stretches
@pytest.mark.parametrize("merged", (False, True))
def test_silu_mul_equals_torch(m, dtype, k, merged):
    """Bit for bit torch's SiLU times up; merged: gate and up are the halves of one [m, 2k] output (strided
    rows), as the MLP's grouped gate/up projection gives them."""
    g = fresh_generator()
    if merged:
        both = random_activations(m, 2 * k, dtype, g) * 0.3
        gate, up = both[:, :k], both[:, k:]
    else:
        gate, up = (random_activations(m, k, dtype, g) * 0.3 for _ in range(2))
    want = F.silu(gate) * up
    poison(((m, k), dtype))
    got = kops.load().silu_mul(gate, up)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape", ((1, 64, 24007), (3, 1024, 75), (2, 7, 1), (5, 96, 3000)))
def test_snake_equals_torch(shape):
    """The codec's Snake bit for bit torch's five ops, on alphas of both signs, zero and near zero, and
    inputs up to 3e5 (sinf's slow argument reduction); a strided input is made contiguous first."""
    from engine.codec.acoustic import Snake

    g = fresh_generator()
    snake = Snake(shape[1]).to(DEV)
    with torch.no_grad():
        snake.alpha.copy_(torch.randn(1, shape[1], 1, generator=g, device=DEV) * 2)
        snake.alpha.view(-1)[:3] = torch.tensor([0.0, 1e-12, -0.5])
    x = torch.randn(shape, generator=g, device=DEV) * 10
    x.view(-1)[:6] = torch.tensor([0.0, -0.0, 1e4, -3e5, 1e-30, 2.5e5])
    want = snake(x)
    snake.fused = True
    poison((shape, torch.float32))
    got = snake(x)
    assert torch.equal(got, want) and got.shape == x.shape
    wide = torch.cat([x, x], dim=-1)[..., : shape[-1]]  # strided
    assert torch.equal(snake(wide), want)


@pytest.mark.parametrize("with_bias,with_lengths", [(True, False), (False, True), (True, True)])
def test_snake_adds_the_conv_bias_and_zeroes_the_padding_as_torch_does(with_bias, with_lengths):
    """The Snake kernel with a conv's bias (added first) and the items' valid lengths (zero past them) bit
    for bit torch's add, five ops and masked_fill; items with no padding and with one valid position."""
    from engine.codec.acoustic import Snake

    g = fresh_generator()
    snake = Snake(96).to(DEV)
    with torch.no_grad():
        snake.alpha.copy_(torch.randn(1, 96, 1, generator=g, device=DEV) * 2)
    x = torch.randn(3, 96, 1000, generator=g, device=DEV) * 10
    bias = torch.randn(96, generator=g, device=DEV) if with_bias else None
    lengths = [1000, 617, 1] if with_lengths else None
    want = snake(x, bias=bias, lengths=lengths)
    snake.fused = True
    poison(((3, 96, 1000), torch.float32))
    got = snake(x, bias=bias, lengths=lengths)
    assert torch.equal(got, want)
    if with_lengths:
        assert not got[1, :, 617:].any() and not got[2, :, 1:].any()


def test_qk_norm_rope_rejects_bad_input():
    q = torch.randn(4, 2, 130, device=DEV, dtype=torch.bfloat16)[..., :128]
    w = torch.ones(128, device=DEV, dtype=torch.bfloat16)
    cos = torch.ones(4, 128, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        kops.load().qk_norm_rope(q, q.contiguous(), w, w, cos, cos, 1e-6)
    with pytest.raises(RuntimeError, match=r"cos must be \[4, 128\]"):
        kops.load().qk_norm_rope(q.contiguous(), q.contiguous(), w, w, cos[:3], cos, 1e-6)


def test_bad_input_raises_in_a_fresh_process():
    """The first error an extension op raises in a process formats sizes into its message; built with a
    statically linked libstdc++ whose symbols were exported, that segfaulted (build.py's LINK_FLAGS)."""
    script = (
        "import torch\n"
        "from engine.kernels import ops\n"
        "x = torch.ones(4, 100, device='cuda', dtype=torch.bfloat16)\n"
        "try:\n"
        "    ops.load().rms_norm(x, x[0], 1e-6)\n"
        "except RuntimeError as exc:\n"
        "    print(str(exc).splitlines()[0])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "K a multiple of 8, got [4, 100]" in done.stdout


def tiny_logits_on_and_off(switch, quantized, tmp_path, **fixed):
    """The tiny checkpoint's logits (bf16, or its W4A4 copy) with the FastPaths field `switch` on, then off
    (the other fields as `fixed`, else on), and the model with it on."""
    items = make_items([(9, 14, 12), (5, 0, 7), (12, 6, 16)], seed=3)
    batch = pack_items(items, C, 1024, choose_layout(items, (256,))).to("cuda")
    models, logits = [], []
    for on in (True, False):
        apart = FastPaths(grouped_projections=False)  # merged by prepare_for_inference, W4A4 too
        _, model = load_model(
            ensure_tiny_checkpoint(tmp_path), device="cuda", dtype=torch.bfloat16, fast_paths=apart
        )
        model = w4a4_copy(model) if quantized else model
        model = prepare_for_inference(model, FastPaths(**{**fixed, switch: on}))
        with torch.inference_mode():
            logits.append(model(batch))
        models.append(model)
    return models[0], logits[0], logits[1]


@pytest.mark.parametrize("quantized", (False, True))
def test_model_with_fused_kernels_matches_unfused(quantized, tmp_path):
    # the kernels that round as torch does (the SwiGLU GEMM rounds once: tests/test_grouped_projections.py)
    _, fused, unfused = tiny_logits_on_and_off("fused_kernels", quantized, tmp_path, swiglu_gemm=False)
    assert torch.isfinite(fused).all()
    assert rel_err(fused, unfused) < 2e-2
