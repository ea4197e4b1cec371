// How fast can the W4A4 GEMM's K loop run on its own instructions? (docs/kernels.md, Floors.)
//
// Each block is one warpgroup that runs the loop of csrc/w4a4_gemm.cu over `groups` K groups of operands in
// shared memory (put there once, or brought by the +copies part), with no epilogue. The loop's parts are
// switched on one at a time (kParts), so the time each adds is measured, not modelled:
//   raw        two wgmma m64nBMk32 (e4m3 x e4m3 -> fp16, A from registers) a group, one group kept in flight:
//              the tensor cores' rate for this instruction;
//   +wait      the GEMM waits for each group's wgmma before the fold reads its sums;
//   +fold      the fold (an HMUL2 and an HFMA2 per output pair, scales read from shared memory);
//   +convert   the packed weight record read from shared memory and unpacked to e4m3 A fragments;
//   +barrier   the block barrier per group that the GEMM's ring needs;
//   +copies    the ring refilled as the GEMM refills it: per thread 16-byte cp.async of a later group's
//              activation tile, weight record and scales (from L2-resident buffers, as the GEMM's mostly are),
//              then its wait and proxy fence;
//   fold/128   the same loop with the fold once per two groups, as scales of 128-wide groups would need (not
//              the numerics contract, ../shared/DESIGN.md: what such a contract would leave to the loop; its
//              fp16 sums of two groups exceed 2048 units, so they would no longer be exact);
//   qkv grid   the whole loop on the qkv GEMM's grid at M = 8192: 2048 blocks of 16 groups, each with its first
//              stages' trip to memory and the waves' tail, but no epilogue; and on 5 whole waves of such blocks.
// And why the fold costs what it does, each beside the loop it changes:
//   no wgmma   the fold alone, on sums that no wgmma wrote: its own issue time;
//   float32    the fold's HMUL2 and HFMA2 as FMUL and FFMA on the same registers (the bits taken as floats: the
//              same instruction count on fp32 arithmetic instead of fp16 pairs);
//   bitwise    the same count as LOP3 on the integer pipe;
//   f32 sums   128-row tiles with wgmma's float32 sums and their real fold, an FMUL and an FFMA per output;
//   ratios in registers  the fold's activation scale ratios read once before the loop instead of from each
//              group's slot (8 LDS.128 a thread and group at 256 rows: as many shared-memory bytes as wgmma's
//              B tile); the same 4 ratio pairs then serve all the thread's rows, so the compiler computes 8 of
//              the 64 scale products (HMUL2) a group: the loads and most products gone together;
//   all products  the same, with the weight scales' last bits XOR-ed with a constant per block of 32 rows, so
//              that no product repeats and all 64 HMUL2 stay: the loads gone alone (a control does the same
//              with the ratios read from the slot);
//   two weight tiles  one warpgroup over 128 weight rows: two wgmma m64n128k32 pairs a group on one 128-row
//              activation tile, so that each ratio load serves both tiles' rows (the 256-row loop's outputs a block
//              and group, half its ratio and activation bytes); with +convert, two weight records unpacked a
//              group, each for 128 activation rows instead of 256;
//   side by side  a block of two warpgroups, one issuing only the wgmma, the other only folding (no fold
//              waits on a wgmma): whether the SM runs the two at once, alone and together;
//   A smem     the weights read by wgmma from shared memory instead of registers (SS instead of RS): with
//              +convert each warp stores its converted rows (stmatrix) into one of two A tiles for the next
//              group, published by the group's barrier; these rows ring 2 activation slots, as does a control.
// All operand bytes are small e4m3 integers (never zeros; the result is written to `sink`, so nothing is
// dead code). Swizzled variants read the same tile through a 64-byte-swizzle descriptor (values land in other
// places; the timing question is only whether the layout changes the tensor cores' rate).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc -o /tmp/gemm_loop_ceiling \
//        bench/gemm_loop_ceiling.cu
//   /tmp/gemm_loop_ceiling [seconds] > bench/results/gemm-loop-ceiling-h200.json
// With `seconds`, each configuration runs at least that long (bench/clocks_under_load.py --probe samples the
// clock and power meanwhile, matched to each row by its wall-clock start and end).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "w4a4_common.cuh"
#include "wgmma.cuh"

using namespace w4a4;

namespace {

#define CHECK_CUDA(call)                                                                          \
  do {                                                                                            \
    const cudaError_t err_ = (call);                                                              \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

enum Part : int {
  kWait = 1, kFold = 2, kConvert = 4, kBarrier = 8, kSwizzle64 = 16, kFoldPer128 = 32, kCopies = 64,
  kFoldFloat = 128, kASmem = 256, kNoMma = 512, kTwoSlots = 1024, kFoldAlu = 2048, kSumsF32 = 4096,
  kRatiosInRegisters = 8192, kProductsKept = 16384
};
// Ring slots the loop walks through: 4, as the GEMM's 4-deep ring, or 2 where the A tiles take the room.
template <int kParts>
constexpr int kSlotsOf = (kParts & (kASmem | kTwoSlots)) != 0 ? 2 : 4;
constexpr int kThreadsPerBlock = 128;
// The +copies sources: kSourceGroups K groups of activations that every block reads, and the weight records and
// scales of kSourceTiles weight tiles (the qkv GEMM's 64 at K = 1024), block b reading tile b % kSourceTiles.
constexpr int kSourceGroups = 16, kSourceTiles = 64;

struct Sources {
  const int8_t* act;    // [kSourceGroups][256 * 64]
  const int4* w;        // [kSourceTiles][kSourceGroups][128]
  const __half* ra;     // [kSourceGroups][256]
  const float* ws;      // [kSourceTiles][kSourceGroups][64]
};

template <int BM, int kParts>
struct Ring {
  static constexpr int kSlots = kSlotsOf<kParts>;
  // The activation tiles first, each 16 KB (256 rows) or 8 KB: every tile 512-byte aligned for the swizzle.
  alignas(1024) int8_t act[kSlots][BM * kGroup];
  int4 w[kSlots][128];  // a 16-byte packed weight record per thread
  __half ra[kSlots][BM];
  float ws[kSlots][64];
};
// A from shared memory: two e4m3 weight tiles (64 rows x one K group, the activations' layout at 64 rows), after
// the ring.
struct ATiles {
  int8_t a[2][64 * kGroup];
};
template <int BM, int kParts>
constexpr size_t kSmemBytes = sizeof(Ring<BM, kParts>) + ((kParts & kASmem) != 0 ? sizeof(ATiles) : 0);

// wgmma_e4m3_rs of csrc/wgmma.cuh with A from shared memory (its descriptor) instead of registers.
__device__ __forceinline__ void wgmma_e4m3_ss(uint32_t (&d)[64], uint64_t a_desc, uint64_t b_desc, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f16.e4m3.e4m3 " W4A4_WGMMA_D64 ", %64, %65, p, 1, 1;\n}\n"
      : W4A4_D64
      : "l"(a_desc), "l"(b_desc), "r"(scale_d)
      : "memory");
}

// wgmma_e4m3_rs of csrc/wgmma.cuh at n = 128 into float32 sums: d[4j + 2h + c] is weight row 8h + lane / 4 of the
// warp's 16, activation row 8j + 2 (lane % 4) + c.
__device__ __forceinline__ void wgmma_e4m3_rs_f32(uint32_t (&d)[64], const uint32_t (&a)[4], uint64_t b_desc,
                                                  int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " W4A4_WGMMA_D64
      ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : W4A4_D64
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d)
      : "memory");
}

__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}

// fold_ratio_pairs of csrc/wgmma.cuh with its two fp16-pair instructions an output pair replaced by step(acc, d,
// ratio, rw, j), which returns the new acc: the same loop and instruction count on other arithmetic.
template <int N, typename Step>
__device__ __forceinline__ void fold_with(uint32_t (&acc)[N], const uint32_t (&d)[N], int p, uint4 ra8, uint32_t rw0,
                                          uint32_t rw1, Step step) {
  const uint32_t ra[4] = {ra8.x, ra8.y, ra8.z, ra8.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int j = 4 * p + q;
    acc[2 * j] = step(acc[2 * j], d[2 * j], ra[q], rw0, j);
    acc[2 * j + 1] = step(acc[2 * j + 1], d[2 * j + 1], ra[q], rw1, j);
  }
}
// As bitwise operations (LOP3, the integer pipe).
__device__ __forceinline__ uint32_t bits_step(uint32_t acc, uint32_t d, uint32_t ra, uint32_t rw, int j) {
  uint32_t s;
  asm("lop3.b32 %0, %1, %2, %3, 0x96;" : "=r"(s) : "r"(ra), "r"(rw), "r"(j));
  asm("lop3.b32 %0, %1, %2, %0, 0x96;" : "+r"(acc) : "r"(d), "r"(s));
  return acc;
}
// On float32 arithmetic (the bits taken as floats): an FMUL and an FFMA.
__device__ __forceinline__ uint32_t float_step(uint32_t acc, uint32_t d, uint32_t ra, uint32_t rw, int) {
  return __float_as_uint(fmaf(__uint_as_float(d), __uint_as_float(ra) * __uint_as_float(rw), __uint_as_float(acc)));
}

// The fold of float32 sums (128-row tiles), acc[i] += d[i] * ra[m] * rw[n]: an FMUL and an FFMA per output (twice
// the fp16 pairs' instructions), the ratios of activation rows 8j + 2t, + 1 read as floats from `ra`.
__device__ __forceinline__ void fold_f32(uint32_t (&acc)[64], const uint32_t (&d)[64], int p, const float* ra,
                                         float rw0, float rw1) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int j = 4 * p + q;
    const float2 r = *reinterpret_cast<const float2*>(ra + 2 * q);
    const float s[4] = {r.x * rw0, r.y * rw0, r.x * rw1, r.y * rw1};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc[4 * j + e] = __float_as_uint(fmaf(__uint_as_float(d[4 * j + e]), s[e], __uint_as_float(acc[4 * j + e])));
  }
}

__device__ __forceinline__ void wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

template <int BM, int kParts>
__device__ __forceinline__ uint64_t act_desc(uint32_t tile, int k_step) {
  if constexpr ((kParts & kSwizzle64) != 0) {
    // K-major, 64-byte swizzle: rows of 64 bytes, 8-row groups 512 bytes apart; a k-step is 32 bytes along K.
    const uint32_t start = tile + 32 * k_step;
    return static_cast<uint64_t>((start >> 4) & 0x3FFF) | (1ull << 16) | (static_cast<uint64_t>(512 >> 4) << 32) |
           (2ull << 62);
  } else {
    // The GEMM's layout: no swizzle, 8 x 16-byte core matrices, BM * 16 bytes apart along K, 128 along M.
    const uint32_t start = tile + 2 * BM * 16 * k_step;
    return static_cast<uint64_t>((start >> 4) & 0x3FFF) | (static_cast<uint64_t>(BM * 16 >> 4) << 16) |
           (static_cast<uint64_t>(128 >> 4) << 32);
  }
}

// Operands, where the copies do not bring them: activation bytes 1..7 (e4m3 2^-9 * 1..7, as the quantize kernel
// writes), weight codes 1..7, scale ratios near those of real data; thread `tid` of 128 fills its share.
template <typename RingT>
__device__ __forceinline__ void fill_operands(RingT& ring, int tid) {
  constexpr int kSlots = RingT::kSlots, BM = sizeof(ring.act[0]) / kGroup;
  for (int i = tid; i < kSlots * BM * kGroup; i += kThreadsPerBlock) (&ring.act[0][0])[i] = 1 + (i * 5 + 3) % 7;
  for (int i = tid; i < kSlots * 128; i += kThreadsPerBlock) {
    const uint32_t c = 0x01010101u * (1 + i % 7) + 0x10101010u * (1 + (i / 7) % 7);
    (&ring.w[0][0])[i] = make_int4(c, c + 0x01000000u, c + 0x00010000u, c + 0x00000100u);
  }
  for (int i = tid; i < kSlots * BM; i += kThreadsPerBlock)
    (&ring.ra[0][0])[i] = __float2half(0.25f + (i % 13) / 17.0f);
  for (int i = tid; i < kSlots * 64; i += kThreadsPerBlock) (&ring.ws[0][0])[i] = 1.0f + (i % 11) / 11.0f;
}

// A thread's packed weight record unpacked into the A fragments of a group's two k-steps (low nibbles, then high),
// as the GEMM does.
__device__ __forceinline__ void unpack_record(const int4 wrec, uint32_t (&a0)[4], uint32_t (&a1)[4]) {
  const uint32_t wv[4] = {static_cast<uint32_t>(wrec.x), static_cast<uint32_t>(wrec.y),
                          static_cast<uint32_t>(wrec.z), static_cast<uint32_t>(wrec.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    a0[i] = e4m3_from_code(wv[i]);
    a1[i] = e4m3_from_code(wv[i] >> 4);
  }
}

template <int BM, int kParts, int kBlocksPerSm>
__global__ void __launch_bounds__(kThreadsPerBlock, kBlocksPerSm)
    loop_kernel(int groups, Sources src, uint32_t* sink) {
  static_assert((kParts & kFold) == 0 || (kParts & kWait) != 0, "the fold reads the sums it waited for");
  static_assert((kParts & kConvert) == 0 || (kParts & kWait) != 0, "A registers are rewritten only after a wait");
  static_assert((kParts & kCopies) == 0 || (kParts & (kWait | kBarrier)) == (kWait | kBarrier),
                "a slot is refilled once every warp's wgmma has read it");
  constexpr bool kSmemA = (kParts & kASmem) != 0, kMma = (kParts & kNoMma) == 0, kF32 = (kParts & kSumsF32) != 0;
  static_assert(!kF32 || BM == 128, "float32 sums on 128-row tiles (their registers)");
  static_assert(!kSmemA || (BM == 256 && (kParts & (kCopies | kFoldPer128)) == 0), "A from shared memory: 256 rows");
  static_assert(!kSmemA || (kParts & kConvert) == 0 || (kParts & kBarrier) != 0,
                "the next group's A tile is published by the group's barrier");
  using RingT = Ring<BM, kParts>;
  constexpr int kSlots = RingT::kSlots;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ring = *reinterpret_cast<RingT*>(smem_raw);
  auto& a_smem = *reinterpret_cast<ATiles*>(smem_raw + sizeof(RingT));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, t = lane & 3;

  // A tiles of e4m3 bytes 1..7, as the activations.
  if constexpr ((kParts & kCopies) == 0) {
    fill_operands(ring, tid);
    if constexpr (kSmemA)
      for (int i = tid; i < static_cast<int>(sizeof(ATiles)); i += kThreadsPerBlock)
        (&a_smem.a[0][0])[i] = 1 + (i * 3 + 1) % 7;
  }

  const int weight_tile = blockIdx.x % kSourceTiles;
  auto refill = [&](int slot, int g) {
    const int gs = g % kSourceGroups, piece = 16 * tid;
    constexpr int kStride = 16 * kThreadsPerBlock;  // bytes between a thread's activation chunks
#pragma unroll
    for (int h = 0; h < BM * kGroup / kStride; ++h)
      cp_async_16(smem_addr(&ring.act[slot][piece + kStride * h]), src.act + gs * 256 * kGroup + piece + kStride * h);
    cp_async_16(smem_addr(&ring.w[slot][tid]), src.w + (weight_tile * kSourceGroups + gs) * 128 + tid);
    if (tid < BM / 8) {
      cp_async_16(smem_addr(&ring.ra[slot][8 * tid]), src.ra + gs * 256 + 8 * tid);
    } else if (tid < BM / 8 + 16) {
      const int piece_ws = 4 * (tid - BM / 8);
      cp_async_16(smem_addr(&ring.ws[slot][piece_ws]), src.ws + (weight_tile * kSourceGroups + gs) * 64 + piece_ws);
    }
  };
  if constexpr ((kParts & kCopies) != 0) {
    for (int s = 0; s < kSlots - 1; ++s) {
      refill(s, s);
      cp_async_commit();
    }
    cp_async_wait<kSlots - 2>();
  }

  // Group g's packed weight record, unpacked: e4m3 A fragments of k-step 0 (low nibbles) and 1 (high).
  auto convert = [&](int slot, uint32_t (&a0)[4], uint32_t (&a1)[4]) { unpack_record(ring.w[slot][tid], a0, a1); };
  // The fragments into A tile `buf` (the activations' layout at 64 rows): register i of k-step s is matrix i of
  // stmatrix (rows 8 (i % 2) .. of the warp's 16, k chunk 2s + i / 2), lane l addressing row l % 8 of matrix l / 8.
  const uint32_t a_lane =
      smem_addr(&a_smem.a[0][0]) + (lane / 16) * 1024 + (2 * warp + lane / 8 % 2) * 128 + lane % 8 * 16;
  auto store_a = [&](int buf, const uint32_t (&a0)[4], const uint32_t (&a1)[4]) {
    stmatrix_x4(a_lane + buf * 64 * kGroup, a0);
    stmatrix_x4(a_lane + buf * 64 * kGroup + 2048, a1);
  };
  if constexpr (kSmemA && (kParts & kConvert) != 0) {
    uint32_t a0[4], a1[4];
    convert(0, a0, a1);
    store_a(0, a0, a1);
  }
  fence_proxy_async();
  __syncthreads();

  const uint32_t act0 = smem_addr(&ring.act[0][0]), a_tiles = smem_addr(&a_smem.a[0][0]);
  const int wrow0 = warp * 16 + (lane >> 2);
  constexpr int kSumRegs = kF32 ? BM / 2 : BM / 4;  // fp16 pairs or floats
  uint32_t acc_h[kSumRegs], d[kSumRegs];
#pragma unroll
  for (int i = 0; i < kSumRegs; ++i) acc_h[i] = d[i] = 0;
  // One pass folds kGroupsPerFold groups' sums: 2 where the scales would cover 128-wide groups.
  constexpr int kGroupsPerFold = (kParts & kFoldPer128) != 0 ? 2 : 1;
  uint32_t a[2 * kGroupsPerFold][4];
  const uint4 ra8_fixed = *reinterpret_cast<const uint4*>(&ring.ra[0][8 * t]);  // kRatiosInRegisters
#pragma unroll
  for (int s = 0; s < 2 * kGroupsPerFold; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) a[s][i] = 0x03020104u + i;

  for (int g = 0; g < groups; g += kGroupsPerFold) {
    const int slot = g & (kSlots - 1);
    if constexpr (!kSmemA && (kParts & kConvert) != 0) {
#pragma unroll
      for (int s = 0; s < kGroupsPerFold; ++s) convert(slot + s, a[2 * s], a[2 * s + 1]);
    }
#pragma unroll
    for (int s = 0; s < 2 * kGroupsPerFold; ++s) fence_operands(a[s]);
    fence_operands(d);
    if constexpr (kMma) {
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < kGroupsPerFold; ++s) {
        const uint32_t tile = act0 + (slot + s) * BM * kGroup;
        // Without the fold nothing reads a group's sums: accumulate across groups, or the compiler drops the
        // wgmma whose results the next group's fresh start would discard.
        const int fresh = (kParts & kFold) != 0 && s == 0 ? 0 : 1;
        if constexpr (kSmemA) {
          const uint32_t a_tile = a_tiles + (g & 1) * 64 * kGroup;
          if constexpr (BM == 256) {  // always (asserted); the other heights' d would not compile here
            wgmma_e4m3_ss(d, act_desc<64, 0>(a_tile, 0), act_desc<BM, kParts>(tile, 0), fresh);
            wgmma_e4m3_ss(d, act_desc<64, 0>(a_tile, 1), act_desc<BM, kParts>(tile, 1), 1);
          }
        } else if constexpr (kF32) {
          wgmma_e4m3_rs_f32(d, a[2 * s], act_desc<BM, kParts>(tile, 0), fresh);
          wgmma_e4m3_rs_f32(d, a[2 * s + 1], act_desc<BM, kParts>(tile, 1), 1);
        } else {
          wgmma_e4m3_rs(d, a[2 * s], act_desc<BM, kParts>(tile, 0), fresh);
          wgmma_e4m3_rs(d, a[2 * s + 1], act_desc<BM, kParts>(tile, 1), 1);
        }
      }
      wgmma_commit();
    }
    __half2 rw0 = {}, rw1 = {};
    float rw0f = 0.f, rw1f = 0.f;
    if constexpr ((kParts & kFold) != 0) {
      rw0f = ring.ws[slot][wrow0];
      rw1f = ring.ws[slot][wrow0 + 8];
      rw0 = __float2half2_rn(rw0f);
      rw1 = __float2half2_rn(rw1f);
    }
    if constexpr (kSmemA && (kParts & kConvert) != 0) {
      // The next group's A tile, while this group's wgmma reads the other one.
      uint32_t a0[4], a1[4];
      convert((g + 1) & (kSlots - 1), a0, a1);
      store_a((g + 1) & 1, a0, a1);
      fence_proxy_async();
    }
    if constexpr ((kParts & kCopies) != 0) {
      // Group g + 3 into the slot group g - 1 used (free since the barrier that ended iteration g - 1), then
      // this thread's copies of group g + 1 waited for and fenced for wgmma.
      refill((g + kSlots - 1) & (kSlots - 1), g + kSlots - 1);
      cp_async_commit();
      cp_async_wait<kSlots - 2>();
      fence_proxy_async();
    }
    if constexpr (kMma) {
      if constexpr ((kParts & kWait) != 0) {
        wgmma_wait_all();
      } else {
        wgmma_wait_one();
      }
    }
    fence_operands(d);
#pragma unroll
    for (int s = 0; s < 2 * kGroupsPerFold; ++s) fence_operands(a[s]);
    if constexpr ((kParts & kFold) != 0) {
#pragma unroll
      for (int p = 0; p < BM / 32; ++p) {
        if constexpr (kF32) {
          // The float ratios from the activation slot: their values do not matter to the timing.
          fold_f32(acc_h, d, p, reinterpret_cast<const float*>(&ring.act[slot][0]) + 256 * p + 8 * t, rw0f, rw1f);
        } else {
          const uint4 ra8 = (kParts & kRatiosInRegisters) != 0
                                ? ra8_fixed
                                : *reinterpret_cast<const uint4*>(&ring.ra[slot][32 * p + 8 * t]);
          if constexpr ((kParts & kFoldAlu) != 0) {
            fold_with(acc_h, d, p, ra8, __float_as_uint(rw0f), __float_as_uint(rw1f), bits_step);
          } else if constexpr ((kParts & kFoldFloat) != 0) {
            fold_with(acc_h, d, p, ra8, __float_as_uint(rw0f), __float_as_uint(rw1f), float_step);
          } else if constexpr ((kParts & kProductsKept) != 0) {
            // Weight scales changed in their last bits for each p (an integer op each), so that with the ratios
            // in registers no scale product repeats: all 64 HMUL2 a group, as from memory.
            const uint32_t k = 0x00010001u * p;
            fold_ratio_pairs(acc_h, d, p, ra8, as_half2(bits_of(rw0) ^ k), as_half2(bits_of(rw1) ^ k));
          } else {
            fold_ratio_pairs(acc_h, d, p, ra8, rw0, rw1);
          }
        }
      }
    }
    if constexpr ((kParts & kBarrier) != 0) __syncthreads();
  }
  if constexpr (kMma) wgmma_wait_all();
  fence_operands(d);
  uint32_t x = 0;
#pragma unroll
  for (int i = 0; i < kSumRegs; ++i) x ^= acc_h[i] ^ d[i];
  sink[blockIdx.x * kThreadsPerBlock + tid] = x;
}

// The raw loop's wgmma and the fold in separate warpgroups of one block (256-row tiles, 2 blocks per SM): the
// first warpgroup issues two wgmma a group (one group in flight), the second folds sums that no wgmma wrote, each
// on its own; kRoles 1 runs the first only, 2 the second only, 3 both; with 4 the fold is on float32 instructions
// (as kFoldFloat). If the SM could run a wgmma and other warps' fold side by side, both would take about as long as
// the slower alone.
template <int kRoles>
__global__ void __launch_bounds__(2 * kThreadsPerBlock, 2) side_by_side_kernel(int groups, Sources, uint32_t* sink) {
  constexpr int BM = 256;
  using RingT = Ring<BM, 0>;
  constexpr int kSlots = RingT::kSlots;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ring = *reinterpret_cast<RingT*>(smem_raw);
  const int wg = threadIdx.x / kThreadsPerBlock, tid = threadIdx.x % kThreadsPerBlock;
  const int lane = tid & 31, warp = tid >> 5, t = lane & 3;
  if (wg == 0) fill_operands(ring, tid);
  fence_proxy_async();
  __syncthreads();
  uint32_t x = 0;
  if ((kRoles & 1) != 0 && wg == 0) {
    const uint32_t act0 = smem_addr(&ring.act[0][0]);
    uint32_t d[BM / 4], a[2][4];
#pragma unroll
    for (int i = 0; i < BM / 4; ++i) d[i] = 0;
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) a[s][i] = 0x03020104u + i;
    for (int g = 0; g < groups; ++g) {
      const uint32_t tile = act0 + (g & (kSlots - 1)) * BM * kGroup;
      fence_operands(a[0]);
      fence_operands(a[1]);
      fence_operands(d);
      wgmma_fence();
      wgmma_e4m3_rs(d, a[0], act_desc<BM, 0>(tile, 0), 1);
      wgmma_e4m3_rs(d, a[1], act_desc<BM, 0>(tile, 1), 1);
      wgmma_commit();
      wgmma_wait_one();
    }
    wgmma_wait_all();
    fence_operands(d);
#pragma unroll
    for (int i = 0; i < BM / 4; ++i) x ^= d[i];
  }
  if ((kRoles & 2) != 0 && wg == 1) {
    const int wrow0 = warp * 16 + (lane >> 2);
    uint32_t d[BM / 4], acc_h[BM / 4];
#pragma unroll
    for (int i = 0; i < BM / 4; ++i) acc_h[i] = d[i] = 0;
    for (int g = 0; g < groups; ++g) {
      const int slot = g & (kSlots - 1);
      fence_operands(d);
      const float rw0 = ring.ws[slot][wrow0], rw1 = ring.ws[slot][wrow0 + 8];
#pragma unroll
      for (int p = 0; p < BM / 32; ++p) {
        const uint4 ra8 = *reinterpret_cast<const uint4*>(&ring.ra[slot][32 * p + 8 * t]);
        if constexpr ((kRoles & 4) != 0) {
          fold_with(acc_h, d, p, ra8, __float_as_uint(rw0), __float_as_uint(rw1), float_step);
        } else {
          fold_ratio_pairs(acc_h, d, p, ra8, __float2half2_rn(rw0), __float2half2_rn(rw1));
        }
      }
    }
#pragma unroll
    for (int i = 0; i < BM / 4; ++i) x ^= acc_h[i];
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = x;
}

// The two-weight-tile loop (see the top): raw (kParts 0), or with each group waited for and folded (kWait |
// kFold), its weights converted and a barrier ending it (| kConvert | kBarrier) as in loop_kernel.
template <int kParts>
__global__ void __launch_bounds__(kThreadsPerBlock, 3) two_tile_kernel(int groups, Sources, uint32_t* sink) {
  constexpr bool kFoldOn = (kParts & kFold) != 0;
  static_assert(kParts == 0 || (kParts & ~(kConvert | kBarrier)) == (kWait | kFold), "raw, or folded");
  constexpr int BM = 128;
  using RingT = Ring<BM, 0>;
  constexpr int kSlots = RingT::kSlots;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ring = *reinterpret_cast<RingT*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, t = lane & 3;
  fill_operands(ring, tid);
  fence_proxy_async();
  __syncthreads();
  const uint32_t act0 = smem_addr(&ring.act[0][0]);
  const int wrow0 = warp * 16 + (lane >> 2);
  uint32_t d[2][BM / 4], acc_h[2][BM / 4], a[4][4];
#pragma unroll
  for (int i = 0; i < BM / 4; ++i) d[0][i] = d[1][i] = acc_h[0][i] = acc_h[1][i] = 0;
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) a[s][i] = 0x03020104u + i + s;
  for (int g = 0; g < groups; ++g) {
    const int slot = g & (kSlots - 1);
    const uint32_t tile = act0 + slot * BM * kGroup;
    if constexpr ((kParts & kConvert) != 0) {
      // Each tile's packed weight record (the second tile's another warp's: its values do not matter to the timing).
#pragma unroll
      for (int w = 0; w < 2; ++w) unpack_record(ring.w[slot][tid ^ (64 * w)], a[2 * w], a[2 * w + 1]);
    }
#pragma unroll
    for (int s = 0; s < 4; ++s) fence_operands(a[s]);
    fence_operands(d[0]);
    fence_operands(d[1]);
    wgmma_fence();
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      wgmma_e4m3_rs(d[w], a[2 * w], act_desc<BM, 0>(tile, 0), kFoldOn ? 0 : 1);
      wgmma_e4m3_rs(d[w], a[2 * w + 1], act_desc<BM, 0>(tile, 1), 1);
    }
    wgmma_commit();
    if constexpr (kFoldOn) {
      // Each tile's two weight rows' scales (the second tile's read from other places of the 64-row slot).
      const __half2 rw[4] = {__float2half2_rn(ring.ws[slot][wrow0]), __float2half2_rn(ring.ws[slot][wrow0 + 8]),
                             __float2half2_rn(ring.ws[slot][wrow0 ^ 32]),
                             __float2half2_rn(ring.ws[slot][(wrow0 + 8) ^ 32])};
      wgmma_wait_all();
      fence_operands(d[0]);
      fence_operands(d[1]);
#pragma unroll
      for (int s = 0; s < 4; ++s) fence_operands(a[s]);
#pragma unroll
      for (int p = 0; p < BM / 32; ++p) {
        const uint4 ra8 = *reinterpret_cast<const uint4*>(&ring.ra[slot][32 * p + 8 * t]);
        fold_ratio_pairs(acc_h[0], d[0], p, ra8, rw[0], rw[1]);
        fold_ratio_pairs(acc_h[1], d[1], p, ra8, rw[2], rw[3]);
      }
    } else {
      wgmma_wait_one();
    }
    if constexpr ((kParts & kBarrier) != 0) __syncthreads();
  }
  wgmma_wait_all();
  fence_operands(d[0]);
  fence_operands(d[1]);
  uint32_t x = 0;
#pragma unroll
  for (int i = 0; i < BM / 4; ++i) x ^= acc_h[0][i] ^ acc_h[1][i] ^ d[0][i] ^ d[1][i];
  sink[blockIdx.x * kThreadsPerBlock + tid] = x;
}

// One wave of blocks that each walk 1024 groups, or `tiles` blocks of 16 groups (the qkv GEMM's at M = 8192:
// 2048), each block starting with its first stages' copies, as the GEMM's blocks do (no epilogue). The TOPS count
// one weight_rows x BM x 64 group a block and group.
template <int BM, int kBlocksPerSm>
void measure(const char* name, void (*kernel)(int, Sources, uint32_t*), int threads, size_t ring_bytes, int sms,
             const Sources& src, uint32_t* sink, double seconds, bool first, int tiles, int weight_rows = 64) {
  // Shared memory sized so that exactly kBlocksPerSm blocks fit an SM (228 KB, 1 KB reserved a block).
  const size_t smem = std::max(ring_bytes, static_cast<size_t>(228 * 1024 / kBlocksPerSm - 1024) / 1024 * 1024);
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int fit = 0;
  CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, threads, smem));
  cudaFuncAttributes attr;
  CHECK_CUDA(cudaFuncGetAttributes(&attr, kernel));
  const int groups = tiles ? 16 : 1024, blocks = tiles ? tiles : sms * kBlocksPerSm;
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<float> ms;
  const auto now = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  };
  double wall_start = 0;
  for (int rep = 0; rep < 25 || now() - wall_start < seconds; ++rep) {
    if (rep == 5) wall_start = now();
    CHECK_CUDA(cudaEventRecord(e0));
    kernel<<<blocks, threads, smem>>>(groups, src, sink);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
    if (rep >= 5) ms.push_back(t);  // the first launches warm up
  }
  const double wall_end = now();
  std::sort(ms.begin(), ms.end());
  const double median_us = 1000.0 * ms[ms.size() / 2];
  const double ops = 2.0 * weight_rows * BM * kGroup * static_cast<double>(groups) * blocks;
  // The qkv GEMM at M = 8192 is 32768 warpgroup-groups of 256-row tiles: its loop at this rate.
  const double qkv8192_us = 2.0 * 8192 * 4096 * 1024 / (ops / median_us);
  std::printf("%s    {\"parts\": \"%s\", \"bm\": %d, \"weight_rows\": %d, \"blocks_per_sm\": %d, \"blocks_fit\": %d, "
              "\"registers\": %d, \"groups_per_block\": %d, \"median_us\": %.2f, \"tops\": %.1f, "
              "\"qkv_m8192_loop_us\": %.2f, \"launches\": %zu, \"wall_start\": %.3f, \"wall_end\": %.3f}",
              first ? "" : ",\n", name, BM, weight_rows, kBlocksPerSm, fit, attr.numRegs, groups, median_us,
              ops / median_us / 1e6, qkv8192_us, ms.size(), wall_start, wall_end);
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
}

template <int BM, int kParts, int kBlocksPerSm>
void run(const char* name, int sms, const Sources& src, uint32_t* sink, double seconds, bool first, int tiles = 0) {
  measure<BM, kBlocksPerSm>(name, loop_kernel<BM, kParts, kBlocksPerSm>, kThreadsPerBlock, kSmemBytes<BM, kParts>,
                            sms, src, sink, seconds, first, tiles);
}

template <int kParts>
void run_two_tiles(const char* name, int sms, const Sources& src, uint32_t* sink, double seconds) {
  measure<128, 3>(name, two_tile_kernel<kParts>, kThreadsPerBlock, sizeof(Ring<128, 0>), sms, src, sink, seconds,
                  false, 0, 128);
}

template <int kRoles>
void run_side_by_side(const char* name, int sms, const Sources& src, uint32_t* sink, double seconds) {
  measure<256, 2>(name, side_by_side_kernel<kRoles>, 2 * kThreadsPerBlock, sizeof(Ring<256, 0>), sms, src, sink,
                  seconds, false, 0);
}

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 0.0;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  CHECK_CUDA(cudaDriverGetVersion(&driver));
  CHECK_CUDA(cudaRuntimeGetVersion(&runtime));
  const int sms = prop.multiProcessorCount;
  uint32_t* sink;
  CHECK_CUDA(cudaMalloc(&sink, sizeof(uint32_t) * std::max(sms * 4, 2048) * kThreadsPerBlock));
  // The +copies sources, filled with valid nonzero operands: activation bytes 3 (e4m3 3 * 2^-9), weight
  // nibbles 3 and 5, ratios 0x3030 (fp16 0.13), weight scales 0x3F3F3F3F (0.75).
  const size_t act_bytes = kSourceGroups * 256 * kGroup, w_bytes = kSourceTiles * kSourceGroups * 128 * 16;
  const size_t ra_bytes = kSourceGroups * 256 * 2, ws_bytes = kSourceTiles * kSourceGroups * 64 * 4;
  void *act, *w, *ra, *ws;
  CHECK_CUDA(cudaMalloc(&act, act_bytes));
  CHECK_CUDA(cudaMalloc(&w, w_bytes));
  CHECK_CUDA(cudaMalloc(&ra, ra_bytes));
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  CHECK_CUDA(cudaMemset(act, 0x03, act_bytes));
  CHECK_CUDA(cudaMemset(w, 0x35, w_bytes));
  CHECK_CUDA(cudaMemset(ra, 0x30, ra_bytes));
  CHECK_CUDA(cudaMemset(ws, 0x3F, ws_bytes));
  const Sources src{static_cast<const int8_t*>(act), static_cast<const int4*>(w), static_cast<const __half*>(ra),
                    static_cast<const float*>(ws)};
  std::printf("{\"gpu\": \"%s\", \"sms\": %d, \"cuda_driver\": %d, \"cuda_runtime\": %d,\n \"rows\": [\n", prop.name,
              sms, driver, runtime);
  constexpr int kLoop = kWait | kFold | kConvert | kBarrier;
  constexpr int kBlocksPerSmOf256 = 3;
  run<256, 0, 1>("raw", sms, src, sink, seconds, true);
  run<256, 0, 2>("raw", sms, src, sink, seconds, false);
  run<256, 0, 3>("raw", sms, src, sink, seconds, false);
  run<256, kSwizzle64, 3>("raw, swizzle 64", sms, src, sink, seconds, false);
  run<256, kWait, 3>("+wait", sms, src, sink, seconds, false);
  run<256, kWait | kFold, 3>("+wait +fold", sms, src, sink, seconds, false);
  run<256, kWait | kFold | kConvert, 3>("+wait +fold +convert", sms, src, sink, seconds, false);
  run<256, kLoop, 3>("+wait +fold +convert +barrier", sms, src, sink, seconds, false);
  run<256, kLoop | kSwizzle64, 3>("+wait +fold +convert +barrier, swizzle 64", sms, src, sink, seconds, false);
  run<256, kLoop | kFoldPer128, 3>("+wait +fold/128 +convert +barrier", sms, src, sink, seconds, false);
  run<256, kLoop, 2>("+wait +fold +convert +barrier", sms, src, sink, seconds, false);
  run<256, kWait | kBarrier | kCopies, 3>("+wait +barrier +copies", sms, src, sink, seconds, false);
  run<256, kLoop | kCopies, 3>("+wait +fold +convert +barrier +copies", sms, src, sink, seconds, false);
  run<256, kLoop | kCopies, 3>("+wait +fold +convert +barrier +copies, qkv M = 8192 grid", sms, src, sink, seconds,
                                false, 2048);
  // The same tiles less the last wave's partial 68 (5 whole waves of 396 on an H200): the tail's share.
  run<256, kLoop | kCopies, 3>("+wait +fold +convert +barrier +copies, 5 whole waves", sms, src, sink, seconds,
                                false, 5 * kBlocksPerSmOf256 * sms);
  // Why the fold costs what it does (256-row tiles).
  run<256, kWait | kFold | kNoMma, 3>("fold alone, no wgmma", sms, src, sink, seconds, false);
  run<256, kWait | kFold | kFoldFloat | kNoMma, 3>("fold alone in float32, no wgmma", sms, src, sink, seconds, false);
  run<256, kWait | kFold | kRatiosInRegisters | kNoMma, 3>("fold alone, ratios in registers, no wgmma", sms, src, sink,
                                                          seconds, false);
  run<256, kWait | kFold | kRatiosInRegisters, 3>("+wait +fold, ratios in registers", sms, src, sink, seconds, false);
  run<256, kWait | kFold | kRatiosInRegisters | kProductsKept | kNoMma, 3>(
      "fold alone, ratios in registers, all products, no wgmma", sms, src, sink, seconds, false);
  run<256, kWait | kFold | kRatiosInRegisters | kProductsKept, 3>("+wait +fold, ratios in registers, all products",
                                                                   sms, src, sink, seconds, false);
  run<256, kWait | kFold | kProductsKept, 3>("+wait +fold, scales changed per row block (control)", sms, src, sink,
                                             seconds, false);
  run<256, kWait | kFold | kFoldAlu | kNoMma, 3>("fold alone as bitwise ops, no wgmma", sms, src, sink, seconds, false);
  run<256, kWait | kFold | kFoldAlu, 3>("+wait +fold as bitwise ops", sms, src, sink, seconds, false);
  run<256, kWait | kFold, 1>("+wait +fold", sms, src, sink, seconds, false);
  run<256, kWait | kFold, 2>("+wait +fold", sms, src, sink, seconds, false);
  run<256, kWait | kFold | kFoldFloat, 3>("+wait +fold, fold in float32", sms, src, sink, seconds, false);
  run<256, kTwoSlots, 3>("raw, 2 slots", sms, src, sink, seconds, false);
  run<256, kASmem, 3>("raw, A smem", sms, src, sink, seconds, false);
  run<256, kWait | kFold | kTwoSlots, 3>("+wait +fold, 2 slots", sms, src, sink, seconds, false);
  run<256, kWait | kFold | kASmem, 3>("+wait +fold, A smem", sms, src, sink, seconds, false);
  run<256, kLoop | kTwoSlots, 3>("+wait +fold +convert +barrier, 2 slots", sms, src, sink, seconds, false);
  run<256, kLoop | kASmem, 3>("+wait +fold +convert +barrier, A smem", sms, src, sink, seconds, false);
  run_two_tiles<0>("two weight tiles a warpgroup (128 rows each): raw", sms, src, sink, seconds);
  run_two_tiles<kWait | kFold>("two weight tiles a warpgroup (128 rows each): +wait +fold", sms, src, sink, seconds);
  run_two_tiles<kLoop>("two weight tiles a warpgroup (128 rows each): +wait +fold +convert +barrier", sms, src, sink,
                       seconds);
  run_side_by_side<1>("side by side: the wgmma warpgroups alone", sms, src, sink, seconds);
  run_side_by_side<2>("side by side: the fold warpgroups alone", sms, src, sink, seconds);
  run_side_by_side<3>("side by side: both", sms, src, sink, seconds);
  run_side_by_side<2 | 4>("side by side: the fold warpgroups alone, float32", sms, src, sink, seconds);
  run_side_by_side<3 | 4>("side by side: both, fold in float32", sms, src, sink, seconds);
  run<128, 0, 3>("raw", sms, src, sink, seconds, false);
  run<128, kSumsF32, 3>("raw, float32 sums", sms, src, sink, seconds, false);
  run<128, kWait | kFold, 3>("+wait +fold", sms, src, sink, seconds, false);
  run<128, kWait | kFold | kSumsF32, 3>("+wait +fold, float32 sums", sms, src, sink, seconds, false);
  run<128, kWait | kFold | kNoMma, 3>("fold alone, no wgmma", sms, src, sink, seconds, false);
  run<128, kWait | kFold | kSumsF32 | kNoMma, 3>("fold alone, float32 sums, no wgmma", sms, src, sink, seconds, false);
  run<128, 0, 4>("raw", sms, src, sink, seconds, false);
  run<128, kWait | kFold, 4>("+wait +fold", sms, src, sink, seconds, false);
  run<128, kLoop, 4>("+wait +fold +convert +barrier", sms, src, sink, seconds, false);
  run<128, kLoop | kCopies, 4>("+wait +fold +convert +barrier +copies", sms, src, sink, seconds, false);
  std::printf("\n]}\n");
  CHECK_CUDA(cudaDeviceSynchronize());
  return 0;
}
