"""GPTQ, low-rank correction and smoothing on layers with LLM-like statistics."""

import pytest
import torch

from engine.errors import QuantError
from engine.kernels.w4a4 import group_obstacle
from engine.quantizer.gptq import GPTQConfig, gptq_quantize, quantize_rtn
from engine.quantizer.lowrank import (
    LayerStats,
    MethodConfig,
    lowrank_factors,
    quantize_linear,
    quantize_siblings,
)
from engine.quantizer.smooth import smoothing_factors
from engine.quantizer.synthetic import outlier_channel_scales, structured_activations, structured_weight
from engine.w4a4.format import W4A4Tensors, pack_int4
from engine.w4a4.reference import dequantize_weight, w4a4_linear_reference


@pytest.fixture(autouse=True)
def one_thread():
    # These are many small ops; on a shared 2-core machine extra threads only contend.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def output_error(x, w, q, scales):
    wq = dequantize_weight(pack_int4(q), scales.half())
    return float((x @ (w - wq).T).norm() / (x @ w.T).norm())


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_beats_rtn_on_its_objective(act_order):
    g = torch.Generator().manual_seed(1)
    w = structured_weight(96, 256, g)
    x = structured_activations(1024, outlier_channel_scales(256, g), g)
    q, s = gptq_quantize(w, x.T @ x, GPTQConfig(act_order=act_order))
    assert q.dtype == torch.int8 and q.min() >= -8 and q.max() <= 7 and s.shape == (96, 4)
    q_rtn, s_rtn = quantize_rtn(w)
    e_gptq, e_rtn = output_error(x, w, q, s), output_error(x, w, q_rtn, s_rtn)
    print(f"act_order={act_order}: weight-only output error rtn {e_rtn:.4f} gptq {e_gptq:.4f}")
    assert e_gptq < 0.8 * e_rtn


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_with_diagonal_hessian_is_round_to_nearest(act_order):
    w = torch.randn(32, 128)
    q, s = gptq_quantize(w, torch.diag(torch.rand(128) + 0.5), GPTQConfig(act_order=act_order))
    q_rtn, s_rtn = quantize_rtn(w)
    assert torch.equal(q, q_rtn) and torch.equal(s, s_rtn)


def test_gptq_keeps_inputs_silent_in_calibration():
    w = torch.randn(16, 64)
    x = torch.randn(256, 64)
    x[:, 3] = 0
    q, s = gptq_quantize(w, x.T @ x)
    assert torch.isfinite(s).all() and (q[:, 3] != 0).any()


def test_gptq_and_method_bad_input():
    with pytest.raises(QuantError, match="not a multiple of the W4A4 group size"):
        gptq_quantize(torch.randn(8, 100), torch.eye(100))
    with pytest.raises(QuantError, match="Hessian shape"):
        gptq_quantize(torch.randn(8, 64), torch.eye(128))
    with pytest.raises(QuantError, match="block_size"):
        GPTQConfig(block_size=100)
    with pytest.raises(QuantError, match="rank=8"):
        MethodConfig(rank=8)
    stats = LayerStats(torch.eye(64), torch.ones(64), torch.zeros(0, 64), rows=0)
    with pytest.raises(QuantError, match="no calibration rows"):
        quantize_linear(torch.randn(8, 64), stats, MethodConfig())


def test_lowrank_factors_match_the_exact_truncated_svd():
    """Noise plus a decaying low-rank part (what weight residuals look like): the randomized factors'
    error is within 0.1% of the best rank-r error (Eckart-Young, from the exact SVD)."""
    decaying = torch.randn(768, 64) * torch.linspace(1, 0.05, 64)
    m = torch.randn(768, 512) * 0.02 + decaying @ torch.randn(64, 512) * 0.01
    up, down = lowrank_factors(m, 32)
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    best = (m - (u[:, :32] * s[:32]) @ vh[:32]).norm()
    assert (m - up.float() @ down.float().T).norm() <= 1.001 * best


def test_lowrank_factors_recover_low_rank_matrix():
    m = torch.randn(80, 16) @ torch.randn(16, 192) * 0.1
    up, down = lowrank_factors(m, 16)
    assert up.shape == (80, 16) and down.shape == (192, 16) and up.dtype == torch.float16
    assert (up.float() @ down.float().T - m).norm() / m.norm() < 2e-3


def test_smoothing_moves_outliers_to_weights():
    g = torch.Generator().manual_seed(2)
    scales = outlier_channel_scales(128, g)
    w = structured_weight(64, 128, g)
    s = smoothing_factors(scales, w, 0.5)
    assert s.shape == (128,) and (s > 0).all()
    top = scales.argsort()[-6:]
    assert s[top].min() > s.median() * 3  # outlier channels are divided by the most


@pytest.mark.parametrize("n,k", [(192, 512), (512, 192)])
def test_method_quality_stages(n, k):
    g = torch.Generator().manual_seed(n * 31 + k)
    w = structured_weight(n, k, g)
    channel = outlier_channel_scales(k, g)
    calib = structured_activations(2048, channel, g)
    stats = LayerStats(calib.T @ calib, calib.abs().amax(0), calib[:256], rows=2048)
    res = quantize_linear(w, stats, MethodConfig(rank=16, stage_report=True))
    e = res.errors
    print(f"\n{n}x{k} relative output error per stage (alpha={res.alpha}, refits={res.refits}):")
    for stage, err in e.items():
        print(f"  {stage:34s} {err:.4f}  ({e['rtn'] / err:5.1f}x better than rtn)")
    assert e["gptq"] < e["rtn"]
    assert e["rtn+svd"] < e["rtn"]
    assert e["gptq+svd"] < e["rtn+svd"]
    assert e["gptq+svd iterated"] <= e["gptq+svd"]
    assert e["final"] <= e["gptq+svd iterated"]
    assert e["final"] <= 0.5 * e["rtn"]

    # the same holds on inputs the quantizer never saw, through the W4A4 forward
    held_out = structured_activations(512, channel, g)
    y = held_out @ w.T
    q_rtn, s_rtn = quantize_rtn(w)
    rtn_layer = W4A4Tensors(
        pack_int4(q_rtn), s_rtn.half(), torch.zeros(k, 16).half(), torch.zeros(n, 16).half()
    )
    err_rtn = (w4a4_linear_reference(held_out, rtn_layer) - y).norm() / y.norm()
    err_final = (w4a4_linear_reference(held_out, res.tensors) - y).norm() / y.norm()
    print(f"  held-out: rtn {err_rtn:.4f} final {err_final:.4f}")
    assert err_final <= 0.5 * err_rtn


def test_quantize_linear_is_deterministic():
    g = torch.Generator().manual_seed(4)
    w = structured_weight(64, 128, g)
    x = structured_activations(512, outlier_channel_scales(128, g), g)
    stats = LayerStats(x.T @ x, x.abs().amax(0), x[:128], rows=512)
    a = quantize_linear(w, stats, MethodConfig())
    b = quantize_linear(w, stats, MethodConfig())
    assert a.errors == b.errors
    assert all(torch.equal(u, v) for (_, u), (_, v) in zip(a.tensors.items(), b.tensors.items()))


def test_siblings_share_one_smoothing_and_keep_their_quality():
    """q/k/v-like weights that read one input: one smoothing decision (here: smoothed, the input has outlier
    channels), identical smoothing vectors so the engine can group them, each layer still far below rtn."""
    g = torch.Generator().manual_seed(11)
    ws = [structured_weight(n, 256, g) for n in (128, 64, 64)]
    x = structured_activations(1024, outlier_channel_scales(256, g), g)
    stats = LayerStats(x.T @ x, x.abs().amax(0), x[:256], rows=1024)
    results = quantize_siblings(ws, stats, MethodConfig(), [None] * 3, ["q", "k", "v"])
    assert len({r.alpha for r in results}) == 1 and results[0].alpha is not None
    assert all(torch.equal(r.tensors.smooth, results[0].tensors.smooth) for r in results)
    assert group_obstacle([r.tensors for r in results]) is None
    for r in results:
        assert r.errors["final"] == r.errors["gptq+svd iterated smooth"] <= 0.5 * r.errors["rtn"]
    alone = quantize_linear(ws[0], stats, MethodConfig())
    assert results[0].errors["rtn+svd"] == alone.errors["rtn+svd"]  # the unsmoothed stages are per layer
