"""CPU side of engine.kernels: backend choice and fallback, the packed operand layouts and their e4m3
codes, the scale identity."""

import logging

import pytest
import torch

from engine.errors import BackendUnavailable
from engine.kernels import CudaW4A4Backend, build, choose_w4a4_backend, w4a4_backend_report
from engine.kernels.build import load_extension
from engine.kernels.w4a4 import (
    DOT_SCALE,
    activation_scale_positions,
    activation_scales_in_row_order,
    e4m3_bytes,
    integers_of_e4m3,
    kernel_weight_scales,
    pack_activations,
    pack_operand,
    unpack_activations,
    unpack_operand,
)
from engine.quant.format import W4A4Tensors, pack_int4
from engine.quant.reference import w4a4_linear_reference

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
def test_asking_for_cuda_on_cpu_raises_with_reason():
    with pytest.raises(BackendUnavailable, match="cannot run on cpu: device is cpu"):
        choose_w4a4_backend("cpu", prefer="cuda-sm90")
    with pytest.raises(BackendUnavailable, match="unknown W4A4 backend 'int3'"):
        choose_w4a4_backend("cpu", prefer="int3")
    ok, reason = load_extension()
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
    """The GEMM's fold thread t loads scales 16p + 4t .. 16p + 4t + 3 at once and uses them for activation
    rows 8j + 2t + c, j = 2p + half, at index 2 * half + c of the load."""
    positions = activation_scale_positions(256)
    assert sorted(positions.tolist()) == list(range(256))
    for p in range(16):
        for t in range(4):
            for half in range(2):
                for c in range(2):
                    row = 8 * (2 * p + half) + 2 * t + c
                    assert positions[row] == 16 * p + 4 * t + 2 * half + c
    scales = torch.arange(2 * 256, dtype=torch.float32).reshape(2, 256)
    stored = torch.empty_like(scales)
    stored[:, positions] = scales
    assert torch.equal(activation_scales_in_row_order(stored), scales)


def test_one_multiply_recovers_dot_times_scale_exactly():
    """The GEMM's float32 sum is dot * 2^-18 (exact: |dot| <= 64 * 64); times ws * 2^18, rounded once, it is
    round(dot * ws), checked in float64 for fp16 scales (the stored format) and wider float32 ones."""
    g = torch.Generator().manual_seed(0)
    scales = torch.cat(
        [(torch.rand(4000, generator=g) * 0.05).half().float(), torch.rand(4000, generator=g) * 3,
         torch.tensor([65504.0, 2.0**-24])]  # the fp16 extremes stay finite and normal
    )
    packed = kernel_weight_scales(scales.reshape(-1, 1), n_pad=scales.numel() + 64)
    assert packed.shape == (1, scales.numel() + 64) and packed.dtype == torch.float32
    assert torch.equal(packed[0, scales.numel():], torch.zeros(64))
    ws = packed[0, : scales.numel()]
    dots = torch.randint(-4096, 4097, (scales.numel(),), generator=g).float()
    sums = dots * 2.0**-18
    assert torch.equal(sums.double() * 2.0**18, dots.double()), "the FP8 sums are exact in float32"
    assert torch.equal(sums * ws, (dots.double() * scales.double()).float())
    assert torch.equal(ws.double() / DOT_SCALE, scales.double())


def test_kernel_builds_are_cached_under_ovbatch_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("OVBATCH_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("OVBATCH_CACHE", str(tmp_path))
    assert build.cache_dir().parent == tmp_path / "kernels"
    monkeypatch.setenv("OVBATCH_KERNEL_CACHE", str(tmp_path / "elsewhere"))
    assert build.cache_dir().parent == tmp_path / "elsewhere"
