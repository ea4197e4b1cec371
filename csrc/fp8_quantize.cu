// Row-wise e4m3 quantization of an FP8 linear's input, inside the kernel that produces that input:
//   copy:     x                                   (the attention output, o_proj's input)
//   rms_norm: T(w * T(x * rstd))                  (q/k/v and gate/up inputs; rstd as csrc/rms_norm.cu)
//   add_rms_norm: rms_norm of x + delta, which is written over x (the block's residual add before its norm)
//   silu_mul: T(T(silu(gate)) * up)               (down_proj's input; as csrc/silu_mul.cu)
// Each row r gets scale[r] = a / 448 and codes e4m3(v * (448 / a)), a = max(max|v|, kFp8MinAmax) (IEEE
// divisions, round to nearest even): engine/fp8/reference.py quantize_rows on the same T values, bit for bit.
// One warp per row, 16-byte reads, each value produced once and kept in registers until the row's maximum
// is known (rows of up to kFp8MaxK elements); RMSNorm reads x once more first, for its statistics (after the
// add, the sums are held in registers instead). silu_mul, whose rows are the MLP's (3072 at full size), takes
// a block of kSiluRowThreads per row instead: a lane of a warp-per-row kernel held 12 pieces, which left an
// SM few warps to hide its loads behind; a maximum does not depend on the order it is taken in, so the codes
// are the same.
#include <cuda_fp8.h>

#include "w4a4_common.cuh"
#include "w4a4_launch.h"

namespace w4a4 {
namespace {

constexpr int kRowsPerBlock = 8;
constexpr int kVec = 8;  // elements per 16-byte access
constexpr float kE4m3Max = 448.0f;

template <typename T>
__device__ __forceinline__ uint4 rms_normed8(uint4 x, uint4 w, float rstd) {
  return make_uint4(rms_normed2<T>(x.x, w.x, rstd), rms_normed2<T>(x.y, w.y, rstd), rms_normed2<T>(x.z, w.z, rstd),
                    rms_normed2<T>(x.w, w.w, rstd));
}

// The 8 values of the row at column c, as T words (add_rms_norm makes its own in the kernel).
template <typename T, Fp8Source S>
__device__ __forceinline__ uint4 produce(const T* x, const T* second, int c, float rstd) {
  const uint4 raw = *reinterpret_cast<const uint4*>(x + c);
  if constexpr (S == Fp8Source::kCopy) {
    return raw;
  } else {
    const uint4 s = *reinterpret_cast<const uint4*>(second + c);
    if constexpr (S == Fp8Source::kRmsNorm)
      return rms_normed8<T>(raw, s, rstd);
    else
      return silu_mul8<T>(raw, s);
  }
}

__device__ __forceinline__ uint32_t e4m3x2(float2 v, float inv_scale) {
  return static_cast<uint32_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(v.x * inv_scale, v.y * inv_scale), __NV_SATFINITE, __NV_E4M3));
}

template <typename T>
__device__ __forceinline__ float amax8(uint4 v, float amax) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = unpack2<T>(words[j]);
    amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
  return amax;
}

// The 8 codes of values v at q + c.
template <typename T>
__device__ __forceinline__ void store_codes8(uint8_t* q, int c, uint4 v, float inv_scale) {
  const uint32_t lo = e4m3x2(unpack2<T>(v.x), inv_scale) | (e4m3x2(unpack2<T>(v.y), inv_scale) << 16);
  const uint32_t hi = e4m3x2(unpack2<T>(v.z), inv_scale) | (e4m3x2(unpack2<T>(v.w), inv_scale) << 16);
  *reinterpret_cast<uint2*>(q + c) = make_uint2(lo, hi);
}

// kChunks = K / 256 rounded up: each lane keeps its kChunks 16-byte pieces of the produced row in registers
// between finding the row's maximum and writing the codes, so each value is produced once.
template <typename T, Fp8Source S, int kChunks>
__global__ void __launch_bounds__(kRowsPerBlock * 32) fp8_quantize_kernel(const Fp8QuantizeArgs a) {
  const int lane = threadIdx.x & 31;
  const int row = blockIdx.x * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= a.rows) return;
  const int K = a.K;
  T* x = static_cast<T*>(a.x) + static_cast<int64_t>(row) * a.x_ld;
  const T* second = static_cast<const T*>(a.second);

  uint4 values[kChunks];
  float rstd = 0.f;
  if constexpr (S == Fp8Source::kRmsNorm) rstd = warp_row_rstd(x, K, lane, a.eps);
  if constexpr (S == Fp8Source::kAddRmsNorm) {
    const T* delta = static_cast<const T*>(a.delta) + static_cast<int64_t>(row) * K;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = (i * 32 + lane) * kVec;
      if (c < K) {
        values[i] = add8<T>(*reinterpret_cast<const uint4*>(x + c), *reinterpret_cast<const uint4*>(delta + c));
        *reinterpret_cast<uint4*>(x + c) = values[i];
        ss = add_squares8<T>(values[i], ss);
      }
    }
    rstd = warp_rstd(ss, K, a.eps);
  }

  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = (i * 32 + lane) * kVec;
    if (c < K) {
      if constexpr (S == Fp8Source::kAddRmsNorm)
        values[i] = rms_normed8<T>(values[i], *reinterpret_cast<const uint4*>(second + c), rstd);
      else
        values[i] = produce<T, S>(x, second, c, rstd);
      amax = amax8<T>(values[i], amax);
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  amax = fmaxf(amax, kFp8MinAmax);
  const float inv_scale = __fdiv_rn(kE4m3Max, amax);

  uint8_t* q = static_cast<uint8_t*>(a.q) + static_cast<int64_t>(row) * K;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = (i * 32 + lane) * kVec;
    if (c < K) store_codes8<T>(q, c, values[i], inv_scale);
  }
  if (lane == 0) a.scale[row] = __fdiv_rn(amax, kE4m3Max);
}

constexpr int kSiluRowThreads = 128;

// silu_mul rows, a block per row: each thread produces kChunks 16-byte pieces (K <= kChunks x 1024), the
// block takes their maximum, then each thread writes its pieces' codes.
template <typename T, int kChunks>
__global__ void __launch_bounds__(kSiluRowThreads) fp8_silu_mul_rows_kernel(const Fp8QuantizeArgs a) {
  const int row = blockIdx.x;
  const int K = a.K;
  const T* gate = static_cast<const T*>(a.x) + static_cast<int64_t>(row) * a.x_ld;
  const T* up = static_cast<const T*>(a.second) + static_cast<int64_t>(row) * a.second_ld;

  uint4 values[kChunks];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = (i * kSiluRowThreads + threadIdx.x) * kVec;
    if (c < K) {
      values[i] = produce<T, Fp8Source::kSiluMul>(gate, up, c, 0.f);
      amax = amax8<T>(values[i], amax);
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  __shared__ float warp_amax[kSiluRowThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = amax;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kSiluRowThreads / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
  amax = fmaxf(amax, kFp8MinAmax);
  const float inv_scale = __fdiv_rn(kE4m3Max, amax);

  uint8_t* q = static_cast<uint8_t*>(a.q) + static_cast<int64_t>(row) * K;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = (i * kSiluRowThreads + threadIdx.x) * kVec;
    if (c < K) store_codes8<T>(q, c, values[i], inv_scale);
  }
  if (threadIdx.x == 0) a.scale[row] = __fdiv_rn(amax, kE4m3Max);
}

template <typename T>
cudaError_t launch_silu_mul_rows(const Fp8QuantizeArgs& a, cudaStream_t stream) {
  constexpr int kPerChunk = kSiluRowThreads * kVec;
  static_assert(kFp8MaxK <= 3 * kPerChunk, "a thread holds at most 3 pieces of a row");
  switch ((a.K + kPerChunk - 1) / kPerChunk) {
    case 1: fp8_silu_mul_rows_kernel<T, 1><<<a.rows, kSiluRowThreads, 0, stream>>>(a); break;
    case 2: fp8_silu_mul_rows_kernel<T, 2><<<a.rows, kSiluRowThreads, 0, stream>>>(a); break;
    default: fp8_silu_mul_rows_kernel<T, 3><<<a.rows, kSiluRowThreads, 0, stream>>>(a); break;
  }
  return cudaGetLastError();
}

template <typename T, Fp8Source S, int kChunks>
cudaError_t launch_typed(const Fp8QuantizeArgs& a, cudaStream_t stream) {
  const dim3 grid((a.rows + kRowsPerBlock - 1) / kRowsPerBlock);
  fp8_quantize_kernel<T, S, kChunks><<<grid, kRowsPerBlock * 32, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, Fp8Source S>
cudaError_t launch_chunks(const Fp8QuantizeArgs& a, cudaStream_t stream) {
  switch ((a.K + 32 * kVec - 1) / (32 * kVec)) {
    case 1: return launch_typed<T, S, 1>(a, stream);
    case 2: return launch_typed<T, S, 2>(a, stream);
    case 3: return launch_typed<T, S, 3>(a, stream);
    case 4: return launch_typed<T, S, 4>(a, stream);
    case 5: case 6: return launch_typed<T, S, 6>(a, stream);
    case 7: case 8: return launch_typed<T, S, 8>(a, stream);
    case 9: case 10: case 11: case 12: return launch_typed<T, S, 12>(a, stream);
  }
  return cudaErrorInvalidValue;  // K > kFp8MaxK
}

template <typename T>
cudaError_t launch_source(const Fp8QuantizeArgs& a, Fp8Source source, cudaStream_t stream) {
  switch (source) {
    case Fp8Source::kCopy: return launch_chunks<T, Fp8Source::kCopy>(a, stream);
    case Fp8Source::kRmsNorm: return launch_chunks<T, Fp8Source::kRmsNorm>(a, stream);
    case Fp8Source::kAddRmsNorm: return launch_chunks<T, Fp8Source::kAddRmsNorm>(a, stream);
    case Fp8Source::kSiluMul: return launch_silu_mul_rows<T>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_fp8_quantize(const Fp8QuantizeArgs& a, Fp8Source source, cudaStream_t stream) {
  if (a.K % kVec || a.K <= 0 || a.K > kFp8MaxK) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  return a.bf16 ? launch_source<__nv_bfloat16>(a, source, stream) : launch_source<__half>(a, source, stream);
}

}  // namespace w4a4
