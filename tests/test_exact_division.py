"""csrc/exact_division.cuh against IEEE division, bit for bit (GPU only; `pytest -m gpu`).

rcp_rn(b) == 1.0f / b for every float32 b of its range, and div_rn(a, b, rcp_rn(b)) == a / b for every a from
b 2^-20 to b 2^16, for fresh random divisors b across the range the quantize kernel divides by (512 scale in
[2^-81, 2^109])."""

import struct

import pytest
import torch

from engine.kernels.build import CSRC

pytestmark = pytest.mark.gpu

CUDA_SOURCE = r"""
#include <cstdint>
#include <torch/extension.h>
#include "exact_division.cuh"

// Counts the floats v with bits in [first, last) where the short form and IEEE division differ: op 0 compares
// rcp_rn(v) with 1.0f / v, op 1 div_rn(v, b, rcp_rn(b)) with v / b.
__global__ void count_mismatches(int op, uint32_t first, uint32_t last, float b, unsigned long long* count) {
  unsigned long long local = 0;
  const uint64_t step = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t start = first + static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (uint64_t i = start; i < last; i += step) {
    const float v = __uint_as_float(static_cast<uint32_t>(i));
    const float fast = op == 0 ? w4a4::rcp_rn(v) : w4a4::div_rn(v, b, w4a4::rcp_rn(b));
    const float ieee = op == 0 ? 1.0f / v : v / b;
    local += __float_as_uint(fast) != __float_as_uint(ieee);
  }
  atomicAdd(count, local);
}

int64_t mismatches(int64_t op, int64_t first, int64_t last, double b) {
  auto count = torch::zeros({1}, torch::dtype(torch::kInt64).device(torch::kCUDA));
  auto* out = reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>());
  const auto lo = static_cast<uint32_t>(first), hi = static_cast<uint32_t>(last);
  count_mismatches<<<1024, 256>>>(static_cast<int>(op), lo, hi, static_cast<float>(b), out);
  return count.item<int64_t>();
}
"""


@pytest.fixture(scope="module")
def division(tmp_path_factory):
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="exact_division_check",
        cpp_sources="int64_t mismatches(int64_t op, int64_t first, int64_t last, double b);",
        cuda_sources=CUDA_SOURCE,
        functions=["mismatches"],
        extra_include_paths=[str(CSRC)],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
        build_directory=str(tmp_path_factory.mktemp("exact_division")),
    )


def bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def test_rcp_rn_is_ieee_on_its_range(division):
    assert division.mismatches(0, bits(2.0**-126), bits(2.0**126), 0.0) == 0


def test_div_rn_is_ieee_near_random_divisors(division):
    g = torch.Generator().manual_seed(torch.seed())
    exponents = torch.empty(16).uniform_(-81, 109, generator=g)
    mantissas = torch.empty(16).uniform_(1, 2, generator=g)
    for b in (mantissas * 2.0**exponents).tolist():
        b = struct.unpack("<f", struct.pack("<f", b))[0]  # the float32 the kernel divides by
        assert division.mismatches(1, bits(b * 2.0**-20), bits(b * 2.0**16), b) == 0, f"divisor {b}"


def test_the_check_counts_mismatches(division):
    # Below 2^-126 the short reciprocal flushes subnormals, so the same check must see differences there.
    assert division.mismatches(0, bits(2.0**-149), bits(2.0**-127), 0.0) > 0
