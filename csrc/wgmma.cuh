// The W4A4 GEMM's K-loop instructions: Hopper's warpgroup MMA (wgmma, sm_90a) as the GEMM issues it, e4m3 x
// e4m3 into fp16 pairs, A from registers, B from shared memory, with the fences around it; and the fold of a
// group's sums, as csrc/w4a4_gemm.cu issues them.
#pragma once
#include <cstdint>
#include <cuda_fp16.h>

namespace w4a4 {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Pins registers that the asynchronous wgmma reads or writes (accumulators, A fragments) around its
// fence/wait instructions, so the compiler moves no access to them across.
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&regs)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(regs[i])::"memory");
}

#define W4A4_D8(i) "+r"(d[i]), "+r"(d[i + 1]), "+r"(d[i + 2]), "+r"(d[i + 3]), "+r"(d[i + 4]), "+r"(d[i + 5]), \
                   "+r"(d[i + 6]), "+r"(d[i + 7])
// A wgmma's 64 sum registers d[0..63]: their place in the instruction (operands %0..%63) and their constraints.
#define W4A4_WGMMA_D64                                                               \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define W4A4_D64 W4A4_D8(0), W4A4_D8(8), W4A4_D8(16), W4A4_D8(24), W4A4_D8(32), W4A4_D8(40), W4A4_D8(48), W4A4_D8(56)

// d (+)= a * b: m64nNk32, e4m3 x e4m3 -> fp16 pairs (d[2j + h]: weight row 8h + lane / 4 of the warp's 16,
// activation rows 8j + 2 (lane % 4) and the next), A from registers (this warp's 16 rows), B from shared
// memory; scale_d = 0 starts a fresh sum.
__device__ __forceinline__ void wgmma_e4m3_rs(uint32_t (&d)[64], const uint32_t (&a)[4], uint64_t b_desc,
                                              int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f16.e4m3.e4m3 " W4A4_WGMMA_D64
      ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : W4A4_D64
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d)
      : "memory");
}

__device__ __forceinline__ void wgmma_e4m3_rs(uint32_t (&d)[32], const uint32_t (&a)[4], uint64_t b_desc,
                                              int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f16.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : W4A4_D8(0), W4A4_D8(8), W4A4_D8(16), W4A4_D8(24)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d)
      : "memory");
}

__device__ __forceinline__ void wgmma_e4m3_rs(uint32_t (&d)[16], const uint32_t (&a)[4], uint64_t b_desc,
                                              int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f16.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "{%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : W4A4_D8(0), W4A4_D8(8)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d)
      : "memory");
}

// The fp16 pairs of a wgmma accumulator register, and back.
__device__ __forceinline__ __half2 as_half2(uint32_t bits) { return *reinterpret_cast<const __half2*>(&bits); }
__device__ __forceinline__ uint32_t bits_of(__half2 v) { return *reinterpret_cast<const uint32_t*>(&v); }

// The fold of activation rows 32p .. 32p + 31 (j = 4p .. 4p + 3): acc_h[2j + h] += d[2j + h] * (ra * rw_h) in
// fp16 pairs, ra8 holding the scale ratios of this thread's two activation rows of each j side by side.
template <int N>
__device__ __forceinline__ void fold_ratio_pairs(uint32_t (&acc_h)[N], const uint32_t (&d)[N], int p, uint4 ra8,
                                                 __half2 rw0, __half2 rw1) {
  const uint32_t ra_pairs[4] = {ra8.x, ra8.y, ra8.z, ra8.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const __half2 ra = as_half2(ra_pairs[q]);
    const int j = 4 * p + q;
    acc_h[2 * j] = bits_of(__hfma2(as_half2(d[2 * j]), __hmul2(ra, rw0), as_half2(acc_h[2 * j])));
    acc_h[2 * j + 1] = bits_of(__hfma2(as_half2(d[2 * j + 1]), __hmul2(ra, rw1), as_half2(acc_h[2 * j + 1])));
  }
}

}  // namespace w4a4
