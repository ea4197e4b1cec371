// The codec's Snake activation, x + (1 / (alpha + 1e-9)) * sin(alpha x)^2 with one alpha per channel, over
// float32 [batch, channels, length] (engine/codec/acoustic.py). torch runs it as five kernels, each reading and
// writing the whole tensor (the DAC encoder's first blocks hold 64 channels at 24 kHz); this reads x once and
// writes once. Meant to be bit-equal to torch (tests/test_fused_kernels.py): the same float32 operations in
// the same order, none contracted into an FMA (the _rn intrinsics), sinf as torch's sin, its square as
// torch's pow(2) (x * x), and 1 / (alpha + 1e-9) computed by torch and passed in.
// Two passes of the convolutions around it come along: the conv before it may run without its bias, which is
// added here first (as torch adds a cuDNN conv's bias: one float32 add after the conv), and the positions past
// each item's valid length come out 0 (as engine/codec/lengths.py zeroes them before a conv that spans them).
#include "w4a4_launch.h"

namespace w4a4 {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 8;  // elements a thread takes of its row, kThreads apart (coalesced)

__global__ void __launch_bounds__(kThreads)
    snake_kernel(const float* __restrict__ x, const float* __restrict__ alpha, const float* __restrict__ inv_alpha,
                 const float* __restrict__ bias, const int64_t* __restrict__ limits, float* __restrict__ out,
                 int64_t length, int channels) {
  const int64_t row = blockIdx.x;  // batch * channels + channel
  const int c = static_cast<int>(row % channels);
  const float a = alpha[c], inv = inv_alpha[c];
  const float b = bias != nullptr ? bias[c] : 0.0f;
  const int64_t valid = limits != nullptr ? limits[row / channels] : length;
  x += row * length;
  out += row * length;
  const int64_t stride = static_cast<int64_t>(gridDim.y) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x; i < length; i += stride) {
    if (i >= valid) {
      out[i] = 0.0f;
      continue;
    }
    const float v = bias != nullptr ? __fadd_rn(x[i], b) : x[i];
    const float s = sinf(__fmul_rn(a, v));
    out[i] = __fadd_rn(v, __fmul_rn(inv, __fmul_rn(s, s)));
  }
}

}  // namespace

cudaError_t launch_snake(const SnakeArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.length == 0) return cudaSuccess;
  if (a.rows > 0x7FFFFFFF || a.channels <= 0) return cudaErrorInvalidValue;  // a block (column) per row
  const int64_t per_block = static_cast<int64_t>(kThreads) * kPerThread;
  const int64_t chunks = (a.length + per_block - 1) / per_block;
  const dim3 grid(static_cast<unsigned>(a.rows), static_cast<unsigned>(chunks < 65535 ? chunks : 65535));
  snake_kernel<<<grid, kThreads, 0, stream>>>(a.x, a.alpha, a.inv_alpha, a.bias, a.limits, a.out, a.length,
                                               a.channels);
  return cudaGetLastError();
}

}  // namespace w4a4
