// RMSNorm of rows (Qwen3's: y = T(w * T(x * rsqrt(mean(x^2) + eps))), float32 inside), for the paths whose
// consumer is not a W4A4 linear (the bf16 engine's q/k/v and gate/up inputs, the final norm), optionally
// after the block's residual add (x += delta, as torch's T(x + delta)). torch runs
// it as a chain of elementwise and reduction kernels with float32 intermediates (bench/fused.py measures
// both); this reads x once from memory and writes y once.
// One warp per row, 16-byte accesses: the squares are summed on the first read, the second read of the
// row comes from L1/L2.
#include "w4a4_common.cuh"
#include "w4a4_launch.h"

namespace w4a4 {
namespace {

constexpr int kRowsPerBlock = 8;
constexpr int kVec = 8;  // elements per 16-byte access

// With delta (the residual add before the norm, kAdd): x + delta is written over x (one read of each, one
// write) and normed; the second read of the row comes from L1/L2 as without it.
template <typename T, bool kAdd>
__global__ void __launch_bounds__(kRowsPerBlock * 32)
    rms_norm_kernel(T* x, const T* __restrict__ delta, const T* __restrict__ w, T* __restrict__ y, int rows, int K,
                    float eps) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  T* xr = x + static_cast<int64_t>(row) * K;
  T* yr = y + static_cast<int64_t>(row) * K;
  float rstd;
  if constexpr (kAdd) {
    const T* dr = delta + static_cast<int64_t>(row) * K;
    float ss = 0.f;
    for (int c = lane * kVec; c < K; c += 32 * kVec) {
      const uint4 sum = add8<T>(*reinterpret_cast<const uint4*>(xr + c), *reinterpret_cast<const uint4*>(dr + c));
      *reinterpret_cast<uint4*>(xr + c) = sum;
      ss = add_squares8<T>(sum, ss);
    }
    rstd = warp_rstd(ss, K, eps);
  } else {
    rstd = warp_row_rstd(xr, K, lane, eps);
  }
  for (int c = lane * kVec; c < K; c += 32 * kVec) {
    const uint4 raw = *reinterpret_cast<const uint4*>(xr + c);
    const uint4 wraw = *reinterpret_cast<const uint4*>(w + c);
    const uint4 out = make_uint4(rms_normed2<T>(raw.x, wraw.x, rstd), rms_normed2<T>(raw.y, wraw.y, rstd),
                                 rms_normed2<T>(raw.z, wraw.z, rstd), rms_normed2<T>(raw.w, wraw.w, rstd));
    *reinterpret_cast<uint4*>(yr + c) = out;
  }
}

template <typename T>
cudaError_t launch_typed(const RmsNormArgs& a, cudaStream_t stream) {
  const dim3 grid((a.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  T* x = static_cast<T*>(a.x);
  const T* w = static_cast<const T*>(a.weight);
  T* y = static_cast<T*>(a.y);
  if (a.delta != nullptr)
    rms_norm_kernel<T, true><<<grid, kRowsPerBlock * 32, 0, stream>>>(x, static_cast<const T*>(a.delta), w, y, a.rows,
                                                                      a.K, a.eps);
  else
    rms_norm_kernel<T, false><<<grid, kRowsPerBlock * 32, 0, stream>>>(x, nullptr, w, y, a.rows, a.K, a.eps);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
  if (a.K % kVec || a.K <= 0) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  return a.bf16 ? launch_typed<__nv_bfloat16>(a, stream) : launch_typed<__half>(a, stream);
}

}  // namespace w4a4
