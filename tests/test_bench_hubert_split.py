"""bench/hubert_split.py's emulated roundings and split products, on the CPU."""

import torch
import torch.nn.functional as F

from bench.hubert_split import VARIANTS, bf16, split, tf32


def test_tf32_keeps_ten_mantissa_bits_rounding_to_nearest_even():
    one_ulp = 2.0**-10  # TF32's spacing just above 1
    x = torch.tensor([1.0, 1 + one_ulp, 1 + 0.5 * one_ulp, 1 + 1.5 * one_ulp, 1 + 0.75 * one_ulp, -3.0])
    want = torch.tensor([1.0, 1 + one_ulp, 1.0, 1 + 2 * one_ulp, 1 + one_ulp, -3.0])  # ties go to even
    assert torch.equal(tf32(x), want)
    assert (tf32(torch.randn(1000)).view(torch.int32) & 0x1FFF).eq(0).all()


def test_split_terms_add_up_to_the_float32_value_within_their_precision():
    x = torch.randn(4096, dtype=torch.float32)
    for part, parts, bound in ((tf32, 2, 2.0**-21), (bf16, 2, 2.0**-15), (bf16, 3, 2.0**-23)):
        terms = split(x, part, parts)
        assert len(terms) == parts and torch.equal(terms[0], part(x))
        err = ((sum(terms) - x).abs() / x.abs()).max().item()
        assert err <= bound, (part.__name__, parts, err)


def test_each_variant_is_a_linear_close_to_float32_in_order_of_its_precision():
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(256, 128)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(128, 256, generator=g))
        layer.bias.copy_(torch.randn(128, generator=g))
    x = torch.randn(4, 16, 256, generator=g)  # a leading batch shape, as HuBERT's [B, F, hidden]
    want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    error = {}
    for name, make in VARIANTS.items():
        got = make(layer)(x)
        assert got.shape == (4, 16, 128) and got.dtype == torch.float32
        error[name] = ((got - want).norm() / want.norm()).item()
    assert error["tf32x1"] > 10 * error["bf16x3"] > 10 * error["tf32x3"]
    assert error["float64"] < 1e-7 and error["bf16x6"] < 1e-6
