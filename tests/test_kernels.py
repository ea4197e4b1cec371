"""The W4A4 CUDA kernels against engine/w4a4/reference.py (GPU only; `pytest -m gpu`).

Fresh random inputs for every case, odd M (1, 7, 700, 2049), every OmniVoice N x K. Outputs are poisoned:
before each call the caching allocator is handed blocks of exactly the output sizes filled with NaN, so
an element the kernel fails to write reads back NaN (or a bit pattern that decodes wrong) and fails.
"""

import dataclasses

import pytest
import torch

from engine.errors import QuantError
from engine.kernels import CudaW4A4Backend, choose_w4a4_backend
from engine.kernels import ops as kops
from engine.kernels.w4a4 import (
    activation_scale_positions,
    activation_scale_ratios,
    activation_scales_in_row_order,
    emulate_gemm_fold,
    kernel_weight_scales,
    pack_activations,
    unpack_activations,
)
from engine.w4a4.format import W4A4Tensors, pack_int4, unpack_int4
from engine.w4a4.reference import quantize_activations, w4a4_linear_reference

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
ODD_M = (1, 7, 700, 2049)
# (N, K): q, k/v, fused qkv, o, gate/up, fused gate_up, down.
OMNIVOICE_SHAPES = [
    (2048, 1024),
    (1024, 1024),
    (4096, 1024),
    (1024, 2048),
    (3072, 1024),
    (6144, 1024),
    (1024, 3072),
]
REL_TOL = 1e-2


def fresh_generator() -> torch.Generator:
    g = torch.Generator(device=DEV)
    g.seed()
    return g


def random_layer(n, k, rank, smooth, bias, g) -> W4A4Tensors:
    return W4A4Tensors(
        qweight=pack_int4(torch.randint(-8, 8, (n, k), generator=g, device=DEV)),
        wscales=(torch.rand(n, k // 64, generator=g, device=DEV) * 0.02 + 1e-4).half(),
        proj_down=(torch.randn(k, rank, generator=g, device=DEV) / k**0.5).half(),
        proj_up=(torch.randn(n, rank, generator=g, device=DEV) * 0.05).half(),
        smooth=(torch.rand(k, generator=g, device=DEV) * 2 + 0.25).half() if smooth else None,
        bias=torch.randn(n, generator=g, device=DEV) if bias else None,
    )


def random_activations(m, k, dtype, g) -> torch.Tensor:
    """Gaussian rows with a few outlier channels (what LLM activations look like)."""
    x = torch.randn(m, k, generator=g, device=DEV)
    outliers = torch.randint(0, k, (4,), generator=g, device=DEV)
    x[:, outliers] *= 20
    return x.to(dtype)


def poison(*shapes_dtypes):
    """Leave 0xFF-filled blocks (NaN as floats, -1 nibbles as int4) of exactly these sizes in the caching
    allocator, so the outputs allocated next start poisoned."""
    sizes = [torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for s, d in shapes_dtypes]
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device=DEV) for n in sizes]
    torch.cuda.synchronize()
    del blocks


def _cpu(t):
    return t.cpu() if t is not None else None


def lora_positions(rank: int) -> list[int]:
    """Where the quantize kernel stores low-rank column k (csrc/w4a4_common.cuh, lora_position): columns
    k and k + 4 of each 8-wide block side by side, the GEMM's tf32 B fragment."""
    return [(k & ~7) + 2 * (k & 3) + ((k >> 2) & 1) for k in range(rank)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def smoothed_cpu(x, layer):
    """The reference's x / smooth on the CPU: torch on CUDA divides by a Python scalar through its
    reciprocal, so the reference's `amax / 7` is only IEEE division on the CPU."""
    xs = x.cpu().float()
    return xs / layer.smooth.cpu().float() if layer.smooth is not None else xs


# 17001 rows: enough 16-row blocks for the quantize kernel's 4-warp variant (it picks 16 warps below, and
# clusters of 8 blocks at 1 and 7 rows with K >= 2048); 200 rows: 16-warp blocks of 8 rows at K = 1024 on an
# H200, both halves of every 16-row set filled. 16-warp blocks load rank 16's proj_down fragments into
# registers and stage rank 32's slices in shared memory; 4-warp blocks stage both.
@pytest.mark.parametrize("m", (*ODD_M, 200, 17001))
@pytest.mark.parametrize("k", (1024, 2048, 3072))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("rank", (16, 32))
def test_quantize_act_bit_exact(m, k, dtype, rank):
    g = fresh_generator()
    layer = random_layer(1024, k, rank, smooth=(k != 2048), bias=False, g=g)
    backend = CudaW4A4Backend()
    packed = backend.prepare(layer)
    x = random_activations(m, k, dtype, g)
    m_pad = kops.padded_rows(m)
    groups = k // 64
    poison(
        ((m_pad // 128, groups, 8192), torch.int8),
        ((groups, m_pad), torch.float16),
        ((m_pad,), torch.float32),
        ((m_pad, rank), torch.float32),
    )
    qact, aratios, amax, lora = kops.load().quantize_act_lora_down(x, packed.smooth, packed.pd_t[dtype])
    torch.cuda.synchronize()

    xs = smoothed_cpu(x, layer)
    q_ref, s_ref = quantize_activations(xs)
    ratios_ref, amax_ref = activation_scale_ratios(s_ref)
    q = unpack_activations(qact.cpu())
    ratios = activation_scales_in_row_order(aratios).t().cpu()
    amax = activation_scales_in_row_order(amax).cpu()
    assert torch.equal(q[:m], q_ref), f"{(q[:m] != q_ref).sum().item()} quantized values differ"
    assert torch.equal(q[m:], torch.zeros_like(q[m:])), "padding rows must quantize to 0"
    assert torch.equal(amax[:m], amax_ref), "row maxima differ from the reference's scales (IEEE division)"
    assert torch.equal(ratios[:m], ratios_ref), "scale ratios differ from the reference's"
    assert not ratios[m:].any() and not amax[m:].any()
    lora = lora.cpu()[:, lora_positions(lora.shape[1])]
    assert torch.isfinite(lora).all()
    assert not (lora.view(torch.int32) & 0x1FFF).any(), "the low-rank activations are stored tf32-rounded"
    lora_ref = xs @ layer.proj_down.cpu().float()
    assert rel_err(lora[:m], lora_ref) < 5e-3
    assert torch.equal(lora[m:], torch.zeros_like(lora[m:]))


# 700 rows: 16-warp blocks; 17001: 4-warp blocks
@pytest.mark.parametrize("m,first_column", ((700, 256), (17001, 4)))
def test_quantize_act_reads_strided_rows(m, first_column):
    """Rows of a wider tensor (a column slice) quantize exactly as the same rows made contiguous."""
    g = fresh_generator()
    packed = CudaW4A4Backend().prepare(random_layer(1024, 1024, 32, smooth=True, bias=False, g=g))
    x = random_activations(m, 1536, torch.bfloat16, g)[:, first_column : first_column + 1024]
    ops = kops.load()
    strided = ops.quantize_act_lora_down(x, packed.smooth, packed.pd_t[torch.bfloat16])
    dense = ops.quantize_act_lora_down(x.contiguous(), packed.smooth, packed.pd_t[torch.bfloat16])
    assert all(torch.equal(a, b) for a, b in zip(strided, dense))


def test_quantize_act_ties_and_zero_groups():
    """Half-way cases round to even, zero groups give scale 0 and q 0, exactly like the reference."""
    k = 128
    x = torch.zeros(3, k)
    x[0, :8] = torch.tensor([7.0, 2.5, -3.5, 0.5, -0.5, 1.5, -2.5, 6.5])  # scale 1: ties
    x[1, 64:] = torch.linspace(-3, 3, 64)  # group 0 all zero
    x[2] = torch.randn(k)
    x = x.to(DEV, torch.bfloat16)
    layer = random_layer(128, k, 16, smooth=False, bias=False, g=fresh_generator())
    packed = CudaW4A4Backend().prepare(layer)
    qact, aratios, amax, _ = kops.load().quantize_act_lora_down(x, None, packed.pd_t[torch.bfloat16])
    q_ref, s_ref = quantize_activations(x.cpu())
    q = unpack_activations(qact.cpu())[:3]
    assert torch.equal(q, q_ref)
    assert q[0, :8].tolist() == [7, 2, -4, 0, 0, 2, -2, 6]
    ratios_ref, amax_ref = activation_scale_ratios(s_ref)
    assert torch.equal(activation_scales_in_row_order(aratios).t()[:3].cpu(), ratios_ref)
    assert torch.equal(activation_scales_in_row_order(amax)[:3].cpu(), amax_ref)
    assert ratios_ref[1, 0] == 0 and amax_ref[0] == 1.0


def test_quantize_act_extreme_scales():
    """Rows whose scales leave the kernel's fast range [2^-90, 2^100] quantize exactly like the reference,
    ties included (2^-130 is a subnormal scale), and so do the rows just inside it that share their warp,
    which takes the IEEE-division path with them (every other test runs the fast path)."""
    k = 128
    ties = torch.tensor([7.0, 2.5, -3.5, 0.5, -0.5, 1.5, -2.5, 6.5], device=DEV)
    exponents = (-100, 110, -88, 99, -130)
    x = torch.randn(len(exponents) + 1, k, generator=fresh_generator(), device=DEV)
    for row, e in enumerate(exponents):
        x[row, :8] = ties
        x[row] *= 2.0**e
    x = x.to(torch.bfloat16)
    layer = random_layer(128, k, 16, smooth=False, bias=False, g=fresh_generator())
    packed = CudaW4A4Backend().prepare(layer)
    qact, _, amax, _ = kops.load().quantize_act_lora_down(x, None, packed.pd_t[torch.bfloat16])
    q_ref, s_ref = quantize_activations(x.cpu())
    q = unpack_activations(qact.cpu())[: len(x)]
    assert torch.equal(q, q_ref)
    assert all(q[row, :8].tolist() == [7, 2, -4, 0, 0, 2, -2, 6] for row in range(len(exponents)))
    assert torch.equal(activation_scales_in_row_order(amax)[: len(x)].cpu(), s_ref.amax(dim=1))


@pytest.mark.parametrize("m", (*ODD_M, 17001))
@pytest.mark.parametrize("n,k", OMNIVOICE_SHAPES)
def test_w4a4_linear_matches_reference(m, n, k):
    g = fresh_generator()
    layer = random_layer(n, k, 32, smooth=True, bias=False, g=g)
    backend = CudaW4A4Backend()
    packed = backend.prepare(layer)
    x = random_activations(m, k, torch.bfloat16, g)
    poison(((m, n), torch.bfloat16))
    y = backend.forward(x, packed)
    ref = w4a4_linear_reference(x, layer)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert torch.isfinite(y).all(), "NaN/Inf in the output: an element was not written or overflowed"
    err = rel_err(y, ref)
    assert err <= REL_TOL, f"relative Frobenius error {err:.2e} > {REL_TOL}"


@pytest.mark.parametrize(
    "m,n,k,rank,smooth,bias,dtype",
    [
        (333, 1024, 1024, 16, False, True, torch.float16),
        (129, 192, 128, 16, True, True, torch.bfloat16),  # N a multiple of 64, not of 128
        (64, 320, 640, 32, False, False, torch.float16),
        (5000, 3072, 1024, 16, True, False, torch.bfloat16),
        (77, 128, 64, 16, False, True, torch.bfloat16),  # one K group: fewer groups than ring slots
        (300, 1024, 3072, 16, True, False, torch.float16),  # quantize in clusters at 16 low-rank columns
    ],
)
def test_w4a4_linear_variants(m, n, k, rank, smooth, bias, dtype):
    g = fresh_generator()
    layer = random_layer(n, k, rank, smooth, bias, g)
    backend = CudaW4A4Backend()
    packed = backend.prepare(layer)
    x = random_activations(m, k, dtype, g).reshape(1, m, k)
    poison(((m, n), dtype))
    y = backend.forward(x, packed)
    ref = w4a4_linear_reference(x, layer)
    assert y.shape == (1, m, n) and y.dtype == dtype
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) <= REL_TOL


@pytest.mark.parametrize(
    "m,n,k,rank,bias,dtype",
    [
        (1, 1024, 2048, 16, False, torch.bfloat16),  # o_proj
        (700, 1024, 3072, 16, False, torch.bfloat16),  # down_proj: 64-row tiles splitting K
        (2049, 1024, 2048, 32, True, torch.float16),  # 128-row tiles
        (17001, 1024, 3072, 16, False, torch.bfloat16),  # 256-row tiles
        (7, 32, 128, 16, False, torch.bfloat16),  # narrower than the GEMM's 64 rows: added after it
    ],
)
def test_residual_add_is_torch_add(m, n, k, rank, bias, dtype):
    """forward(x, residual=r) adds r in the GEMM's epilogue, rounded as torch rounds r + forward(x): bit for
    bit that sum (and the sum itself where the GEMM cannot read r: strided rows)."""
    g = fresh_generator()
    layer = random_layer(n, k, rank, smooth=True, bias=bias, g=g)
    backend = CudaW4A4Backend()
    packed = backend.prepare(layer)
    x = random_activations(m, k, dtype, g)
    residual = random_activations(m, n, dtype, g)
    want = residual + backend.forward(x, packed)
    poison(((m, n), dtype))
    got = backend.forward(x, packed, residual=residual)
    assert got.shape == (m, n) and torch.isfinite(got).all()
    assert torch.equal(got, want)
    strided = torch.cat((residual, residual), dim=1)[:, :n]
    assert torch.equal(backend.forward(x, packed, residual=strided), want)


def test_gemm_refuses_a_residual_of_another_shape():
    g = fresh_generator()
    packed = CudaW4A4Backend().prepare(random_layer(1024, 1024, 16, smooth=False, bias=False, g=g))
    ops = kops.load()
    quantized = ops.quantize_act_lora_down(
        random_activations(5, 1024, torch.bfloat16, g), None, packed.pd_t[torch.bfloat16]
    )
    weights = (packed.qweight, packed.wscales, packed.proj_up, None)
    residual = torch.zeros(5, 512, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(RuntimeError, match="residual must be"):
        ops.gemm_lora_up(*quantized, *weights, 5, 1024, torch.bfloat16, [], False, residual)


def test_small_grids_split_k():
    """o_proj's shape: at 257 rows (64-row tiles, under one block per SM) the GEMM splits each block's K
    groups over warpgroups; at 1024 rows (two 64-row tiles per SM), 2049 rows (128-row tiles), or with too
    few K groups, it does not."""
    assert kops.load().gemm_k_splits(257, 1024, 2048) > 1
    assert kops.load().gemm_k_splits(1024, 1024, 2048) == 1
    assert kops.load().gemm_k_splits(2049, 1024, 2048) == 1
    assert kops.load().gemm_k_splits(257, 1024, 128) == 1


@pytest.mark.parametrize("m", [257, 2049])
def test_quantized_term_is_the_fp16_fold(m):
    """Without the low-rank branch the GEMM computes emulate_gemm_fold's roundings bit for bit (with the K
    split it chose), on the quantize kernel's own output; against the float32 reference that fp16 fold
    costs ~1e-3."""
    g = fresh_generator()
    n, k = 1024, 2048
    layer = random_layer(n, k, 16, smooth=False, bias=False, g=g)
    layer.proj_up.zero_()
    packed = CudaW4A4Backend().prepare(layer)
    x = random_activations(m, k, torch.float16, g)
    qact, aratios, amax, lora = kops.load().quantize_act_lora_down(x, None, packed.pd_t[torch.float16])
    y = kops.load().gemm_lora_up(
        qact, aratios, amax, lora, packed.qweight, packed.wscales, packed.proj_up, None, m, n, torch.float16
    )
    qx = unpack_activations(qact.cpu())[:m]
    ratios = activation_scales_in_row_order(aratios).t()[:m].cpu()
    row_max = activation_scales_in_row_order(amax)[:m].cpu()
    qw = unpack_int4(layer.qweight.cpu())
    kscales = kernel_weight_scales(layer.wscales.cpu(), n)
    k_splits = kops.load().gemm_k_splits(m, n, k)
    assert torch.equal(y.cpu(), emulate_gemm_fold(qx, ratios, row_max, qw, kscales, k_splits).half())
    # the CPU reference: IEEE activation scales (see smoothed_cpu), so both sides quantize identically
    cpu_layer = W4A4Tensors(**{f.name: _cpu(getattr(layer, f.name)) for f in dataclasses.fields(layer)})
    ref = w4a4_linear_reference(x.cpu(), cpu_layer)
    assert rel_err(y.cpu(), ref) < 3e-3


def test_group_dots_are_exact():
    """The FP8 tensor cores' sums of the e4m3-coded integers are exact and the fold is emulate_gemm_fold's,
    bit for bit, power-of-two scales included. Extremes: weight rows of all -8 against activation rows of
    all 7 and -7 (|dot| = 3584 per group, a multiple of 2^9 and so an fp16 value)."""
    g = fresh_generator()
    m, n, k = 300, 256, 1024
    groups = k // 64
    qw = torch.randint(-8, 8, (n, k), generator=g, device=DEV)
    qw[:8] = -8
    qw[8:16] = 7
    qx = torch.randint(-7, 8, (m, k), generator=g, device=DEV)
    qx[:5] = 7
    qx[5:10] = -7
    wexp = torch.randint(0, 4, (n, groups), generator=g, device=DEV)
    aexp = torch.randint(1, 5, (m, groups), generator=g, device=DEV)
    layer = W4A4Tensors(
        qweight=pack_int4(qw),
        wscales=(2.0 ** -wexp.double()).half(),
        proj_down=torch.zeros(k, 16, device=DEV, dtype=torch.float16),
        proj_up=torch.zeros(n, 16, device=DEV, dtype=torch.float16),
    )
    packed = CudaW4A4Backend().prepare(layer)
    m_pad = 512
    qact = pack_activations(torch.nn.functional.pad(qx, (0, 0, 0, m_pad - m)).cpu()).to(DEV)
    row_scales = 2.0 ** -aexp.float()
    ratios, row_max = activation_scale_ratios(row_scales)
    positions = activation_scale_positions(m_pad)[:m].to(DEV)
    aratios = torch.zeros(groups, m_pad, device=DEV, dtype=torch.float16)
    aratios[:, positions] = ratios.t()
    amax = torch.zeros(m_pad, device=DEV)
    amax[positions] = row_max
    lora = torch.zeros(m_pad, 16, device=DEV)
    y = kops.load().gemm_lora_up(
        qact, aratios, amax, lora, packed.qweight, packed.wscales, packed.proj_up, None, m, n, torch.float16
    )
    kscales = kernel_weight_scales(layer.wscales.cpu(), n)
    k_splits = kops.load().gemm_k_splits(m, n, k)
    want = emulate_gemm_fold(qx.cpu(), ratios.cpu(), row_max.cpu(), qw.cpu(), kscales, k_splits)
    assert torch.equal(y.cpu(), want.half())
    by_group = (qx.double().reshape(m, groups, 64), qw.double().reshape(n, groups, 64))
    dots = torch.einsum("mgk,ngk->mng", *by_group)
    exact = (dots * row_scales.double()[:, None, :] * layer.wscales.double()[None]).sum(-1)
    assert rel_err(y, exact) < 2e-3


def test_cuda_graph_capture_and_fake():
    g = fresh_generator()
    layer = random_layer(2048, 1024, 32, smooth=True, bias=True, g=g)
    backend = CudaW4A4Backend()
    packed = backend.prepare(layer)
    static_x = random_activations(300, 1024, torch.bfloat16, g)
    backend.forward(static_x, packed)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = backend.forward(static_x, packed)
    new_x = random_activations(300, 1024, torch.bfloat16, g)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, backend.forward(new_x, packed))

    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        real = (static_x, packed.smooth, packed.pd_t[torch.bfloat16], packed.qweight, packed.wscales)
        args = [mode.from_tensor(t) for t in (*real, packed.proj_up, packed.bias)]
        y = kops.load().w4a4_linear(*args, 2048)
        assert y.shape == (300, 2048) and y.dtype == torch.bfloat16


def test_chooser_picks_cuda_and_rejects_bad_input():
    backend = choose_w4a4_backend(DEV)
    assert backend.name == "cuda-sm90"
    layer = random_layer(1024, 1024, 16, smooth=False, bias=False, g=fresh_generator())
    packed = backend.prepare(layer)
    with pytest.raises(QuantError, match="float32"):
        backend.forward(torch.randn(4, 1024, device=DEV), packed)
    with pytest.raises(QuantError, match="last dimension 1024"):
        backend.forward(torch.randn(4, 512, device=DEV, dtype=torch.bfloat16), packed)
