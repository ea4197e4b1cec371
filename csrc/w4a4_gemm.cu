// Kernel 2: W4A4 GEMM on Hopper's warpgroup FP8 tensor cores (wgmma e4m3, sm_90a: exact on these integer
// operands, csrc/w4a4_common.cuh) with per-group scaling in fp16 pairs and the low-rank up-projection fused
// into the epilogue; one write of the output.
//
// Roles: the weights are wgmma's A operand (registers), the activations its B operand (shared memory), so
// the block computes a transposed tile acc[n, m] (64 weight rows x BM activation rows, BM = 64, 128 or 256)
// and transposes it through shared memory on the way out. One warpgroup (128 threads) per block, 3 or 4
// blocks per SM; the blocks interleave, so one block's float work runs while another's wgmma uses the
// tensor cores. On grids too small for that (at most one 64-row tile per SM) a block has kSplit warpgroups
// instead, each walking its own contiguous range of K groups through its own ring; the first adds the
// others' sums and runs the epilogue alone (docs/kernels.md, The GEMM).
//
// Per 64-wide K group (kStages-deep cp.async ring of the operands and their scales):
//   1. the activation tile arrives as the quantize kernel wrote it, e4m3 bytes in wgmma's canonical
//      K-major layout (csrc/w4a4_common.cuh), and wgmma reads it from the ring slot as it is;
//   2. each warp turns its 16 packed 4-bit weight rows straight into e4m3 A-fragment registers (a mask, a
//      shift and a multiply-add per 4 bytes);
//   3. two wgmma m64nBMk32 (k 0..31, then k 32..63) give fp16 sums dot * 2^-18 (exact while |dot| <= 2048,
//      and fp16 keeps the subnormals of |dot| < 16);
//   4. one instruction per output (two per output pair) folds the group into fp16 accumulators, in
//      scales relative to the row's largest, so the sums stay inside fp16's range (below 2^15):
//        s = ra[m] * rw[n]     ra = ascale / amax_row in [0, 1] (the quantize kernel's),
//                              rw = wscale / wmax_row * 2^15 (kernel_weight_scales)
//        acc = fma(dot * 2^-18, s, acc)                      (half2: two outputs of one weight row)
//      Half the fold of float32 accumulators, and half their registers (docs/kernels.md, Numerics).
// Epilogue: acc * amax_row[m] * 8 wmax_row[n] + bias in float32 (the weights' row factors are the last row
// of their scale tensor, [K/64 + 1, N_pad]), + proj_up[n, :] . lora[m, :] on tf32 mma.sync (its C fragment
// matches wgmma's D layout), cast, transpose through shared memory (stmatrix), 16-byte stores of rows < M. A
// grouped GEMM (layers that read one input, weights stacked along N) gives each layer's 64-row weight tiles
// that layer's R low-rank columns of lora. Two other epilogues: kSwiGlu takes gate and up rows interleaved 8 by
// 8 (engine/kernels/w4a4.py swiglu_row_order), so that each thread holds a gate output and its up output, and
// writes silu(gate) * up: half the output, and no silu_mul kernel after it; kAddResidual writes
// T(residual + T(y)), torch's rounding of `residual + linear(x)`, and no add kernel runs after it.
#include "w4a4_common.cuh"
#include "w4a4_launch.h"
#include "wgmma.cuh"

#include <climits>
#include <cstddef>

namespace w4a4 {
namespace {

// Tuning knob (OVBATCH_KERNEL_DEFINES): ring depth.
#ifndef W4A4_GEMM_STAGES
#define W4A4_GEMM_STAGES 4
#endif
constexpr int kStages = W4A4_GEMM_STAGES;
static_assert((kStages & (kStages - 1)) == 0, "stage count must be a power of two");
// Tuning knob: blocks per SM of the 128-row tiles (their register budget).
#ifndef W4A4_GEMM_BIG_TILE_BLOCKS
#define W4A4_GEMM_BIG_TILE_BLOCKS 4
#endif
// Tuning knob: 128-row activation tiles from this many such blocks per SM up (64-row tiles below).
#ifndef W4A4_GEMM_BIG_TILES_FROM
#define W4A4_GEMM_BIG_TILES_FROM 1
#endif
// Tuning knob: 256-row activation tiles from this many such blocks per SM up (3: the fastest of 1, 3 and 6).
#ifndef W4A4_GEMM_HUGE_TILES_FROM
#define W4A4_GEMM_HUGE_TILES_FROM 3
#endif
// Tuning knob: warpgroups per block, each on a range of K groups, where 64-row tiles leave SMs without a block.
#ifndef W4A4_GEMM_K_SPLIT
#define W4A4_GEMM_K_SPLIT 4
#endif
constexpr int kSmallGridSplit = W4A4_GEMM_K_SPLIT;
constexpr int kMinGroupsPerSplit = 4;  // fewer K groups than this per warpgroup: no split

constexpr int kThreads = 128;  // one warpgroup: the threads that copy, fold and run the epilogue
constexpr int kTileN = 64;     // weight rows per block: wgmma's M

// Per activation-tile height BM (wgmma's N). Taller tiles spread each weight conversion and scale load
// over more outputs; shorter ones (fewer registers, more blocks) win on small grids.
template <int BM>
struct Tile {
  static_assert(BM == 64 || BM == 128 || BM == 256, "activation tiles of 64, 128 or 256 rows");
  static_assert(kMPad % BM == 0, "padded activations hold whole tiles");
  static constexpr int kMinBlocks = BM == 64 ? 4 : BM == 128 ? W4A4_GEMM_BIG_TILE_BLOCKS : 3;  // register budget
  // The e4m3 activation tile, K-major in wgmma's canonical no-swizzle layout: 8 x 16-byte core matrices,
  // byte (m, k) at (k / 16) * kCoreK + (m / 8) * kCoreM + (m % 8) * 16 + k % 16.
  static constexpr int kCoreK = BM * 16;  // bytes between core matrices adjacent in K (leading byte offset)
  static constexpr int kCoreM = 128;      // bytes between core matrices adjacent in M (stride byte offset)
  static constexpr int kActChunksPerThread = BM * kGroup / 16 / kThreads;  // 16-byte copies a stage

  struct RawStage {
    alignas(128) int8_t act[BM * kGroup];  // e4m3 activations, wgmma's layout: the B operand
    int4 w[kTileN / 16 * 32];  // packed 4-bit weights in A-fragment layout: one 16-byte record per lane
    __half ra[BM];     // ascale / amax_row
    float ws[kTileN];  // rw: fp16 values in float32
  };

  // What the epilogue reads besides the accumulators: the block's low-rank activations lora_tile[BM][R + 8]
  // (padded rows: a warp's 8-byte fragment loads fall in distinct banks), amax_row of its activation rows
  // (activation_scale_position order), and the weight tile's proj_up rows pu_tile[64][R + 4] (padded likewise).
  // Blocks of 128 rows and more (3-4 per SM, the others hide the wait) copy the first two after the K loop into
  // the free ring, where the output tile later overwrites them; 64-row blocks (small grids, often one per SM)
  // copy them at the start, behind the first stages, into their own space after the ring (not ahead of them:
  // the first group's copies would wait).
  // Every block copies proj_up at the start into its own space too, except 256-row blocks, whose rings fill the
  // SM's shared memory: they copy it after the loop with the others (read from global memory right before
  // the low-rank MMAs before, its latency was on every block's path).
  static constexpr bool kEpilogueDataAfterLoop = BM >= 128;
  static constexpr bool kProjUpAfterLoop = BM == 256;
  template <int R, typename OutT, int kSplit>
  struct SmemLayout {
    static_assert(kSplit == 1 || !kEpilogueDataAfterLoop, "split K only on 64-row tiles");
    static constexpr size_t kRing = sizeof(RawStage) * kStages * kSplit;  // one ring per warpgroup
    static constexpr size_t kLora = sizeof(float) * BM * (R + 8), kAmax = sizeof(float) * BM;
    static constexpr size_t kProjUp = sizeof(float) * kTileN * (R + 4);
    // The ring after the loop: lora_tile, amax_row (where copied after the loop), then pu_tile (likewise).
    // The block's own space after the ring: pu_tile, lora_tile and amax_row, those copied at the start.
    static constexpr size_t kOwn = kRing + (kProjUpAfterLoop ? 0 : kProjUp);
    static constexpr size_t kLoraOffset = kEpilogueDataAfterLoop ? 0 : kOwn;
    static constexpr size_t kAmaxOffset = kLoraOffset + kLora;
    static constexpr size_t kProjUpOffset = kProjUpAfterLoop ? kAmaxOffset + kAmax : kRing;
    static constexpr size_t kBytes = kEpilogueDataAfterLoop ? kOwn : kAmaxOffset + kAmax;
    static_assert(sizeof(OutT) * BM * (kTileN + 8) <= kRing, "the ring holds the output tile");
    static_assert(!kEpilogueDataAfterLoop || kLora + kAmax + (kProjUpAfterLoop ? kProjUp : 0) <= kRing,
                  "and what is copied into it after the loop");
  };

  // Shared-memory matrix descriptor, no swizzle: start, leading (K) and stride (M/N) byte offsets, >> 4.
  static __device__ __forceinline__ uint64_t desc(uint32_t addr) {
    return static_cast<uint64_t>((addr >> 4) & 0x3FFF) | (static_cast<uint64_t>(kCoreK >> 4) << 16) |
           (static_cast<uint64_t>(kCoreM >> 4) << 32);
  }
};

// The value, opaque to the compiler: it stays in a register instead of being recomputed wherever it is used
// (from threadIdx: a long-latency S2R; or reloaded from the kernel's parameters in constant memory).
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
  asm volatile("" : "+r"(v));
  return v;
}

// The V at byte `offset` of shared-memory object `base`.
template <typename V>
__device__ __forceinline__ const V& at_offset(const void* base, uint32_t offset) {
  return *reinterpret_cast<const V*>(static_cast<const unsigned char*>(base) + offset);
}


// Four 8x8 b16 matrices (register i of each lane: row lane / 4, columns 2 (lane % 4) and the next) stored
// transposed: row c of matrix i (its column c) at the 16 bytes that lane 8i + c addresses.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

template <typename OutT>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  const OutT v[2] = {from_float<OutT>(lo), from_float<OutT>(hi)};
  return *reinterpret_cast<const uint32_t*>(v);
}

// 8 elements of a + b, each T(float(a) + float(b)) as torch adds two bf16/fp16 tensors.
template <typename OutT>
__device__ __forceinline__ int4 add_pieces(int4 a, int4 b) {
  const OutT* x = reinterpret_cast<const OutT*>(&a);
  const OutT* y = reinterpret_cast<const OutT*>(&b);
  int4 sum;
  OutT* out = reinterpret_cast<OutT*>(&sum);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = from_float<OutT>(to_float<OutT>(x[i]) + to_float<OutT>(y[i]));
  return sum;
}

// silu(g) * u in float32 with one rounding at the end (torch rounds g, u and silu(g) to the output dtype as
// well): __expf and __fdividef, a few ulp of float32 each, far below the output's rounding.
__device__ __forceinline__ float silu_times(float g, float u) { return __fdividef(g, 1.0f + __expf(-g)) * u; }

enum class Epilogue { kStore, kSwiGlu, kAddResidual };

template <int BM, int R, typename OutT, int kSplit, Epilogue E>
__global__ void __launch_bounds__(kThreads * kSplit, Tile<BM>::kMinBlocks / kSplit)
    w4a4_gemm_lora_up_kernel(const int8_t* __restrict__ qact, const __half* __restrict__ aratios,
                             const float* __restrict__ amax_rows,
                             const int4* __restrict__ qweight, const float* __restrict__ wscales,
                             const float* __restrict__ lora, const float* __restrict__ proj_up,
                             const float* __restrict__ bias, const OutT* __restrict__ residual,
                             OutT* __restrict__ y, int M, int M_pad, int N,
                             int N_pad, int K, int lora_ld, int2 segment_start) {
  using T = Tile<BM>;
  using RawStage = typename T::RawStage;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  using Layout = typename T::template SmemLayout<R, OutT, kSplit>;
  constexpr uint32_t kWarpgroupRing = sizeof(RawStage) * kStages;
  const int wg = kSplit == 1 ? 0 : threadIdx.x / kThreads;  // this thread's warpgroup
  auto& ring_s = *reinterpret_cast<RawStage(*)[kStages]>(smem_raw + wg * kWarpgroupRing);
  auto& lora_tile = *reinterpret_cast<float(*)[BM][R + 8]>(smem_raw + Layout::kLoraOffset);
  const float* amax_s = reinterpret_cast<const float*>(smem_raw + Layout::kAmaxOffset);
  auto& pu_tile = *reinterpret_cast<float(*)[kTileN][R + 4]>(smem_raw + Layout::kProjUpOffset);

  const int G = K / kGroup;
  // This warpgroup's K groups: g_begin .. g_begin + Gw - 1.
  const int g_begin = wg * G / kSplit, Gw = (wg + 1) * G / kSplit - g_begin;
  const int n0 = blockIdx.x * kTileN, m0 = blockIdx.y * BM;
  const int tid = kSplit == 1 ? threadIdx.x : threadIdx.x % kThreads, lane = tid & 31, warp = tid >> 5;
  const int gr = lane >> 2, t = lane & 3;
  // A barrier of this warpgroup's threads (the whole block when it is one warpgroup).
  auto warpgroup_sync = [&] {
    if constexpr (kSplit == 1) {
      __syncthreads();
    } else {
      asm volatile("bar.sync %0, %1;\n" ::"r"(1 + wg), "n"(kThreads) : "memory");
    }
  };

  // Static copy plan: 16-byte activation chunks tid + 128 h (chunk j of the stage's tile is its row j % BM
  // of k chunk j / BM, which lies in the 128-row tile of global memory at (j / BM) * 2048 + 16 * row: the
  // thread's first chunk plus h times a constant, so one pointer and immediate offsets address them; a
  // 256-row tile reads two 128-row tiles, odd h the second, through a second pointer), weight
  // record tid (this warp's own fragment tile), and for the first BM/8 + 16 threads one 16-byte piece of
  // the scales (activation scale ratios, then weight scales, which land back to back in the stage). Stages
  // are loaded in group order, so the sources just advance.
  static_assert(offsetof(RawStage, ws) == offsetof(RawStage, ra) + sizeof(__half) * BM, "scales adjoin");
  static_assert(kThreads % BM == 0 || BM == 2 * kThreads, "chunk tid + 128 h is chunk tid's row, k chunks further");
  constexpr int kActHalves = BM > kActBlockRows ? BM / kActBlockRows : 1;  // 128-row global tiles per stage
  constexpr int kActChunkStride = kThreads * kActHalves / BM * kActChunkBytes;  // global bytes, h to h + kActHalves
  const int8_t* act_src[kActHalves];
  act_src[0] = qact + (static_cast<int64_t>(m0 / kActBlockRows) * G + g_begin) * kActTileBytes +
               (m0 % kActBlockRows) * 16 + (tid * kActHalves / BM) * kActChunkBytes + (tid % BM) * 16;
  for (int i = 1; i < kActHalves; ++i) act_src[i] = act_src[i - 1] + static_cast<int64_t>(G) * kActTileBytes;
  const int4* w_src = qweight + (static_cast<int64_t>(n0 / 16 + warp) * G + g_begin) * 32 + lane;
  const bool act_scales = tid < BM / 8;
  // Opaque, so each refill does not re-read threadIdx (S2R) and the stride from constant memory (ncu stalls).
  const bool copies_scales = opaque(tid < BM / 8 + kTileN / 4);
  const char* s_src = act_scales ? reinterpret_cast<const char*>(aratios + m0 + 8 * tid)
                                 : reinterpret_cast<const char*>(wscales + n0 + 4 * (tid - BM / 8));
  const int s_stride = static_cast<int>(opaque(act_scales ? sizeof(__half) * M_pad : sizeof(float) * N_pad));
  s_src += static_cast<int64_t>(g_begin) * s_stride;
  const uint32_t ring = smem_addr(ring_s);
  const int wrow0 = warp * 16 + gr;  // this thread's weight rows: wrow0 and wrow0 + 8
  // Byte offsets of this thread's pieces of a ring slot: its 16-byte copy, its weights' scales, its
  // activation rows' scale ratios.
  const uint32_t thr16 = opaque(16 * tid), ws_off = opaque(sizeof(float) * wrow0), ra_off = opaque(16 * t);

  auto load_next_stage = [&](int g) {
    const uint32_t slot = ring + (g & (kStages - 1)) * static_cast<uint32_t>(sizeof(RawStage)) + thr16;
#pragma unroll
    for (int h = 0; h < T::kActChunksPerThread; ++h)
      cp_async_16(slot + offsetof(RawStage, act) + 16 * kThreads * h,
                  act_src[h % kActHalves] + h / kActHalves * kActChunkStride);
    cp_async_16(slot + offsetof(RawStage, w), w_src);
    if (copies_scales) cp_async_16(slot + offsetof(RawStage, ra), s_src);
#pragma unroll
    for (int i = 0; i < kActHalves; ++i) act_src[i] += kActTileBytes;
    w_src += 32;
    s_src += s_stride;
  };

  // What the epilogue reads: the block's low-rank activations (its segment's R columns) and amax_row; the
  // weight tile's proj_up rows. Each thread copies one 16-byte piece of every kPieceRowsPerPass-th row.
  constexpr int kPiecesPerRow = R / 4, kPieceRowsPerPass = kThreads / kPiecesPerRow;
  static_assert(kThreads % kPiecesPerRow == 0 && BM % kPieceRowsPerPass == 0 && kTileN % kPieceRowsPerPass == 0,
                "whole rows per pass");
  auto copy_epilogue_data = [&] {
    const int segment = (n0 >= segment_start.x) + (n0 >= segment_start.y);
    const int row = tid / kPiecesPerRow, col = 4 * (tid % kPiecesPerRow);
    const float* src = lora + static_cast<int64_t>(m0 + row) * lora_ld + segment * R + col;
    const int64_t src_step = static_cast<int64_t>(kPieceRowsPerPass) * lora_ld;
    const uint32_t dst = smem_addr(&lora_tile[row][col]);
#pragma unroll
    for (int i = 0; i < BM / kPieceRowsPerPass; ++i, src += src_step)
      cp_async_16(dst + i * kPieceRowsPerPass * (R + 8) * sizeof(float), src);
    if (tid < BM / 4) cp_async_16(smem_addr(amax_s) + 16 * tid, amax_rows + m0 + 4 * tid);
  };
  auto copy_proj_up = [&] {
    const int row = tid / kPiecesPerRow, col = 4 * (tid % kPiecesPerRow);
#pragma unroll
    for (int i = 0; i < kTileN / kPieceRowsPerPass; ++i)
      cp_async_16(smem_addr(&pu_tile[row + i * kPieceRowsPerPass][col]),
                  proj_up + static_cast<int64_t>(n0 + row + i * kPieceRowsPerPass) * R + col);
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < Gw) load_next_stage(s);
    cp_async_commit();
  }
  // Committed with the first refill, waited for after the loop.
  if (!T::kEpilogueDataAfterLoop && wg == 0) copy_epilogue_data();
  if (!T::kProjUpAfterLoop && wg == 0) copy_proj_up();
  // The residual rows the epilogue adds (one 128-byte line each) are fetched into L2 now, so that the
  // epilogue's loads of them wait for L2 rather than memory.
  if constexpr (E == Epilogue::kAddResidual) {
    for (int r = tid; wg == 0 && r < BM && m0 + r < M; r += kThreads)
      asm volatile("prefetch.global.L2 [%0];\n" ::"l"(residual + static_cast<int64_t>(m0 + r) * N + n0));
  }

  uint32_t acc_h[BM / 4];  // half2 accumulators, d's layout
#pragma unroll
  for (int i = 0; i < BM / 4; ++i) acc_h[i] = 0;
  uint32_t d[BM / 4];

  // Software pipeline, one barrier per group: group g's wgmma runs while the copies of later groups land,
  // then group g is folded. Each thread waits for its own copies of group g + 1 and fences them for the
  // async proxy (wgmma reads shared memory through it); the barrier that ends iteration g publishes them
  // to the whole block and frees the ring slot that iteration g + 1 refills.
  cp_async_wait<kStages - 2>();
  fence_proxy_async();
  // This thread's packed weight record of the next group.
  int4 wrec = at_offset<int4>(ring_s[0].w, thr16);
  warpgroup_sync();

  for (int g = 0; g < Gw; ++g) {
    const RawStage& s = ring_s[g & (kStages - 1)];
    // This warp's weight rows straight into A fragments (k-step 0: low nibbles, k-step 1: high).
    const uint32_t wv[4] = {static_cast<uint32_t>(wrec.x), static_cast<uint32_t>(wrec.y),
                            static_cast<uint32_t>(wrec.z), static_cast<uint32_t>(wrec.w)};
    uint32_t a0[4], a1[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a0[i] = e4m3_from_code(wv[i]);
      a1[i] = e4m3_from_code(wv[i] >> 4);
    }
    const uint32_t tile = ring + (g & (kStages - 1)) * static_cast<uint32_t>(sizeof(RawStage)) +
                          static_cast<uint32_t>(offsetof(RawStage, act));
    fence_operands(a0);
    fence_operands(a1);
    fence_operands(d);
    wgmma_fence();
    wgmma_e4m3_rs(d, a0, T::desc(tile), 0);
    wgmma_e4m3_rs(d, a1, T::desc(tile + 2 * T::kCoreK), 1);
    wgmma_commit();
    // The weight scales are read before the refill's copies are issued: a shared-memory load issued after
    // them may have to wait until they have read their address registers (ncu: long-scoreboard stalls).
    const __half2 rw0 = __float2half2_rn(at_offset<float>(s.ws, ws_off)),
                  rw1 = __float2half2_rn(at_offset<float>(s.ws, ws_off + 8 * sizeof(float)));
    // So are the 64-row tiles' first activation scale ratios: read after the wgmma wait, the first HMUL2 of
    // the fold waited for them (ncu). The taller tiles measured up to 3.5% slower with it (docs/kernels.md,
    // "Tried and not kept").
    constexpr bool kEarlyRatios = BM == 64;
    const uint4 ra8_first = kEarlyRatios ? at_offset<uint4>(s.ra, ra_off) : uint4{};

    if (g + kStages - 1 < Gw) load_next_stage(g + kStages - 1);
    cp_async_commit();
    if (g + 1 < Gw) {
      cp_async_wait<kStages - 2>();
      fence_proxy_async();
      wrec = at_offset<int4>(ring_s[(g + 1) & (kStages - 1)].w, thr16);
    }

    wgmma_wait_all();
    fence_operands(d);
    fence_operands(a0);
    fence_operands(a1);

    // Fold: d[2j + h] is weight row wrow0 + 8h, activation rows 8j + 2t and 8j + 2t + 1. The ratios of this
    // thread's activation rows in j = 4p .. 4p + 3 lie side by side (activation_scale_position).
#pragma unroll
    for (int p = 0; p < BM / 32; ++p) {
      const uint4 ra8 = kEarlyRatios && p == 0 ? ra8_first : at_offset<uint4>(s.ra, ra_off + 32 * sizeof(__half) * p);
      fold_ratio_pairs(acc_h, d, p, ra8, rw0, rw1);
    }
    warpgroup_sync();
  }
  if (T::kEpilogueDataAfterLoop) {
    cp_async_wait<0>();
    __syncthreads();  // the ring is free
    copy_epilogue_data();
    if (T::kProjUpAfterLoop) copy_proj_up();
    cp_async_commit();
  }
  cp_async_wait<0>();
  __syncthreads();
  // The other warpgroups hand their fp16 sums to the first through their rings, now idle, and are done.
  auto partial_sums = [&](int w) -> uint32_t(&)[BM / 4][kThreads] {
    return *reinterpret_cast<uint32_t(*)[BM / 4][kThreads]>(smem_raw + w * kWarpgroupRing);
  };
  if constexpr (kSplit > 1) {
    static_assert(sizeof(uint32_t) * BM / 4 * kThreads <= kWarpgroupRing, "a ring holds a warpgroup's sums");
    if (wg > 0) {
#pragma unroll
      for (int i = 0; i < BM / 4; ++i) partial_sums(wg)[i][tid] = acc_h[i];
    }
    __syncthreads();
    if (wg > 0) return;
  }
  // The block's sums of accumulator pair i in float32, the warpgroups' added in order.
  auto group_sums = [&](int i) {
    float2 v = __half22float2(as_half2(acc_h[i]));
#pragma unroll
    for (int w = 1; w < kSplit; ++w) {
      const float2 p = __half22float2(as_half2(partial_sums(w)[i][tid]));
      v.x += p.x;
      v.y += p.y;
    }
    return v;
  };

  // acc[4j + 2h + c] (weight row wrow0 + 8h, activation row 8j + 2t + c) in float32, the row factors and the
  // bias applied.
  float acc[BM / 2];
  {
    const float* wmax8 = wscales + static_cast<int64_t>(G) * N_pad + n0 + wrow0;
    const float w8[2] = {wmax8[0], wmax8[8]};
    float b[2] = {0.f, 0.f};
    if (bias != nullptr) {
      b[0] = bias[n0 + wrow0];
      b[1] = bias[n0 + wrow0 + 8];
    }
#pragma unroll
    for (int p = 0; p < BM / 16; ++p) {  // thread t's 8 floats of every 32 rows: j = 2p, 2p + 1 in one half
      const float4 a4 = at_offset<float4>(amax_s, ra_off * 2 + sizeof(float) * (32 * (p / 2) + 4 * (p % 2)));
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float a[2] = {half ? a4.z : a4.x, half ? a4.w : a4.y};
        const int j = 2 * p + half;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float2 v = group_sums(2 * j + h);
          acc[4 * j + 2 * h] = fmaf(v.x, a[0] * w8[h], b[h]);
          acc[4 * j + 2 * h + 1] = fmaf(v.y, a[1] * w8[h], b[h]);
        }
      }
    }
  }

  // Low-rank up-projection: acc[n, m] += proj_up[n, :] . lora[m, :] (tf32 MMA, float32 accumulation).
  const float* pu0 = &pu_tile[wrow0][t];
  const float* pu1 = &pu_tile[wrow0 + 8][t];
#pragma unroll
  for (int ks = 0; ks < R / 8; ++ks) {
    const uint32_t a[4] = {to_tf32(pu0[8 * ks]), to_tf32(pu1[8 * ks]), to_tf32(pu0[8 * ks + 4]),
                           to_tf32(pu1[8 * ks + 4])};
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const uint2 b = *reinterpret_cast<const uint2*>(&lora_tile[8 * j + gr][lora_position(8 * ks + t)]);
      float(&c)[4] = *reinterpret_cast<float(*)[4]>(&acc[4 * j]);
      mma_tf32_1688(c, a, b.x, b.y);
    }
  }

  // Transpose through shared memory (the ring), once every warp is done with the low-rank activations:
  // ytile[m][n]. The 8 x 8 blocks of the warp's outputs are matrices of stmatrix's fragment layout (row n,
  // columns m); stored transposed, their rows are 8 outputs of one activation row, 16 bytes.
  if (T::kEpilogueDataAfterLoop) __syncthreads();
  OutT* ytile = reinterpret_cast<OutT*>(ring_s);
  constexpr bool kSwiGlu = E == Epilogue::kSwiGlu;
  constexpr int kOutN = kSwiGlu ? kTileN / 2 : kTileN;  // output columns of the block
  constexpr int kOutStride = kOutN + 8;                 // ytile's rows, padded by 8 elements
  if constexpr (kSwiGlu) {
    // Weight rows wrow0 and wrow0 + 8 are the gate and up rows of output column 8 warp + gr of the block's 32.
    // Matrix q of step p is activation rows 8 (4p + q) ..: lane l addresses row l % 8 of matrix l / 8.
    const uint32_t ytile_lane = smem_addr(ytile + (8 * (lane / 8) + lane % 8) * kOutStride + warp * 8);
#pragma unroll
    for (int p = 0; p < BM / 32; ++p) {
      uint32_t r[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float* a = &acc[4 * (4 * p + q)];  // gate: a[0], a[1]; up: a[2], a[3]
        r[q] = pack_pair<OutT>(silu_times(a[0], a[2]), silu_times(a[1], a[3]));
      }
      stmatrix_x4_trans(ytile_lane + 32 * p * kOutStride * sizeof(OutT), r[0], r[1], r[2], r[3]);
    }
  } else {
    // Blocks (j, h): lane l addresses row l % 8 of block (2p + l / 16, l / 8 % 2).
    const uint32_t ytile_lane =
        smem_addr(ytile + (8 * (lane / 16) + lane % 8) * kOutStride + warp * 16 + 8 * (lane / 8 % 2));
#pragma unroll
    for (int p = 0; p < BM / 16; ++p) {
      const float* a = &acc[8 * p];  // j = 2p: a[0..3], j = 2p + 1: a[4..7]; in each, h = 0 then h = 1
      stmatrix_x4_trans(ytile_lane + 16 * p * kOutStride * sizeof(OutT), pack_pair<OutT>(a[0], a[1]),
                        pack_pair<OutT>(a[2], a[3]), pack_pair<OutT>(a[4], a[5]), pack_pair<OutT>(a[6], a[7]));
    }
  }
  warpgroup_sync();
  // Each thread copies 16-byte piece tid % kChunksPerRow of every kRowsPerPass-th row (adding the residual's).
  constexpr int kChunksPerRow = kOutN * sizeof(OutT) / 16, kRowsPerPass = kThreads / kChunksPerRow;
  const int out_ld = kSwiGlu ? N / 2 : N;
  const int row = tid / kChunksPerRow, col = (tid % kChunksPerRow) * (16 / sizeof(OutT));
  const int64_t offset = static_cast<int64_t>(m0 + row) * out_ld + (kSwiGlu ? n0 / 2 : n0) + col;
  OutT* dst = y + offset;
  const int64_t dst_step = static_cast<int64_t>(kRowsPerPass) * out_ld;
#pragma unroll
  for (int i = 0; i < BM / kRowsPerPass; ++i, dst += dst_step)
    if (m0 + row + i * kRowsPerPass < M) {
      int4 piece = *reinterpret_cast<const int4*>(&ytile[(row + i * kRowsPerPass) * kOutStride + col]);
      if constexpr (E == Epilogue::kAddResidual)
        piece = add_pieces<OutT>(*reinterpret_cast<const int4*>(residual + offset + i * dst_step), piece);
      *reinterpret_cast<int4*>(dst) = piece;
    }
}

template <int BM, int R, typename OutT, Epilogue E, int kSplit = 1>
cudaError_t launch_tile(const GemmArgs& a, cudaStream_t stream) {
  const size_t smem = Tile<BM>::template SmemLayout<R, OutT, kSplit>::kBytes;
  auto kernel = w4a4_gemm_lora_up_kernel<BM, R, OutT, kSplit, E>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid(a.N / kTileN, (a.M + BM - 1) / BM);
  static_assert(kMaxSegments == 3, "segment starts travel as one int2");
  int starts[kMaxSegments - 1];
  for (int s = 0; s < kMaxSegments - 1; ++s) starts[s] = s + 1 < a.segments ? a.segment_start[s] : INT_MAX;
  kernel<<<grid, kThreads * kSplit, smem, stream>>>(
      static_cast<const int8_t*>(a.qact), static_cast<const __half*>(a.aratios), a.amax,
      static_cast<const int4*>(a.qweight),
      a.wscales, a.lora, a.proj_up, a.bias, static_cast<const OutT*>(a.residual), static_cast<OutT*>(a.y), a.M,
      a.M_pad, a.N, a.N_pad, a.K, a.lora_ld, make_int2(starts[0], starts[1]));
  return cudaGetLastError();
}

// Activation-tile height and warpgroups per block for an M x N x K GEMM on `sms` SMs.
struct GemmPlan {
  int bm, k_split;
};

GemmPlan plan_gemm(int M, int N, int K, int sms) {
  const int huge_tiles = (N / kTileN) * ((M + 255) / 256), big_tiles = (N / kTileN) * ((M + 127) / 128);
  if (huge_tiles >= W4A4_GEMM_HUGE_TILES_FROM * sms) return {256, 1};
  if (big_tiles >= W4A4_GEMM_BIG_TILES_FROM * sms) return {128, 1};
  // Split where the grid has at most one block per SM (at two per SM, 4 warpgroups measured 5-17% slower and 2
  // within 3% of one).
  const int small_tiles = (N / kTileN) * ((M + 63) / 64);
  const bool split = small_tiles <= sms && K / kGroup >= kMinGroupsPerSplit * kSmallGridSplit;
  return {64, split ? kSmallGridSplit : 1};
}

template <int R, typename OutT, Epilogue E>
cudaError_t launch_typed(const GemmArgs& a, cudaStream_t stream) {
  int sms = 0;
  const cudaError_t err = sm_count(&sms);
  if (err != cudaSuccess) return err;
  const GemmPlan plan = plan_gemm(a.M, a.N, a.K, sms);
  if (plan.bm == 256) return launch_tile<256, R, OutT, E>(a, stream);
  if (plan.bm == 128) return launch_tile<128, R, OutT, E>(a, stream);
  return plan.k_split == 1 ? launch_tile<64, R, OutT, E>(a, stream)
                           : launch_tile<64, R, OutT, E, kSmallGridSplit>(a, stream);
}

template <typename OutT, Epilogue E>
cudaError_t launch_rank(const GemmArgs& a, cudaStream_t stream) {
  if (a.R == 16) return launch_typed<16, OutT, E>(a, stream);
  if (a.R == 32) return launch_typed<32, OutT, E>(a, stream);
  return cudaErrorInvalidValue;
}

// The SwiGLU epilogue only at R = 32: two rank-16 layers (the format's ranks are 16 and 32).
template <typename OutT>
cudaError_t launch_epilogue(const GemmArgs& a, cudaStream_t stream) {
  if (a.swiglu) return a.R == 32 ? launch_typed<32, OutT, Epilogue::kSwiGlu>(a, stream) : cudaErrorInvalidValue;
  if (a.residual != nullptr) return launch_rank<OutT, Epilogue::kAddResidual>(a, stream);
  return launch_rank<OutT, Epilogue::kStore>(a, stream);
}

}  // namespace

cudaError_t w4a4_gemm_k_splits(int M, int N, int K, int* k_splits) {
  int sms = 0;
  const cudaError_t err = sm_count(&sms);
  if (err == cudaSuccess) *k_splits = plan_gemm(M, N, K, sms).k_split;
  return err;
}

cudaError_t launch_w4a4_gemm_lora_up(const GemmArgs& a, cudaStream_t stream) {
  if (a.M_pad % kMPad || a.M > a.M_pad || a.N_pad % kBlockN || a.N > a.N_pad || a.N % kTileN || a.K < kGroup ||
      a.K % kGroup || a.K / kGroup > kMaxGroups)
    return cudaErrorInvalidValue;
  if (a.segments < 1 || a.segments > kMaxSegments || a.lora_ld != a.segments * a.R) return cudaErrorInvalidValue;
  if (a.swiglu && (a.segments != 1 || a.residual != nullptr)) return cudaErrorInvalidValue;
  for (int s = 0; s + 1 < a.segments; ++s)
    if (a.segment_start[s] % kTileN || a.segment_start[s] <= (s ? a.segment_start[s - 1] : 0) ||
        a.segment_start[s] >= a.N)
      return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  return a.bf16 ? launch_epilogue<__nv_bfloat16>(a, stream) : launch_epilogue<__half>(a, stream);
}

}  // namespace w4a4
