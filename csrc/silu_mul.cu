// silu(gate) * up, the SwiGLU MLP's input to down_proj (bf16 or W4A4; a prologue fused into W4A4 activation
// quantization measured slower, docs/kernels.md): torch runs
// two kernels and writes silu(gate) to memory in between; this reads gate and up once and writes once,
// with torch's roundings, T(T(silu(g)) * u), and its silu (g / (1 + expf(-g)) in float32, IEEE division).
// gate and up may be row-strided (the two halves of a grouped gate/up projection's output).
// A block per row, as csrc/fp8_quantize.cu's silu_mul: each thread issues the loads of all its 16-byte pieces
// of a stretch of the row before computing any (the MLP's rows are 3072 wide at full size: one stretch).
#include "w4a4_common.cuh"
#include "w4a4_launch.h"

namespace w4a4 {
namespace {

constexpr int kThreads = 128;
constexpr int kVec = 8;  // elements per 16-byte access

template <typename T, int kChunks>
__global__ void __launch_bounds__(kThreads)
    silu_mul_rows_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out,
                         int64_t gate_ld, int64_t up_ld, int cols) {
  const int64_t row = blockIdx.x;
  gate += row * gate_ld;
  up += row * up_ld;
  out += row * cols;
  for (int start = 0; start < cols; start += kChunks * kThreads * kVec) {
    uint4 g[kChunks], u[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = start + (i * kThreads + threadIdx.x) * kVec;
      if (c < cols) {
        g[i] = *reinterpret_cast<const uint4*>(gate + c);
        u[i] = *reinterpret_cast<const uint4*>(up + c);
      }
    }
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = start + (i * kThreads + threadIdx.x) * kVec;
      if (c < cols) *reinterpret_cast<uint4*>(out + c) = silu_mul8<T>(g[i], u[i]);
    }
  }
}

template <typename T, int kChunks>
void launch_rows(const SiluMulArgs& a, cudaStream_t stream) {
  silu_mul_rows_kernel<T, kChunks><<<static_cast<unsigned>(a.rows), kThreads, 0, stream>>>(
      static_cast<const T*>(a.gate), static_cast<const T*>(a.up), static_cast<T*>(a.out), a.gate_ld, a.up_ld,
      a.cols);
}

template <typename T>
cudaError_t launch_typed(const SiluMulArgs& a, cudaStream_t stream) {
  constexpr int kPerChunk = kThreads * kVec;
  switch ((a.cols + kPerChunk - 1) / kPerChunk) {
    case 1: launch_rows<T, 1>(a, stream); break;
    case 2: launch_rows<T, 2>(a, stream); break;
    default: launch_rows<T, 3>(a, stream); break;  // wider rows go in stretches of 3 pieces a thread
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_silu_mul(const SiluMulArgs& a, cudaStream_t stream) {
  if (a.cols % kVec || a.gate_ld % kVec || a.up_ld % kVec) return cudaErrorInvalidValue;
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  if (a.rows > 0x7FFFFFFF) return cudaErrorInvalidValue;  // a block per row
  return a.bf16 ? launch_typed<__nv_bfloat16>(a, stream) : launch_typed<__half>(a, stream);
}

}  // namespace w4a4
