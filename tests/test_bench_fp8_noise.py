"""bench/fp8_noise.py's e4m3 emulation: the contract's layout rounds as the engine's reference does, and a
block's scale comes from its own values only."""

import torch

from bench.fp8_noise import WHOLE_ROW, e4m3_blocks
from engine.fp8.reference import dequantize_rows, quantize_rows


def test_whole_row_blocks_round_as_the_engines_reference():
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(0)) * torch.rand(37, 1) * 10
    assert torch.equal(e4m3_blocks(x, 1, WHOLE_ROW), dequantize_rows(*quantize_rows(x)))


def test_a_block_is_scaled_by_its_own_values():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 256, generator=g)
    loud = w.clone()
    loud[3, 5] = 1e4  # in block (0, 0) only
    a, b = e4m3_blocks(w, 128, 128), e4m3_blocks(loud, 128, 128)
    assert torch.equal(a[128:], b[128:]) and torch.equal(a[:128, 128:], b[:128, 128:])
    assert not torch.equal(a[:128, :128], b[:128, :128])
    for block in (w[:128, :128], w[128:, 128:]):  # each block alone, as one row of values
        alone = dequantize_rows(*quantize_rows(block.reshape(1, -1))).reshape(128, 128)
        assert torch.equal(e4m3_blocks(block, 128, 128), alone)
    assert (e4m3_blocks(w, 1, 32) - w).abs().max() <= w.abs().max() / 16  # within e4m3's 3-bit mantissa
