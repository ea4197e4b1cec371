// silu(gate) * up, the SwiGLU MLP's input to down_proj (bf16 or W4A4; a prologue fused into W4A4 activation
// quantization measured slower, docs/kernels.md): torch runs
// two kernels and writes silu(gate) to memory in between; this reads gate and up once and writes once,
// with torch's roundings, T(T(silu(g)) * u), and its silu (g / (1 + expf(-g)) in float32, IEEE division).
// gate and up may be row-strided (the two halves of a grouped gate/up projection's output).
#include <algorithm>

#include "w4a4_common.cuh"
#include "w4a4_launch.h"

namespace w4a4 {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // elements per 16-byte access

template <typename T>
__global__ void __launch_bounds__(kThreads)
    silu_mul_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out, int64_t gate_ld,
                    int64_t up_ld, int row_vectors, int64_t vectors) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < vectors;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = i / row_vectors;
    const int col = static_cast<int>(i - row * row_vectors) * kVec;
    const uint4 graw = *reinterpret_cast<const uint4*>(gate + row * gate_ld + col);
    const uint4 uraw = *reinterpret_cast<const uint4*>(up + row * up_ld + col);
    const T* g = reinterpret_cast<const T*>(&graw);
    const T* u = reinterpret_cast<const T*>(&uraw);
    uint4 res;
    T* o = reinterpret_cast<T*>(&res);
#pragma unroll
    for (int b = 0; b < kVec; ++b) {
      const float gf = to_float<T>(g[b]);
      o[b] = from_float<T>(to_float<T>(from_float<T>(gf / (1.0f + expf(-gf)))) * to_float<T>(u[b]));
    }
    reinterpret_cast<uint4*>(out)[i] = res;
  }
}

template <typename T>
cudaError_t launch_typed(const SiluMulArgs& a, cudaStream_t stream) {
  int sms = 0;
  const cudaError_t err = sm_count(&sms);
  if (err != cudaSuccess) return err;
  const int row_vectors = a.cols / kVec;
  const int64_t vectors = a.rows * row_vectors;
  const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads, 8LL * sms);
  silu_mul_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const T*>(a.gate), static_cast<const T*>(a.up), static_cast<T*>(a.out), a.gate_ld, a.up_ld,
      row_vectors, vectors);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_silu_mul(const SiluMulArgs& a, cudaStream_t stream) {
  if (a.cols % kVec || a.gate_ld % kVec || a.up_ld % kVec) return cudaErrorInvalidValue;
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  return a.bf16 ? launch_typed<__nv_bfloat16>(a, stream) : launch_typed<__half>(a, stream);
}

}  // namespace w4a4
