// Shared pieces of the W4A4 kernels: the operand layouts, int4 -> e4m3 unpacking, MMA wrappers.
//
// Both GEMM operands are e4m3 bytes holding integers: the byte (s << 7) | n is (-1)^s * n * 2^-9 for n in
// 0..15 (subnormals 0..7, the smallest normals 8..15), so a value's sign and magnitude are its bits, and
// the FP8 tensor cores sum the products of two such bytes exactly (each 2^-18 times an integer product;
// tests/test_kernels.py's test_group_dots_are_exact checks it bit for bit). The weight scale carries the 2^18
// back.
//
// Packed weight layout: one 16-byte record per lane of a warp for each 16 x 64 tile (16 rows of N, one
// 64-wide K group), records of a tile contiguous (512 bytes). Lane l = 4 * gr + t holds four 32-bit words;
// word i holds rows gr + 8 * (i & 1), k = 16 * (i >> 1) + 4t + b (b the byte): low nibbles for k 0..31 of
// the group, high nibbles for k 32..63. A word's low (high) nibbles are thus exactly the 8-bit A-fragment
// register i of a wgmma m64nNk32 for the warp's 16 rows, for k-step 0 (1). A nibble codes w in [-8, 7]
// as w itself for w >= 0 and as 8 | (-w - 1) below, so that e4m3(w) = nibble + 121 * (nibble >> 3).
//
// Activation layout: the quantize kernel writes e4m3 bytes straight into wgmma's canonical K-major
// no-swizzle shared-memory layout, so the GEMM copies them with no unpacking: per block of 128 rows and
// 64-wide K group an 8 KB tile, byte (m, k) at (k / 16) * 2048 + 16 * m + k % 16; tiles in (block, group)
// order. 4-bit values in 8-bit containers: twice the bytes of packed nibbles in this transient buffer
// (weights stay 4-bit), and no unpacking in the GEMM's inner loop.
// engine/kernels/w4a4.py builds and reads both layouts in torch (tests compare against them).
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "w4a4_launch.h"

namespace w4a4 {

constexpr int kGroup = 64;
constexpr int kActChunkBytes = kActBlockRows * 16;  // one 16-wide k chunk of an activation tile
static_assert(kActTileBytes == kActBlockRows * kGroup, "an activation tile is 128 rows x one K group");

// The e4m3 bytes of the low nibbles of `codes` (a packed word for k-step 0, the word >> 4 for k-step 1):
// 121 = 0x80 + 1 - 8 turns the code 8 | m of w = -(m + 1) into the byte 0x80 | (m + 1).
__device__ __forceinline__ uint32_t e4m3_from_code(uint32_t codes) {
  return (codes & 0x0F0F0F0Fu) + 121u * ((codes >> 3) & 0x01010101u);
}

// The e4m3 bytes of two floats v * 2^-9 with |v| < 7.5 (lo in the low byte): below 2^-5 the e4m3 values are
// the integers times 2^-9 (subnormals, then the smallest normals), so the hardware conversion rounds v to an
// integer, ties to even, as torch.round does. A v that rounds to 0 from below gives e4m3 -0 (0x80), which the
// tensor cores multiply as 0.
__device__ __forceinline__ uint32_t e4m3x2_of_grid_units(float lo, float hi) {
  uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(pair) : "f"(hi), "f"(lo));
  return pair;
}

// The e4m3 bytes of clamp(round_half_even(v), -8, 7) for any two floats v: scaled by 2^-9 (exact: a power of
// two) and clamped first (integer bounds commute with the rounding).
__device__ __forceinline__ uint32_t e4m3x2_of_rounded(float lo, float hi) {
  constexpr float kLow = -8.0f / 512, kHigh = 7.0f / 512;
  return e4m3x2_of_grid_units(fminf(fmaxf(lo * (1.0f / 512), kLow), kHigh),
                              fminf(fmaxf(hi * (1.0f / 512), kLow), kHigh));
}

// D += A * B with bf16 or fp16 inputs and float32 accumulators (m16n8k16).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// The low-rank activations [M_pad, R] are stored tf32-rounded (their one consumer is the GEMM's tf32 MMA)
// with columns k and k + 4 of each 8-wide block side by side, so one 8-byte load is an MMA B fragment.
__host__ __device__ constexpr int lora_position(int col) { return (col & ~7) + 2 * (col & 3) + ((col >> 2) & 1); }

// The activation scales [K/64, M_pad] are stored in the GEMM's reading order within each 32 rows: the
// fold's thread t needs rows 8j + 2t and 8j + 2t + 1 for j = 0..3 together, so they sit at 8t .. 8t + 7
// (one 16-byte load of fp16 ratios; row r + 8 two places after row r).
__host__ __device__ constexpr int activation_scale_position(int row) {
  return (row & ~31) + 8 * ((row >> 1) & 3) + 2 * ((row >> 3) & 3) + (row & 1);
}

// D += A * B in tf32 with float32 accumulators (m16n8k8).
__device__ __forceinline__ void mma_tf32_1688(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Two T values (a 32-bit word, lo first) as floats, and two floats rounded to T (round to nearest even, as
// torch's casts) in one instruction.
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
  else
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
}
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t out;
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    *reinterpret_cast<__nv_bfloat162*>(&out) = __floats2bfloat162_rn(lo, hi);
  else
    *reinterpret_cast<__half2*>(&out) = __floats2half2_rn(lo, hi);
  return out;
}
template <typename T>
__device__ __forceinline__ float2 round2(float lo, float hi) {
  return unpack2<T>(pack2<T>(lo, hi));
}
// Two RMSNorm output elements (a 32-bit word of x and the matching word of w) rounded as torch rounds them:
// T(w * T(x * rstd)).
template <typename T>
__device__ __forceinline__ uint32_t rms_normed2(uint32_t x, uint32_t w, float rstd) {
  const float2 xf = unpack2<T>(x), wf = unpack2<T>(w);
  const float2 xn = round2<T>(xf.x * rstd, xf.y * rstd);
  return pack2<T>(wf.x * xn.x, wf.y * xn.y);
}

// Two SwiGLU elements (a 32-bit word of gate and the matching word of up) rounded as torch rounds them:
// T(T(silu(g)) * u), silu(g) = g / (1 + expf(-g)) in float32 with IEEE division, as torch's SiLU.
template <typename T>
__device__ __forceinline__ uint32_t silu_mul2(uint32_t g, uint32_t u) {
  const float2 gf = unpack2<T>(g), uf = unpack2<T>(u);
  const float2 s = round2<T>(gf.x / (1.0f + expf(-gf.x)), gf.y / (1.0f + expf(-gf.y)));
  return pack2<T>(s.x * uf.x, s.y * uf.y);
}
template <typename T>
__device__ __forceinline__ uint4 silu_mul8(uint4 g, uint4 u) {
  return make_uint4(silu_mul2<T>(g.x, u.x), silu_mul2<T>(g.y, u.y), silu_mul2<T>(g.z, u.z), silu_mul2<T>(g.w, u.w));
}

// Two elements of a residual add rounded as torch rounds it: T(a + b).
template <typename T>
__device__ __forceinline__ uint32_t add2(uint32_t a, uint32_t b) {
  const float2 af = unpack2<T>(a), bf = unpack2<T>(b);
  return pack2<T>(af.x + bf.x, af.y + bf.y);
}
template <typename T>
__device__ __forceinline__ uint4 add8(uint4 a, uint4 b) {
  return make_uint4(add2<T>(a.x, b.x), add2<T>(a.y, b.y), add2<T>(a.z, b.z), add2<T>(a.w, b.w));
}
// ss plus the squares of 8 T values, in the order warp_row_rstd sums them.
template <typename T>
__device__ __forceinline__ float add_squares8(uint4 v, float ss) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = unpack2<T>(words[j]);
    ss = fmaf(f.y, f.y, fmaf(f.x, f.x, ss));
  }
  return ss;
}
// rsqrt(mean(x^2) + eps) from one lane's sum of squares, the warp adding the lanes' sums.
__device__ __forceinline__ float warp_rstd(float ss, int K, float eps) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  return rsqrtf(ss * (1.0f / static_cast<float>(K)) + eps);
}

// rsqrt(mean(x^2) + eps) of a row of K T values (K a multiple of 8, 16-byte aligned), one warp per row:
// each lane sums the squares of its 16-byte pieces in order, then the warp adds the lanes' sums.
template <typename T>
__device__ __forceinline__ float warp_row_rstd(const T* x, int K, int lane, float eps) {
  float ss = 0.f;
  for (int c = lane * 8; c < K; c += 32 * 8) ss = add_squares8<T>(*reinterpret_cast<const uint4*>(x + c), ss);
  return warp_rstd(ss, K, eps);
}

}  // namespace w4a4
