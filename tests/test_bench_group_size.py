"""bench/group_size.py measures the numerics contract itself at group size 64, and the 128 variant."""

import torch

from bench.group_size import layer_row, quantize, quantized_forward
from engine.quantizer.smooth import smoothing_factors
from engine.quantizer.synthetic import outlier_channel_scales, structured_activations, structured_weight
from engine.w4a4.format import W4A4Tensors, pack_int4
from engine.w4a4.reference import w4a4_linear_reference


def test_group_64_is_the_contracts_reference():
    g = torch.Generator().manual_seed(1)
    w = structured_weight(128, 256, g)
    x = structured_activations(40, outlier_channel_scales(256, g), g)
    smooth = smoothing_factors(x.abs().amax(0), w, 0.5)
    q, scales, up, down = quantize(w, smooth, 16, 64)
    layer = W4A4Tensors(pack_int4(q), scales.half(), down.half(), up.half(), smooth=smooth.half())
    assert torch.equal(quantized_forward(w, smooth, 16, 64)(x), w4a4_linear_reference(x, layer))


def test_row_reports_both_group_sizes():
    row = layer_row("small", 128, 256, rank=16, rows=64, seed=0)
    assert 0 < row["g64_error"] < 0.5 and 0 < row["g128_error"] < 0.5
    assert row["g64_error"] != row["g128_error"]
