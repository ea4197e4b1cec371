"""The reference W4A4 forward against an independent float64 evaluation of the contract's formula."""

import pytest
import torch

from engine.errors import QuantError
from engine.w4a4.format import W4A4Tensors, pack_int4, unpack_int4
from engine.w4a4.reference import (
    ReferenceW4A4Backend,
    effective_weight,
    quantize_activations,
    w4a4_linear_reference,
)

# Every backbone Linear shape (N, K) of OmniVoice: q, k/v, fused qkv, o, gate/up, down.
OMNIVOICE_SHAPES = [(2048, 1024), (1024, 1024), (4096, 1024), (1024, 2048), (3072, 1024), (1024, 3072)]


def random_layer(n, k, rank=16, smooth=True, bias=False, seed=0) -> W4A4Tensors:
    g = torch.Generator().manual_seed(seed)
    return W4A4Tensors(
        qweight=pack_int4(torch.randint(-8, 8, (n, k), generator=g)),
        wscales=(torch.rand(n, k // 64, generator=g) * 0.02).half(),
        proj_down=(torch.randn(k, rank, generator=g) / k**0.5).half(),
        proj_up=(torch.randn(n, rank, generator=g) * 0.1).half(),
        smooth=(torch.rand(k, generator=g) * 2 + 0.25).half() if smooth else None,
        bias=torch.randn(n, generator=g) if bias else None,
    )


def formula_float64(x: torch.Tensor, t: W4A4Tensors) -> torch.Tensor:
    """The contract's formula, written independently in float64 (einsum over groups)."""
    x = x.double()
    if t.smooth is not None:
        x = x / t.smooth.double()
    m, k = x.shape
    xg = x.reshape(m, k // 64, 64)
    ascale = xg.abs().amax(-1) / 7
    qx = torch.where(ascale[..., None] > 0, torch.round(xg / ascale[..., None].clamp_min(1e-300)), 0.0)
    qx = qx.clamp(-8, 7)
    qw = unpack_int4(t.qweight).double().reshape(t.out_features, k // 64, 64)
    dots = torch.einsum("mgk,ngk->mng", qx, qw)
    y = (dots * ascale[:, None, :] * t.wscales.double()[None]).sum(-1)
    y = y + (x @ t.proj_down.double()) @ t.proj_up.double().T
    if t.bias is not None:
        y = y + t.bias.double()
    return y


@pytest.mark.parametrize("n,k", OMNIVOICE_SHAPES)
@pytest.mark.parametrize("m", [1, 7])
def test_reference_equals_float64_formula(m, n, k):
    t = random_layer(n, k, seed=n + k + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * 13 + k))
    x[:, 5] *= 40  # an outlier channel, as real activations have
    y = w4a4_linear_reference(x, t)
    ref = formula_float64(x, t)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    err = (y.double() - ref).abs().max() / ref.abs().max()
    assert err < 2e-6, f"max relative deviation {err:.2e}"


def test_reference_odd_shapes_bias_no_smooth_and_leading_dims():
    t = random_layer(96, 192, rank=32, smooth=False, bias=True, seed=3)
    # seeded, as the other float64 comparison: the formula's float64 scales can round a value near a
    # quantization tie the other way than float32 does, which a fresh input would meet now and then
    x = torch.randn(3, 5, 192, generator=torch.Generator().manual_seed(3))
    y = w4a4_linear_reference(x, t)
    assert y.shape == (3, 5, 96)
    ref = formula_float64(x.reshape(15, 192), t).reshape(3, 5, 96)
    assert torch.allclose(y.double(), ref, rtol=0, atol=2e-6 * ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_keeps_low_precision_dtype(dtype):
    """A bf16/fp16 input runs the float32 contract on its exact float32 values; only the output is cast."""
    t = random_layer(64, 128, seed=4)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(5)).to(dtype)
    y = w4a4_linear_reference(x, t)
    assert y.dtype == dtype
    assert torch.equal(y, w4a4_linear_reference(x.float(), t).to(dtype))


def test_activation_quantization_rules():
    x = torch.zeros(3, 128)
    x[1, :64] = torch.linspace(-3.5, 3.5, 64)
    x[2, 70] = -2.0
    q, s = quantize_activations(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (3, 2)
    # zero groups: scale 0 and q 0
    assert torch.equal(s[0], torch.zeros(2)) and torch.equal(q[0], torch.zeros(128, dtype=torch.int8))
    assert s[1, 0] == pytest.approx(0.5) and s[1, 1] == 0
    assert q[1, 0] == -7 and q[1, 63] == 7
    assert q[2, 70] == -7 and int((q[2] != 0).sum()) == 1
    # round half to even: 0.5 * scale -> 0, 1.5 * scale -> 2, 2.5 * scale -> 2
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([7.0, 0.5, 1.5, 2.5])
    q, s = quantize_activations(x)
    assert s[0, 0] == 1.0 and q[0, :4].tolist() == [7, 0, 2, 2]


def test_activation_quantization_matches_float64_away_from_ties():
    x = torch.randn(9, 320) * torch.rand(9, 1) * 10
    q, s = quantize_activations(x)
    xg = x.double().reshape(9, 5, 64)
    s64 = xg.abs().amax(-1) / 7
    q64 = torch.round(xg / s64[..., None]).clamp(-8, 7).reshape(9, 320)
    assert torch.allclose(s.double(), s64, rtol=1e-7)
    assert torch.equal(q.double(), q64)


def test_zero_input_gives_bias():
    t = random_layer(64, 128, bias=True, seed=5)
    y = w4a4_linear_reference(torch.zeros(2, 128), t)
    assert torch.equal(y, t.bias.expand(2, -1))


def test_effective_weight_approximates_output():
    t = random_layer(64, 256, seed=6)
    x = torch.randn(33, 256)
    y = w4a4_linear_reference(x, t)
    approx = x @ effective_weight(t).T
    rel = (y - approx).norm() / approx.norm()
    assert rel < 0.2  # only activation quantization separates the two


def test_backend_interface_and_bad_input():
    t = random_layer(64, 128, seed=7)
    backend = ReferenceW4A4Backend()
    x = torch.randn(4, 128)
    assert torch.equal(backend.forward(x, backend.prepare(t)), w4a4_linear_reference(x, t))
    with pytest.raises(QuantError, match="last dimension 128"):
        w4a4_linear_reference(torch.randn(4, 64), t)
    with pytest.raises(QuantError, match="multiple of 64"):
        quantize_activations(torch.randn(2, 100))


@pytest.mark.gpu
def test_reference_on_cuda_matches_cpu():
    t = random_layer(1024, 3072, seed=8)
    x = torch.randn(17, 3072)
    cpu = w4a4_linear_reference(x, t)
    gpu = w4a4_linear_reference(x.cuda(), t.to("cuda")).cpu()
    assert torch.allclose(gpu, cpu, rtol=0, atol=1e-5 * cpu.abs().max())


def test_w4a4_linear_is_a_drop_in(monkeypatch, caplog):
    import sys

    from engine.w4a4 import linear as linear_mod
    from engine.w4a4.linear import W4A4Linear

    t = random_layer(96, 128, seed=9)
    layer = W4A4Linear.from_tensors(t)
    assert (layer.in_features, layer.out_features, layer.rank) == (128, 96, 16)
    assert set(layer.state_dict()) == {"qweight", "wscales", "proj_down", "proj_up", "smooth"}
    x = torch.randn(2, 3, 128)
    assert torch.equal(layer(x), w4a4_linear_reference(x, t))
    layer.to(torch.bfloat16)  # a model-wide cast leaves the canonical tensors alone
    assert layer.wscales.dtype == torch.float16 and layer.qweight.dtype == torch.uint8
    assert torch.equal(layer(x.bfloat16()), w4a4_linear_reference(x.bfloat16(), t))
    # without engine.kernels the layer still runs, on the reference, and says why
    monkeypatch.setattr(linear_mod, "_BACKENDS", {})
    monkeypatch.setitem(sys.modules, "engine.kernels", None)
    fresh = W4A4Linear.from_tensors(t)
    with caplog.at_level("WARNING"):
        y = fresh(x)
    assert torch.equal(y, w4a4_linear_reference(x, t))
    assert "reference backend" in caplog.text and "engine.kernels cannot be imported" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a4_linear_on_cuda_matches_reference(dtype):
    from engine.w4a4.linear import W4A4Linear, backend_for

    for n, k in OMNIVOICE_SHAPES:
        t = random_layer(n, k, seed=n * 3 + k)
        layer = W4A4Linear.from_tensors(t).cuda()
        x = torch.randn(37, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        y = layer(x.cuda()).float().cpu()
        ref = w4a4_linear_reference(x.float(), t)
        rel = (y - ref).norm() / ref.norm()
        assert rel < 2e-2, (
            f"{backend_for(torch.device('cuda')).name} {n}x{k} {dtype}: relative error {rel:.2e}"
        )
