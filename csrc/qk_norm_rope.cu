// Kernel 3: Qwen3's per-head RMSNorm of q and k followed by rotate-half RoPE, one pass over q and k.
//
// torch runs this as a chain of elementwise kernels with float32 intermediates (engine/model/layers.py,
// 8.5x-10x slower in bench/results/fused-h200.json); this one reads each head row once and writes it once,
// with the same roundings: the normed row is
// T(w * T(x * rsqrt(mean(x^2) + eps))), then out = T(T(y * cos) + T(rot(y) * sin)) with
// rot(y)[i] = -y[i + D/2] for i < D/2 and y[i - D/2] otherwise, cos/sin the model's T tables.
// Only the order of the sum of squares differs from torch's reduction (last-bit rstd differences).
//
// One warp per head row; lane l owns the rotation pairs (i, i + D/2) for i = l, l + 32, ...
#include "w4a4_common.cuh"
#include "w4a4_launch.h"

namespace w4a4 {
namespace {

constexpr int kRowsPerBlock = 8;
constexpr int kMaxPairsPerLane = kMaxHeadDim / 64;

template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32)
    qk_norm_rope_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ q_weight,
                        const T* __restrict__ k_weight, const T* __restrict__ cos, const T* __restrict__ sin,
                        T* __restrict__ q_out, T* __restrict__ k_out, int64_t q_stride, int64_t k_stride, int tokens,
                        int q_heads, int k_heads, int D, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  const int heads = q_heads + k_heads;
  if (row >= static_cast<int64_t>(tokens) * heads) return;
  const int token = static_cast<int>(row / heads), head = static_cast<int>(row % heads);
  const bool is_q = head < q_heads;
  const int h = is_q ? head : head - q_heads;
  const T* in = is_q ? q + token * q_stride + h * D : k + token * k_stride + h * D;
  T* out = is_q ? q_out + (static_cast<int64_t>(token) * q_heads + h) * D
                : k_out + (static_cast<int64_t>(token) * k_heads + h) * D;
  const T* w = is_q ? q_weight : k_weight;
  const T* c = cos + static_cast<int64_t>(token) * D;
  const T* s = sin + static_cast<int64_t>(token) * D;
  const int half = D / 2;

  float lo[kMaxPairsPerLane], hi[kMaxPairsPerLane];
  float ss = 0.f;
#pragma unroll
  for (int p = 0; p < kMaxPairsPerLane; ++p) {
    const int i = lane + 32 * p;
    lo[p] = i < half ? to_float<T>(in[i]) : 0.f;
    hi[p] = i < half ? to_float<T>(in[i + half]) : 0.f;
    ss = fmaf(lo[p], lo[p], fmaf(hi[p], hi[p], ss));
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  const float rstd = rsqrtf(ss * (1.0f / static_cast<float>(D)) + eps);

#pragma unroll
  for (int p = 0; p < kMaxPairsPerLane; ++p) {
    const int i = lane + 32 * p;
    if (i >= half) break;
    const float ylo = to_float<T>(from_float<T>(to_float<T>(w[i]) * to_float<T>(from_float<T>(lo[p] * rstd))));
    const float yhi =
        to_float<T>(from_float<T>(to_float<T>(w[i + half]) * to_float<T>(from_float<T>(hi[p] * rstd))));
    const auto rotate = [](float y, float cs, float rot, float sn) {
      return from_float<T>(to_float<T>(from_float<T>(y * cs)) + to_float<T>(from_float<T>(rot * sn)));
    };
    out[i] = rotate(ylo, to_float<T>(c[i]), -yhi, to_float<T>(s[i]));
    out[i + half] = rotate(yhi, to_float<T>(c[i + half]), ylo, to_float<T>(s[i + half]));
  }
}

template <typename T>
cudaError_t launch_typed(const QkNormRopeArgs& a, dim3 grid, cudaStream_t stream) {
  qk_norm_rope_kernel<T><<<grid, kRowsPerBlock * 32, 0, stream>>>(
      static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.q_weight),
      static_cast<const T*>(a.k_weight), static_cast<const T*>(a.cos), static_cast<const T*>(a.sin),
      static_cast<T*>(a.q_out), static_cast<T*>(a.k_out), a.q_stride, a.k_stride, a.tokens, a.q_heads, a.k_heads, a.D,
      a.eps);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_qk_norm_rope(const QkNormRopeArgs& a, cudaStream_t stream) {
  if (a.D % 2 || a.D > kMaxHeadDim || a.D <= 0) return cudaErrorInvalidValue;
  const int64_t rows = static_cast<int64_t>(a.tokens) * (a.q_heads + a.k_heads);
  if (rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
  return a.bf16 ? launch_typed<__nv_bfloat16>(a, grid, stream) : launch_typed<__half>(a, grid, stream);
}

}  // namespace w4a4
