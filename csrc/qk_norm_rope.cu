// Kernel 3: Qwen3's per-head RMSNorm of q and k followed by rotate-half RoPE, one pass over q and k.
//
// torch runs this as a chain of elementwise kernels with float32 intermediates (engine/model/layers.py,
// 10x-18x slower in bench/results/fused-h200.json); this one reads each head row once and writes it once,
// with the same roundings: the normed row is
// T(w * T(x * rsqrt(mean(x^2) + eps))), then out = T(T(y * cos) + T(rot(y) * sin)) with
// rot(y)[i] = -y[i + D/2] for i < D/2 and y[i - D/2] otherwise, cos/sin the model's T tables.
// Only the order of the sum of squares differs from torch's reduction (last-bit rstd differences).
//
// 16-byte accesses: a head row is D / 8 lanes of 8 elements. A warp takes up to Steps x 256 / D heads of one token
// (q's, then k's), 256 / D rows at a time, and reads the token's cos/sin and the norms' weights once for them. Steps is
// 4 from kManyTokens tokens on and 1 below, where the GPU needs a warp per head pair to fill (bench/fused.py on the
// H200: 4 pairs took 9.9 us at 512 tokens against one pair's 7.9, and were as fast or faster from 8192). The lane
// holding elements i.. of the first half trades its normed values with the lane holding i + D/2.. by one shuffle
// distance, D / 16 lanes. With a row pair a warp the kernel was bound by its instructions (ncu, docs/kernels.md), so
// the arithmetic runs on pairs: one conversion rounds two floats to T, bf16 widens to float by bit operations, and D is
// a template parameter.

#include "w4a4_common.cuh"
#include "w4a4_launch.h"

namespace w4a4 {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kVec = 8;
constexpr int kManyTokens = 4096;

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[kVec]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 p = unpack2<T>(w[j]);
    f[2 * j] = p.x;
    f[2 * j + 1] = p.y;
  }
}

template <typename T, int D, int Steps>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    qk_norm_rope_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ q_weight,
                        const T* __restrict__ k_weight, const T* __restrict__ cos, const T* __restrict__ sin,
                        T* __restrict__ q_out, T* __restrict__ k_out, int64_t q_stride, int64_t k_stride, int tokens,
                        int q_heads, int k_heads, float eps) {
  constexpr int kLanesPerRow = D / kVec, kRowsPerWarp = 32 / kLanesPerRow;
  const int lane = threadIdx.x & 31;
  const int sub = lane / kLanesPerRow, col = (lane % kLanesPerRow) * kVec;
  const int heads = q_heads + k_heads;
  const int warps_per_token = (heads + Steps * kRowsPerWarp - 1) / (Steps * kRowsPerWarp);
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  if (warp >= tokens * warps_per_token) return;  // the whole warp leaves
  const int token = warp / warps_per_token;
  const int first = (warp - token * warps_per_token) * Steps * kRowsPerWarp;

  // The token's tables and both norms' weights at the lane's columns, read once for all its heads; sin
  // negated in the first half, where rot(y) = -y[i + D/2]: T(-a * b) = T(a * -b), the rounding is symmetric.
  const int64_t table = static_cast<int64_t>(token) * D + col;
  float wq[kVec], wk[kVec], c[kVec], s[kVec];
  unpack8<T>(*reinterpret_cast<const uint4*>(q_weight + col), wq);
  unpack8<T>(*reinterpret_cast<const uint4*>(k_weight + col), wk);
  unpack8<T>(*reinterpret_cast<const uint4*>(cos + table), c);
  unpack8<T>(*reinterpret_cast<const uint4*>(sin + table), s);
  if (col < D / 2) {
#pragma unroll
    for (int b = 0; b < kVec; ++b) s[b] = -s[b];
  }
  const T* q_row = q + token * q_stride;
  const T* k_row = k + token * k_stride;
  T* q_out_row = q_out + static_cast<int64_t>(token) * q_heads * D;
  T* k_out_row = k_out + static_cast<int64_t>(token) * k_heads * D;

  // All the warp's head rows are read before any is computed: the shuffles between steps would otherwise keep
  // one 16-byte load a lane in flight, too few to cover the memory's latency. Lanes past the token's heads
  // read zeros and write nothing, but stay to the shuffles.
  uint4 raw[Steps];
#pragma unroll
  for (int step = 0; step < Steps; ++step) {
    const int head = first + step * kRowsPerWarp + sub;
    raw[step] = make_uint4(0, 0, 0, 0);
    if (head < heads)
      raw[step] = *reinterpret_cast<const uint4*>(
          (head < q_heads ? q_row + head * D : k_row + (head - q_heads) * D) + col);
  }

#pragma unroll
  for (int step = 0; step < Steps; ++step) {
    if (first + step * kRowsPerWarp >= heads) break;  // the whole warp leaves
    const int head = first + step * kRowsPerWarp + sub;
    const bool valid = head < heads, is_q = head < q_heads;
    float x[kVec];
    unpack8<T>(raw[step], x);

    float ss = 0.f;
#pragma unroll
    for (int b = 0; b < kVec; ++b) ss = fmaf(x[b], x[b], ss);
#pragma unroll
    for (int m = kLanesPerRow / 2; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
    const float rstd = rsqrtf(ss * (1.0f / D) + eps);

    uint32_t normed[4], other[4];  // T(w * T(x * rstd)) in pairs, and the partner lane's
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 xn = round2<T>(x[2 * j] * rstd, x[2 * j + 1] * rstd);
      const float w0 = is_q ? wq[2 * j] : wk[2 * j], w1 = is_q ? wq[2 * j + 1] : wk[2 * j + 1];
      normed[j] = pack2<T>(w0 * xn.x, w1 * xn.y);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) other[j] = __shfl_xor_sync(0xffffffffu, normed[j], kLanesPerRow / 2);
    if (!valid) continue;

    uint4 res;
    uint32_t* r = reinterpret_cast<uint32_t*>(&res);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 y = unpack2<T>(normed[j]), o = unpack2<T>(other[j]);
      const float2 yc = round2<T>(y.x * c[2 * j], y.y * c[2 * j + 1]);
      const float2 os = round2<T>(o.x * s[2 * j], o.y * s[2 * j + 1]);
      r[j] = pack2<T>(yc.x + os.x, yc.y + os.y);
    }
    T* out = is_q ? q_out_row + head * D : k_out_row + (head - q_heads) * D;
    *reinterpret_cast<uint4*>(out + col) = res;
  }
}

template <typename T, int D, int Steps>
cudaError_t launch_typed(const QkNormRopeArgs& a, dim3 grid, cudaStream_t stream) {
  qk_norm_rope_kernel<T, D, Steps><<<grid, kWarpsPerBlock * 32, 0, stream>>>(
      static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.q_weight),
      static_cast<const T*>(a.k_weight), static_cast<const T*>(a.cos), static_cast<const T*>(a.sin),
      static_cast<T*>(a.q_out), static_cast<T*>(a.k_out), a.q_stride, a.k_stride, a.tokens, a.q_heads, a.k_heads,
      a.eps);
  return cudaGetLastError();
}

template <typename T, int Steps>
cudaError_t launch_dim(const QkNormRopeArgs& a, dim3 grid, cudaStream_t stream) {
  switch (a.D) {
    case 16: return launch_typed<T, 16, Steps>(a, grid, stream);
    case 32: return launch_typed<T, 32, Steps>(a, grid, stream);
    case 64: return launch_typed<T, 64, Steps>(a, grid, stream);
    case 128: return launch_typed<T, 128, Steps>(a, grid, stream);
    case 256: return launch_typed<T, 256, Steps>(a, grid, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <int Steps>
cudaError_t launch_steps(const QkNormRopeArgs& a, cudaStream_t stream) {
  const int heads = a.q_heads + a.k_heads, heads_per_warp = Steps * 256 / a.D;
  const int64_t warps = static_cast<int64_t>(a.tokens) * ((heads + heads_per_warp - 1) / heads_per_warp);
  if (warps == 0) return cudaSuccess;
  if (warps * 32 > INT32_MAX) return cudaErrorInvalidValue;  // the kernel counts threads in int
  const dim3 grid(static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock));
  return a.bf16 ? launch_dim<__nv_bfloat16, Steps>(a, grid, stream) : launch_dim<__half, Steps>(a, grid, stream);
}

}  // namespace

bool qk_norm_rope_supports(int D) { return D == 16 || D == 32 || D == 64 || D == 128 || D == 256; }

cudaError_t launch_qk_norm_rope(const QkNormRopeArgs& a, cudaStream_t stream) {
  if (!qk_norm_rope_supports(a.D)) return cudaErrorInvalidValue;
  return a.tokens >= kManyTokens ? launch_steps<4>(a, stream) : launch_steps<1>(a, stream);
}

}  // namespace w4a4
