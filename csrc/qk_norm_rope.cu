// Kernel 3: Qwen3's per-head RMSNorm of q and k followed by rotate-half RoPE, one pass over q and k.
//
// torch runs this as a chain of elementwise kernels with float32 intermediates (engine/model/layers.py,
// 8.5x-10x slower in bench/results/fused-h200.json); this one reads each head row once and writes it once,
// with the same roundings: the normed row is
// T(w * T(x * rsqrt(mean(x^2) + eps))), then out = T(T(y * cos) + T(rot(y) * sin)) with
// rot(y)[i] = -y[i + D/2] for i < D/2 and y[i - D/2] otherwise, cos/sin the model's T tables.
// Only the order of the sum of squares differs from torch's reduction (last-bit rstd differences).
//
// 16-byte accesses: a head row is D / 8 lanes of 8 elements (a warp holds 256 / D rows); the lane holding
// elements i.. of the first half trades its normed values with the lane holding i + D/2.. by one shuffle
// distance, D / 16 lanes.
#include "w4a4_common.cuh"
#include "w4a4_launch.h"

namespace w4a4 {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kVec = 8;

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    qk_norm_rope_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ q_weight,
                        const T* __restrict__ k_weight, const T* __restrict__ cos, const T* __restrict__ sin,
                        T* __restrict__ q_out, T* __restrict__ k_out, int64_t q_stride, int64_t k_stride, int tokens,
                        int q_heads, int k_heads, int D, float eps) {
  const int lane = threadIdx.x & 31;
  const int lanes_per_row = D / kVec, rows_per_warp = 32 / lanes_per_row;
  const int sub = lane / lanes_per_row, col = (lane % lanes_per_row) * kVec;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t row = warp * rows_per_warp + sub;
  const int heads = q_heads + k_heads;
  // Every lane stays to the end: the shuffles below need the whole warp.
  const bool valid = row < static_cast<int64_t>(tokens) * heads;
  const int token = valid ? static_cast<int>(row / heads) : 0, head = valid ? static_cast<int>(row % heads) : 0;
  const bool is_q = head < q_heads;
  const int h = is_q ? head : head - q_heads;
  const T* in = is_q ? q + token * q_stride + h * D : k + token * k_stride + h * D;
  const T* w = is_q ? q_weight : k_weight;

  uint4 raw = make_uint4(0, 0, 0, 0), wraw = raw, craw = raw, sraw = raw;
  if (valid) {
    raw = *reinterpret_cast<const uint4*>(in + col);
    wraw = *reinterpret_cast<const uint4*>(w + col);
    craw = *reinterpret_cast<const uint4*>(cos + static_cast<int64_t>(token) * D + col);
    sraw = *reinterpret_cast<const uint4*>(sin + static_cast<int64_t>(token) * D + col);
  }
  const T* x = reinterpret_cast<const T*>(&raw);
  float ss = 0.f;
#pragma unroll
  for (int b = 0; b < kVec; ++b) ss = fmaf(to_float<T>(x[b]), to_float<T>(x[b]), ss);
  for (int m = lanes_per_row / 2; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  const float rstd = rsqrtf(ss * (1.0f / static_cast<float>(D)) + eps);

  const T* wv = reinterpret_cast<const T*>(&wraw);
  uint4 normed;
  T* y = reinterpret_cast<T*>(&normed);
#pragma unroll
  for (int b = 0; b < kVec; ++b)
    y[b] = rms_normed<T>(x[b], wv[b], rstd);
  const int partner_distance = lanes_per_row / 2;
  uint4 other;
  other.x = __shfl_xor_sync(0xffffffffu, normed.x, partner_distance);
  other.y = __shfl_xor_sync(0xffffffffu, normed.y, partner_distance);
  other.z = __shfl_xor_sync(0xffffffffu, normed.z, partner_distance);
  other.w = __shfl_xor_sync(0xffffffffu, normed.w, partner_distance);
  if (!valid) return;

  const bool first_half = col < D / 2;
  const T* yo = reinterpret_cast<const T*>(&other);
  const T* c = reinterpret_cast<const T*>(&craw);
  const T* s = reinterpret_cast<const T*>(&sraw);
  uint4 res;
  T* o = reinterpret_cast<T*>(&res);
#pragma unroll
  for (int b = 0; b < kVec; ++b) {
    const float rot = first_half ? -to_float<T>(yo[b]) : to_float<T>(yo[b]);
    o[b] = from_float<T>(to_float<T>(from_float<T>(to_float<T>(y[b]) * to_float<T>(c[b]))) +
                         to_float<T>(from_float<T>(rot * to_float<T>(s[b]))));
  }
  T* out = is_q ? q_out + (static_cast<int64_t>(token) * q_heads + h) * D
                : k_out + (static_cast<int64_t>(token) * k_heads + h) * D;
  *reinterpret_cast<uint4*>(out + col) = res;
}

template <typename T>
cudaError_t launch_typed(const QkNormRopeArgs& a, dim3 grid, cudaStream_t stream) {
  qk_norm_rope_kernel<T><<<grid, kWarpsPerBlock * 32, 0, stream>>>(
      static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.q_weight),
      static_cast<const T*>(a.k_weight), static_cast<const T*>(a.cos), static_cast<const T*>(a.sin),
      static_cast<T*>(a.q_out), static_cast<T*>(a.k_out), a.q_stride, a.k_stride, a.tokens, a.q_heads, a.k_heads, a.D,
      a.eps);
  return cudaGetLastError();
}

}  // namespace

bool qk_norm_rope_supports(int D) { return D == 16 || D == 32 || D == 64 || D == 128 || D == 256; }

cudaError_t launch_qk_norm_rope(const QkNormRopeArgs& a, cudaStream_t stream) {
  if (!qk_norm_rope_supports(a.D)) return cudaErrorInvalidValue;
  const int64_t rows = static_cast<int64_t>(a.tokens) * (a.q_heads + a.k_heads);
  if (rows == 0) return cudaSuccess;
  const int64_t rows_per_block = kWarpsPerBlock * (256 / a.D);
  const dim3 grid(static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block));
  return a.bf16 ? launch_typed<__nv_bfloat16>(a, grid, stream) : launch_typed<__half>(a, grid, stream);
}

}  // namespace w4a4
