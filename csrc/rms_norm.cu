// RMSNorm of rows (Qwen3's: y = T(w * T(x * rsqrt(mean(x^2) + eps))), float32 inside), for the paths whose
// consumer is not a W4A4 linear (the bf16 engine's q/k/v and gate/up inputs, the final norm). torch runs
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

template <typename T>
__global__ void __launch_bounds__(kRowsPerBlock * 32)
    rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int rows, int K, float eps) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const T* xr = x + static_cast<int64_t>(row) * K;
  T* yr = y + static_cast<int64_t>(row) * K;
  const float rstd = warp_row_rstd(xr, K, lane, eps);
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
  rms_norm_kernel<T><<<grid, kRowsPerBlock * 32, 0, stream>>>(static_cast<const T*>(a.x), static_cast<const T*>(a.weight),
                                                               static_cast<T*>(a.y), a.rows, a.K, a.eps);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
  if (a.K % kVec || a.K <= 0) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  return a.bf16 ? launch_typed<__nv_bfloat16>(a, stream) : launch_typed<__half>(a, stream);
}

}  // namespace w4a4
