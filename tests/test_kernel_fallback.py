"""CPU side of engine.kernels: backend choice and fallback, the packed operand layouts and their e4m3
codes, the GEMM's scale ratios and its fp16 fold."""

import logging

import pytest
import torch

from engine.errors import BackendUnavailable
from engine.kernels import CudaW4A4Backend, build, choose_w4a4_backend, w4a4_backend_report
from engine.kernels.build import load_extension
from engine.kernels.w4a4 import (
    DOT_SCALE,
    WEIGHT_RATIO_SCALE,
    activation_scale_positions,
    activation_scale_ratios,
    activation_scales_in_row_order,
    e4m3_bytes,
    emulate_gemm_fold,
    fp16_rounded_once,
    integers_of_e4m3,
    kernel_weight_scales,
    pack_activations,
    pack_operand,
    unpack_activations,
    unpack_operand,
)
from engine.w4a4.format import W4A4Tensors, pack_int4
from engine.w4a4.reference import quantize_activations, w4a4_linear_reference

needs_no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the fallback on a CPU-only machine"
)


@needs_no_cuda
def test_chooser_falls_back_to_reference_with_reason(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.kernels.w4a4"):
        backend = choose_w4a4_backend("cpu")
    assert backend.name == "reference"
    assert "cuda-sm90 skipped on cpu" in caplog.text and "need a CUDA GPU" in caplog.text
    report = dict((name, (ok, reason)) for name, ok, reason in w4a4_backend_report("cuda"))
    assert report["cuda-sm90"][0] is False and "CUDA" in report["cuda-sm90"][1]
    assert report["reference"] == (True, "")


@needs_no_cuda
def test_asking_for_cuda_on_cpu_raises_with_reason(monkeypatch):
    with pytest.raises(BackendUnavailable, match="cannot run on cpu: device is cpu"):
        choose_w4a4_backend("cpu", prefer="cuda-sm90")
    with pytest.raises(BackendUnavailable, match="unknown W4A4 backend 'int3'"):
        choose_w4a4_backend("cpu", prefer="int3")
    monkeypatch.setattr(torch.version, "cuda", None)  # as on a CPU build of torch (a GPU machine's is not)
    ok, reason = load_extension.__wrapped__()
    assert not ok and "without CUDA" in reason


def test_extension_without_sources_or_cache_dir_reports_why(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # as on a CUDA build of torch
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("OVBATCH_KERNEL_CACHE", str(tmp_path / "file" / "cache"))
    ok, reason = load_extension.__wrapped__()
    assert not ok and "cannot create the kernel cache" in reason and "OVBATCH_KERNEL_CACHE" in reason
    monkeypatch.setattr(build, "CSRC", tmp_path / "csrc")
    ok, reason = load_extension.__wrapped__()
    assert not ok and "binding.cpp" in reason and "source checkout" in reason


def test_a_cached_library_loads_without_the_build_tools(monkeypatch, tmp_path):
    """The kernel cache's library (where cpp_extension.load leaves it) loads with torch.ops.load_library,
    not through cpp_extension.load (ninja and a compiler probe at every process start); a library that is
    missing or does not load goes through the build."""
    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "12.4")  # as on a CUDA build of torch
    monkeypatch.setenv("OVBATCH_KERNEL_CACHE", str(tmp_path))
    loaded, built = [], []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: built.append(kw["build_directory"]))
    library = build.cache_dir() / "ovbatch_w4a4.so"
    assert load_extension.__wrapped__() == (True, "")
    assert built == [str(library.parent)] and loaded == []
    library.write_bytes(b"")  # what the build leaves
    assert load_extension.__wrapped__() == (True, "")
    assert loaded == [str(library)] and len(built) == 1

    def cut_short(path):
        raise OSError(f"{path}: file too short")

    monkeypatch.setattr(torch.ops, "load_library", cut_short)
    assert load_extension.__wrapped__() == (True, "")
    assert len(built) == 2


def test_reference_backend_runs_the_contract():
    g = torch.Generator().manual_seed(1)
    layer = W4A4Tensors(
        qweight=pack_int4(torch.randint(-8, 8, (128, 128), generator=g)),
        wscales=(torch.rand(128, 2, generator=g) * 0.02).half(),
        proj_down=torch.randn(128, 16, generator=g).half() * 0.1,
        proj_up=torch.randn(128, 16, generator=g).half() * 0.1,
    )
    backend = choose_w4a4_backend("cpu", prefer="reference")
    x = torch.randn(3, 5, 128, generator=g).to(torch.bfloat16)
    assert torch.equal(backend.forward(x, backend.prepare(layer)), w4a4_linear_reference(x, layer))


def test_cuda_prepare_refuses_cpu_tensors():
    layer = W4A4Tensors(
        qweight=torch.zeros(128, 64, dtype=torch.uint8),
        wscales=torch.ones(128, 2).half(),
        proj_down=torch.zeros(128, 16).half(),
        proj_up=torch.zeros(128, 16).half(),
    )
    with pytest.raises(BackendUnavailable, match="move the layer to the GPU"):
        CudaW4A4Backend().prepare(layer)


def test_e4m3_bytes_are_the_fp8_encoding_of_small_integers():
    """n * 2^-9 for n in [-15, 15] is exact in e4m3 and its byte is sign | magnitude (torch's float8
    agrees)."""
    n = torch.arange(-15, 16)
    as_fp8 = (n.float() * 2.0**-9).to(torch.float8_e4m3fn)
    assert torch.equal(as_fp8.float() * 2.0**9, n.float())
    assert torch.equal(e4m3_bytes(n), as_fp8.view(torch.uint8))
    assert torch.equal(integers_of_e4m3(e4m3_bytes(n)), n.to(torch.int8))


def test_kernel_turns_weight_codes_into_e4m3_bytes():
    """csrc/w4a4_common.cuh's e4m3_from_code, (codes & 0x0F0F0F0F) + 121 * ((codes >> 3) & 0x01010101), on
    every nibble code in both halves of each byte, against the e4m3 bytes of the values pack_operand coded."""
    q = torch.arange(-8, 8).repeat(16 * 4).reshape(16, 64)
    raw = pack_operand(q).view(torch.uint8).reshape(-1, 4)  # 4-byte words
    words = sum(raw[:, b].to(torch.int64) << (8 * b) for b in range(4))

    def e4m3_from_code(codes):
        return ((codes & 0x0F0F0F0F) + 121 * ((codes >> 3) & 0x01010101)) & 0xFFFFFFFF

    for step, codes in ((0, words), (1, words >> 4)):
        out = e4m3_from_code(codes)
        got = torch.stack([(out >> (8 * b)) & 0xFF for b in range(4)], -1).to(torch.uint8)
        nibbles = torch.stack([(raw[:, b] >> (4 * step)) & 0xF for b in range(4)], -1).to(torch.int16)
        values = torch.where(nibbles > 7, 7 - nibbles, nibbles)
        assert torch.equal(got, e4m3_bytes(values))
    assert sorted(set(unpack_operand(pack_operand(q)).flatten().tolist())) == list(range(-8, 8))


def test_packed_layout_follows_the_mma_fragments():
    """Each nibble sits where the 8-bit A fragment of its lane, register and k-step expects it (PTX ISA,
    m16n8k32 and wgmma m64nNk32 alike: rows gr / gr+8 for registers 0,2 / 1,3, columns 4t (+16 for
    registers 2,3)), written out here element by element."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (32, 128), generator=g, dtype=torch.int8)
    packed = pack_operand(q)
    assert packed.shape == (2, 2, 128) and packed.dtype == torch.int32
    raw = packed.view(torch.uint8).reshape(2, 2, 32, 4, 4)  # tile, group, lane, word, byte
    for tile in range(2):
        for grp in range(2):
            for lane in range(32):
                gr, t = lane // 4, lane % 4
                for word in range(4):
                    row, kofs = gr + 8 * (word & 1), 16 * (word >> 1)
                    for b in range(4):
                        byte = int(raw[tile, grp, lane, word, b])
                        for step, nib in ((0, byte & 0xF), (1, byte >> 4)):
                            value = 7 - nib if nib > 7 else nib
                            k = grp * 64 + 32 * step + kofs + 4 * t + b
                            assert value == q[tile * 16 + row, k]
    assert torch.equal(unpack_operand(packed), q)


def test_activation_tiles_are_wgmma_canonical_k_major():
    """Each byte is the e4m3 byte of q * 2^-9 where wgmma's no-swizzle K-major B layout (8 x 16-byte core
    matrices, leading byte offset 128 rows * 16, stride byte offset 128) puts it for a 128-row tile and one
    K group."""
    q = torch.randint(-8, 8, (256, 128), dtype=torch.int8)
    tiles = pack_activations(q)
    assert tiles.shape == (2, 2, 8192) and tiles.dtype == torch.int8
    for block, grp, m, k in ((0, 0, 0, 0), (1, 1, 127, 63), (0, 1, 9, 17), (1, 0, 64, 40)):
        core_k, core_m = k // 16, m // 8
        offset = core_k * 128 * 16 + core_m * 128 + (m % 8) * 16 + k % 16
        assert tiles[block, grp, offset].view(torch.uint8) == e4m3_bytes(q[128 * block + m, 64 * grp + k])
    assert torch.equal(unpack_activations(tiles), q)


def test_activation_scales_sit_where_the_fold_reads_them():
    """The GEMM's fold thread t loads scales 32p + 8t .. 32p + 8t + 7 at once and uses them for activation
    rows 8j + 2t + c, j = 4p + q, at index 2q + c of the load."""
    positions = activation_scale_positions(256)
    assert sorted(positions.tolist()) == list(range(256))
    for p in range(8):
        for t in range(4):
            for q in range(4):
                for c in range(2):
                    row = 8 * (4 * p + q) + 2 * t + c
                    assert positions[row] == 32 * p + 8 * t + 2 * q + c
    scales = torch.arange(2 * 256, dtype=torch.float32).reshape(2, 256)
    stored = torch.empty_like(scales)
    stored[:, positions] = scales
    assert torch.equal(activation_scales_in_row_order(stored), scales)


def test_kernel_weight_scales_are_fp16_ratios_and_row_factors():
    """Per group rw = ws / wmax_row * 2^15 rounded to fp16 (at most 2^15, so the fold's products stay in
    range), then the row factor 8 * wmax_row; rw * factor / 2^18 gives ws back within fp16's rounding.
    Padding and all-zero rows stay zero; fp16's extremes stay finite."""
    g = torch.Generator().manual_seed(0)
    ws = (torch.rand(300, 16, generator=g) * 0.05).half()
    ws[7] = 0
    ws[8, 3] = 65504.0
    ws[9] = 2.0**-24
    packed = kernel_weight_scales(ws, n_pad=384)
    assert packed.shape == (17, 384) and packed.dtype == torch.float32
    assert not packed[:, 300:].any() and not packed[:, 7].any()
    ratios, factors = packed[:16, :300].t(), packed[16, :300]
    assert torch.isfinite(packed).all()
    assert torch.equal(ratios.half().float(), ratios) and ratios.max() == WEIGHT_RATIO_SCALE
    assert torch.equal(factors, ws.float().amax(dim=1) * (DOT_SCALE / WEIGHT_RATIO_SCALE))
    back = ratios.double() * factors.double()[:, None] / DOT_SCALE
    assert ((back - ws.double()).abs() <= ws.double() * 2.0**-11).all()


def test_fp16_rounded_once_rounds_float64_correctly():
    """Where a cast through float32 rounds twice: 1 + 2^-11 + 2^-40 lies just above the tie between 1 and
    1 + 2^-10 (float32 drops the 2^-40 and the tie goes to even); exact values and ties pass unchanged."""
    above_tie = 1 + 2**-11 + 2**-40
    x = torch.tensor([above_tie, -above_tie, 1 + 2**-11, 3 * 2**-20, 2049.0, 0.0], dtype=torch.float64)
    assert x.half()[0] == 1.0, "torch rounds twice (else this test has nothing to check)"
    assert fp16_rounded_once(x).tolist() == [1 + 2**-10, -(1 + 2**-10), 1.0, 3 * 2**-20, 2048.0, 0.0]
    g = torch.Generator().manual_seed(0)
    y = torch.randn(100000, generator=g, dtype=torch.float64)
    want = y.float().half()  # exact in float32 first, so one rounding
    assert torch.equal(fp16_rounded_once(y.float().double()), want)


def test_fp16_fold_worst_case_stays_finite_and_exact():
    """127 groups (the GEMM's limit) of |dot| = 64 * 7 * 8 at the largest ratios: the fp16 accumulator reaches
    127 * 448 = 56896 < 65504, every partial sum a multiple of 32 and so exact in fp16."""
    groups = 127
    qx = torch.full((2, 64 * groups), 7)
    qx[1] = -7
    qw = torch.full((3, 64 * groups), -8)
    ascales = torch.full((2, groups), 0.5)
    ws = torch.full((3, groups), 0.25).half()
    y = emulate_gemm_fold(qx, *activation_scale_ratios(ascales), qw, kernel_weight_scales(ws, 3))
    exact = torch.tensor([[-1.0], [1.0]]) * (groups * 3584 * 0.5 * 0.25)
    assert torch.equal(y, exact.expand(2, 3))


@pytest.mark.parametrize("k_splits", [1, 4])
def test_fp16_fold_error_is_about_1e3(k_splits):
    """The fold's fp16 roundings on LLM-like activations (outlier channels) at K = 3072: ~1e-3 relative
    Frobenius error against the exact sum, a tenth of the kernels' 1e-2 tolerance, with the K groups folded
    in one range or in the small grids' four (gemm_k_splits)."""
    g = torch.Generator().manual_seed(0)
    m, n, k = 96, 128, 3072
    x = torch.randn(m, k, generator=g)
    x[:, torch.randint(0, k, (4,), generator=g)] *= 20
    qx, ascales = quantize_activations(x)
    qw = torch.randint(-8, 8, (n, k), generator=g)
    ws = (torch.rand(n, k // 64, generator=g) * 0.02 + 1e-4).half()
    y = emulate_gemm_fold(qx, *activation_scale_ratios(ascales), qw, kernel_weight_scales(ws, n), k_splits)
    groups = (m, k // 64, 64), (n, k // 64, 64)
    dots = torch.einsum("mgk,ngk->mng", qx.double().reshape(groups[0]), qw.double().reshape(groups[1]))
    exact = (dots * ascales.double()[:, None, :] * ws.double()[None]).sum(-1)
    err = ((y.double() - exact).norm() / exact.norm()).item()
    assert 1e-4 < err < 2e-3


def test_kernel_builds_are_cached_under_ovbatch_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("OVBATCH_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("OVBATCH_CACHE", str(tmp_path))
    assert build.cache_dir().parent == tmp_path / "kernels"
    monkeypatch.setenv("OVBATCH_KERNEL_CACHE", str(tmp_path / "elsewhere"))
    assert build.cache_dir().parent == tmp_path / "elsewhere"
