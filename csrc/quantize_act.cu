// Kernel 1: per-token, per-64 int4 activation quantization into the GEMM's activation layout (e4m3 bytes
// of q * 2^-9 in wgmma's shared-memory layout: csrc/w4a4_common.cuh), fused with the low-rank down-projection
// (x @ proj_down) so that x is read from memory once.
//
// A block owns 16 rows; its warps take the K groups in turn (warp w: groups w, w + W, ...), and the
// low-rank partial sums of the warps are added in shared memory at the end. W = 16 warps per block while
// the grid is small (few rows: spread each row's groups over many warps), 4 once there are 2+ blocks per
// SM (measured 1.15-1.25x faster from M = 8192, docs/kernels.md). On the smallest 16-warp grids a block owns
// 8 rows instead (each lane one row: twice the blocks, half the quantization arithmetic a warp; where
// launch_typed says). The smallest grids (a quarter of a row set per SM or less, M <= 512 on an H200;
// K >= 2048, no prologue) spread each row set over a cluster of 8 blocks of W = 4 warps (6 at K = 3072)
// instead, so that more SMs get work: warp w of block c takes groups Wc + w, Wc + w + 8W, ..., and the blocks
// send their scales and partial sums to the first block's shared memory (distributed shared memory), which
// adds the sums in rank order (docs/kernels.md). Lane (gr, t) loads rows gr and gr + 8 (one of
// them in 8-row blocks), columns 16c + 4t .. 16c + 4t + 3 of the group for c = 0..3, so the per-row max
// is a 4-lane shuffle and each quantized word is 4 consecutive bytes of the output layout. The low-rank
// product reuses the same registers as bf16/fp16 MMA fragments by permuting k inside each 16-wide block (lane
// t's columns 4t, 4t+1 play k = 2t, 2t+1 and 4t+2, 4t+3 play k = 2t+8, 2t+9); proj_down is read with the
// same permutation, and a dot product does not depend on the order of k.
//
// The scales leave as the GEMM folds them (csrc/w4a4_gemm.cu): each row's largest scale amax_row (float32)
// and per group the fp16 ratio scale / amax_row. The warps keep their float32 scales in shared memory as
// they go; once every group is done the block writes both (no round trip through global memory).
//
// Divisions are correctly rounded (the reference's IEEE float32 x / smooth and xs / scale) without a
// division instruction: with y = RN(1/b) (1/smooth precomputed at load, 1/(512 scale) once per row),
// q = RN(a * y), r = fma(-q, b, a) (exact) and RN(q + r * y) = RN(a / b) (Markstein), barring
// overflow/underflow: smooth is clamped to [1e-3, 1e3] where it is made, and the scale's range is checked
// per warp (below). exact_division.cuh has both steps, tested against IEEE division.
//
// Fused producer (Prologue::kRmsNorm): x is the residual stream and the kernel quantizes
// T(w * T(x * rsqrt(mean(x^2) + eps))), Qwen3's RMSNorm with its roundings, so the normed x never goes
// through memory (the block sums each row's squares in a pre-pass over the same elements). A SiLU(gate) * up
// prologue for down_proj was measured 5-22% slower than the silu_mul kernel + this kernel and was removed
// (docs/kernels.md).
#include "exact_division.cuh"
#include "w4a4_common.cuh"
#include "w4a4_launch.h"

namespace w4a4 {
namespace {

// Tuning knob (OVBATCH_KERNEL_DEFINES): 4-warp blocks from this many 16-row blocks per SM up.
#ifndef W4A4_QUANT_SMALL_BLOCKS_FROM
#define W4A4_QUANT_SMALL_BLOCKS_FROM 2
#endif
constexpr int kClusterSize = 8;  // blocks per 16-row set on the smallest grids (the portable cluster limit)

enum class Prologue { kNone, kRmsNorm };

// A lane's share of one K group as loaded from memory: 4 consecutive elements (8 bytes) of block c for each of
// its rows (gr and gr + 8 of 16-row blocks, one of them in 8-row blocks; zeros for rows past M), and for the
// RMSNorm prologue the norm weights of those columns.
template <int kLaneRows>
struct GroupInput {
  uint2 x[kLaneRows][4];
  uint2 w[4];
};

template <typename T, Prologue P, int kLaneRows>
__device__ __forceinline__ void load_group(GroupInput<kLaneRows>& in, const T* x, const T* norm_w,
                                           const int64_t (&off)[kLaneRows], const bool (&ok)[kLaneRows], int g,
                                           int t) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int col = g * kGroup + 16 * c;
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r)
      in.x[r][c] = ok[r] ? *reinterpret_cast<const uint2*>(x + off[r] + col) : make_uint2(0, 0);
    if (P == Prologue::kRmsNorm) in.w[c] = *reinterpret_cast<const uint2*>(norm_w + col + 4 * t);
  }
}

// 1 / sqrt(mean(x^2) + eps) of the lane's rows (kRmsNorm's pre-pass): each warp sums the squares of the
// elements it will quantize, the warps' sums meet in shared memory.
template <typename T, int kWarpsPerBlock, int kLaneRows>
__device__ __forceinline__ void row_rstd(const T* x, const int64_t (&off)[kLaneRows], const bool (&ok)[kLaneRows],
                                         int G, int K, float eps, float (&rstd)[kLaneRows]) {
  __shared__ float sumsq[kWarpsPerBlock][8 * kLaneRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float ss[kLaneRows] = {};
  for (int g = warp; g < G; g += kWarpsPerBlock) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int col = g * kGroup + 16 * c;
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) {
        const uint2 raw = ok[r] ? *reinterpret_cast<const uint2*>(x + off[r] + col) : make_uint2(0, 0);
        const float2 lo = unpack2<T>(raw.x), hi = unpack2<T>(raw.y);
        ss[r] = fmaf(hi.y, hi.y, fmaf(hi.x, hi.x, fmaf(lo.y, lo.y, fmaf(lo.x, lo.x, ss[r]))));
      }
    }
  }
  const int gr = lane >> 2;
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) {
    ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], 1);
    ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], 2);
    if ((lane & 3) == 0) sumsq[warp][gr + 8 * r] = ss[r];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsPerBlock; ++w) total += sumsq[w][gr + 8 * r];
    rstd[r] = rsqrtf(total * (1.0f / static_cast<float>(K)) + eps);
  }
}

// 16-warp blocks at 16 low-rank columns without a prologue load each group's pd_t fragments into registers
// before the quantization arithmetic (4-18% faster than loading them right before the MMAs; staging them, below,
// measured a median 2.4% slower there).
template <Prologue P, int R, int kWarpsPerBlock>
constexpr bool kEarlyLowRank = kWarpsPerBlock == 16 && R <= 16 && P == Prologue::kNone;
// The other kernels up to 48 columns stage pd_t slices in shared memory (below): rows padded by 16 elements, so
// that a half-warp's 8-byte fragment loads (4 rows x 32 bytes) fall in distinct banks; a slice per warp (123 KB
// in a 16-warp block at 48 columns).
constexpr int kPdStride = kGroup + 16;
template <typename T, Prologue P, int R, int kWarpsPerBlock>
constexpr int kStagedLowRankBytes = R <= 48 && !kEarlyLowRank<P, R, kWarpsPerBlock>
                                        ? kWarpsPerBlock * R * kPdStride * static_cast<int>(sizeof(T))
                                        : 0;
// Kernels without a prologue outside clusters copy all of K's smoothing factors (smooth, then 1 / smooth) into
// shared memory when they start, and each group reads its factors from there: loaded from global memory at the
// top of each group, their first use was the kernel's most stalled instruction (ncu). Those kernels keep their
// scales in dynamic shared memory too, sized by K, so that 4 blocks of 4 warps still fit an SM at K = 3072 (the
// static array holds 127 groups). With the RMSNorm prologue staging measured 0.79x-1.13x the speed of loading
// (0.79x at K = 3072, M = 8192); a cluster block walks an eighth of the groups, on latency-bound grids.
template <Prologue P, bool kSmooth, int kClusterBlocks>
constexpr bool kStagedSmoothing = kSmooth && P == Prologue::kNone && kClusterBlocks == 1;
// Dynamic shared memory: the warps' pd_t slices, then where the smoothing factors are staged the block's scales
// (16 per group) and the factors.
template <typename T, Prologue P, bool kSmooth, int R, int kWarpsPerBlock, int kClusterBlocks>
constexpr int quantize_smem_bytes(int K) {
  constexpr int kFloat = sizeof(float);
  return kStagedLowRankBytes<T, P, R, kWarpsPerBlock> +
         (kStagedSmoothing<P, kSmooth, kClusterBlocks> ? K / kGroup * 16 * kFloat + 2 * K * kFloat : 0);
}

// 4-warp blocks of the groups' low-rank products (R = 48, 64, 96) are told 4 blocks fit an SM, which caps them
// at 128 registers: left alone, the compiler gives rank-32 groups (64, 96) registers for only 3 blocks, and the
// R = 48 RMSNorm kernel fewer registers for a fifth block, which measured 1.2-1.5x slower than 4 blocks.
// 6-warp blocks (down_proj's cluster grids) are told 3 fit: left alone, the rank-32 ones can take too many
// registers for a third block (measured 1.2x the time). 0 leaves the other kernels to the compiler's choice: an
// explicit 1 made it spend far more registers on R <= 32.
template <int R, int kWarpsPerBlock>
constexpr int kQuantizeMinBlocks = kWarpsPerBlock == 4 && R >= 48 ? 4 : kWarpsPerBlock == 6 ? 3 : 0;

template <typename T, Prologue P, bool kSmooth, int R, int kWarpsPerBlock, int kClusterBlocks, int kBlockRows>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, (kQuantizeMinBlocks<R, kWarpsPerBlock>))
    quantize_act_lora_down_kernel(const T* __restrict__ x, const T* __restrict__ norm_w,
                                  float eps, int ldx, const float* __restrict__ smooth,
                                  const float* __restrict__ rsmooth, const T* __restrict__ pd_t,
                                  int8_t* __restrict__ qact, __half* __restrict__ aratios,
                                  float* __restrict__ amax_rows,
                                  float* __restrict__ lora, int M, int M_pad, int K) {
  constexpr int kTiles = R / 8;  // 8-column MMA tiles of the low-rank product
  // The warps' partial sums meet in shared memory 32 (or 16) columns at a time.
  constexpr int kChunkTiles = kTiles % 4 == 0 ? 4 : 2;
  static_assert(R % 16 == 0 && kTiles % kChunkTiles == 0, "low-rank widths are multiples of 16");
  __shared__ float partial[kWarpsPerBlock][kChunkTiles * 4][32];
  // In a cluster, rank 0's: each block's sums of every fragment element (nt, e) of every lane.
  constexpr bool kCluster = kClusterBlocks > 1;
  static_assert(!kCluster || P == Prologue::kNone, "clusters only without a prologue (row_rstd is per block)");
  static_assert(!kCluster || R <= 32, "clusters only for single layers (their sums fill up to 16 KB)");
  static_assert(kBlockRows == 16 || (kBlockRows == 8 && !kCluster), "8-row blocks only outside clusters");
  constexpr int kLaneRows = kBlockRows / 8;
  __shared__ float cluster_sums[kCluster ? kClusterBlocks : 1][kCluster ? kTiles * 4 * 32 : 1];
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  constexpr int kPdBytes = kStagedLowRankBytes<T, P, R, kWarpsPerBlock>;
  constexpr bool kStagedSmooth = kStagedSmoothing<P, kSmooth, kClusterBlocks>;
  static_assert(!(kCluster && kStagedSmooth), "cluster blocks keep their scales in the static array");
  // Per group, the 16-row set's rows in the order they take among the 32 of activation_scale_position: row
  // r < 8 at 4 ((r >> 1) & 3) + (r & 1), row r + 8 two places after it (an 8-row block fills its half's places).
  __shared__ float scales_s[kStagedSmooth ? 1 : kMaxGroups][16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gr = lane >> 2, t = lane & 3;
  const int rank = blockIdx.x % kClusterBlocks;
  // The 16-row set (mtile) and the block's half of it: lane row r is row gr + 8 (half + r) of the set.
  const int mtile = blockIdx.x / kClusterBlocks / (16 / kBlockRows);
  const int half = kBlockRows == 8 ? (blockIdx.x / kClusterBlocks) % 2 : 0;
  const int first_group = rank * kWarpsPerBlock + warp;
  constexpr int kGroupStep = kClusterBlocks * kWarpsPerBlock;
  bool ok[kLaneRows];
  int64_t off[kLaneRows];
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) {
    const int row = mtile * 16 + gr + 8 * (half + r);
    ok[r] = row < M;
    off[r] = static_cast<int64_t>(row) * ldx + 4 * t;
  }
  const int G = K / kGroup;
  // Group g's 16 scales: behind the pd_t slices where the smoothing factors are staged (sized by K), else the
  // static array.
  float* const staged_scales = reinterpret_cast<float*>(dynamic_smem + kPdBytes);
  auto scale_row = [&](int g) -> float* {
    if constexpr (kStagedSmooth)
      return staged_scales + 16 * g;
    else
      return scales_s[g];
  };
  float* smooth_s = staged_scales + 16 * G;  // smooth, then 1 / smooth
  if (kStagedSmooth) {
    for (int i = threadIdx.x; i < K / 4; i += kWarpsPerBlock * 32) {
      cp_async_16(smem_addr(smooth_s + 4 * i), smooth + 4 * i);
      cp_async_16(smem_addr(smooth_s + K + 4 * i), rsmooth + 4 * i);
    }
    cp_async_commit();
  }

  if constexpr (kCluster) __cluster_barrier_arrive_relaxed();  // phase 1: this block runs (waited for at the end)
  float rstd[kLaneRows];
#pragma unroll
  for (int r = 0; r < kLaneRows; ++r) rstd[r] = 1.f;
  if (P == Prologue::kRmsNorm) row_rstd<T, kWarpsPerBlock>(x, off, ok, G, K, eps, rstd);

  float lacc[kTiles][4];
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) lacc[nt][e] = 0.f;

  // Software pipeline: the warp's next group is loaded while this one is quantized, so its memory latency
  // overlaps the arithmetic instead of following it. Only up to 32 low-rank columns: with 48-96 the second
  // group's registers spilled (up to 40 bytes).
  constexpr bool kPrefetch = R <= 32;
  // The low-rank MMAs waited on their pd_t loads (ncu: 18-20% of the stall samples), so the B fragments are
  // fetched ahead of use: up to 48 columns, each warp copies its first group's pd_t slice into (dynamic) shared
  // memory with cp.async at the start and its next one once it has used the current one, so the copy runs
  // behind the arithmetic without holding registers (in 4-warp and 16-warp blocks alike; 64 and 96 columns
  // would take 40-61 KB per 4-warp block and are not staged), or loads them early
  // (kEarlyLowRank, above).
  constexpr bool kStagedLowRank = kPdBytes > 0;
  constexpr bool kEarly = kEarlyLowRank<P, R, kWarpsPerBlock>;
  T* pd_s = reinterpret_cast<T*>(dynamic_smem) + warp * R * kPdStride;  // this warp's slice
  // Lane l copies 16-byte piece l % 8 of rows l / 8 + 4i of the warp's group slice.
  const T* pd_src = pd_t + static_cast<int64_t>(lane / 8) * K + 8 * (lane % 8);
  const uint32_t pd_dst = smem_addr(pd_s) + sizeof(T) * ((lane / 8) * kPdStride + 8 * (lane % 8));
  auto stage_low_rank = [&](int g) {
#pragma unroll
    for (int i = 0; i < R / 4; ++i)
      cp_async_16(pd_dst + sizeof(T) * 4 * i * kPdStride, pd_src + static_cast<int64_t>(4 * i) * K + g * kGroup);
    cp_async_commit();
  };
  // One K group of the warp: its quantized words into the tile, its scales into scale_row(g), its low-rank
  // product into lacc; load_next() is called once the group's input is in raw.
  auto quantize_group = [&](int g, const GroupInput<kLaneRows>& in, auto&& load_next) {
    uint2 pd_frag[kEarly ? kTiles : 1][4];
    if (kEarly) {
#pragma unroll
      for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int nt = 0; nt < kTiles; ++nt)
          pd_frag[kEarly ? nt : 0][c] = *reinterpret_cast<const uint2*>(
              pd_t + static_cast<int64_t>(nt * 8 + gr) * K + g * kGroup + 16 * c + 4 * t);
    }
    // raw[r][c]: 4 consecutive input elements (8 bytes) of block c of this group, the prologue applied; zeros
    // for rows past M (without the prologue the loads are zeros already, but the selects are free: they put the
    // words where the low-rank MMAs read them, which would otherwise take as many moves).
    uint2 raw[kLaneRows][4];
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) {
        const uint2 v = in.x[r][c], w = in.w[c];
        const uint2 normed = P == Prologue::kNone ? v
                                                  : make_uint2(rms_normed2<T>(v.x, w.x, rstd[r]),
                                                               rms_normed2<T>(v.y, w.y, rstd[r]));
        raw[r][c] = ok[r] ? normed : make_uint2(0, 0);
      }
    load_next();

    // Smoothed float32 values and the per-row max |x|.
    float xs[kLaneRows][4][4];
    float amax[kLaneRows] = {};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float4 s = make_float4(1.f, 1.f, 1.f, 1.f), rs = s;
      if (kStagedSmooth) {
        s = *reinterpret_cast<const float4*>(smooth_s + g * kGroup + 16 * c + 4 * t);
        rs = *reinterpret_cast<const float4*>(smooth_s + K + g * kGroup + 16 * c + 4 * t);
      } else if (kSmooth) {
        s = *reinterpret_cast<const float4*>(smooth + g * kGroup + 16 * c + 4 * t);
        rs = *reinterpret_cast<const float4*>(rsmooth + g * kGroup + 16 * c + 4 * t);
      }
      const float sv[4] = {s.x, s.y, s.z, s.w}, rsv[4] = {rs.x, rs.y, rs.z, rs.w};
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) {
        const float2 lo = unpack2<T>(raw[r][c].x), hi = unpack2<T>(raw[r][c].y);
        const float f[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          xs[r][c][b] = kSmooth ? div_rn(f[b], sv[b], rsv[b]) : f[b];
          amax[r] = fmaxf(amax[r], fabsf(xs[r][c][b]));
        }
      }
    }
    // The quotients come out in units of 2^-9, the e4m3 grid's integers: the divisor is 512 scale, whose
    // float32 reciprocal is exactly 2^-9 times scale's, so div_rn gives RN(xs / scale) * 2^-9 with no extra
    // multiply. With scale in [2^-90, 2^100] nothing over- or underflows where it matters, and
    // |xs| <= amax = 7 scale (1 + 2^-24) keeps every quotient below 7.5, so no clamp is needed either. A warp
    // with a row outside that range (never seen in practice; zero rows aside) takes IEEE division and the
    // clamp, as the reference does; one branch for the warp leaves both rows' arithmetic free to interleave.
    // In that range the reciprocal is rcp_rn's (exact_division.cuh: IEEE's bits without the range check).
    float scale[kLaneRows], divisor[kLaneRows], rdivisor[kLaneRows];
    bool grid_units = true;
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r) {
      amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], 1));
      amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], 2));
      scale[r] = amax[r] / 7.0f;
      divisor[r] = 512.0f * scale[r];
      rdivisor[r] = rcp_rn(divisor[r]);
      grid_units = grid_units && (scale[r] == 0.f || (scale[r] >= 0x1p-90f && scale[r] <= 0x1p100f));
    }
    grid_units = __all_sync(0xffffffffu, grid_units);
    if (t == 0) {
      float* at = scale_row(g) + 4 * ((gr >> 1) & 3) + (gr & 1);
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r) at[2 * (half + r)] = scale[r];
    }

    // q = clamp(round_half_even(xs / scale), -8, 7), stored as the e4m3 byte of q * 2^-9 (a zero group is 0,
    // not its 0 / 0 quotients): the lane's rows, k = 16c + 4t .. 16c + 4t + 3, one word each.
    int8_t* tile =
        qact + (static_cast<int64_t>(mtile / 8) * G + g) * kActTileBytes + ((mtile % 8) * 16 + gr) * 16 + 4 * t;
    // words[r][c]: the 4 bytes of row r, block c; pair_bytes(lo, hi, r) encodes two of row r's values.
    uint32_t words[kLaneRows][4];
    auto quantize_words = [&](auto pair_bytes) {
#pragma unroll
      for (int r = 0; r < kLaneRows; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float* v = xs[r][c];
          words[r][c] = pair_bytes(v[0], v[1], r) | pair_bytes(v[2], v[3], r) << 16;
        }
    };
    if (grid_units)
      quantize_words([&](float lo, float hi, int r) {
        return e4m3x2_of_grid_units(div_rn(lo, divisor[r], rdivisor[r]), div_rn(hi, divisor[r], rdivisor[r]));
      });
    else
      quantize_words([&](float lo, float hi, int r) { return e4m3x2_of_rounded(lo / scale[r], hi / scale[r]); });
#pragma unroll
    for (int r = 0; r < kLaneRows; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        *reinterpret_cast<uint32_t*>(tile + c * kActChunkBytes + (half + r) * 8 * 16) =
            scale[r] > 0.f ? words[r][c] : 0u;

    // Low-rank down-projection on the unsmoothed input; smoothing is folded into pd_t at load.
    if (kStagedLowRank) {
      cp_async_wait<0>();
      __syncwarp();  // the other lanes' pieces of the slice have landed
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      // The A fragment's rows gr and gr + 8: an 8-row block's lane row goes where its half puts it, zeros in the
      // other (so the sums land where lora_at puts the 16-row block's).
      const uint2 zero = make_uint2(0, 0);
      const uint2 lo = kLaneRows == 2 ? raw[0][c] : (half ? zero : raw[0][c]);
      const uint2 hi = kLaneRows == 2 ? raw[kLaneRows - 1][c] : (half ? raw[0][c] : zero);
      const uint32_t a[4] = {lo.x, hi.x, lo.y, hi.y};
#pragma unroll
      for (int nt = 0; nt < kTiles; ++nt) {
        uint2 b;
        if (kStagedLowRank)
          b = *reinterpret_cast<const uint2*>(&pd_s[(nt * 8 + gr) * kPdStride + 16 * c + 4 * t]);
        else if (kEarly)
          b = pd_frag[kEarly ? nt : 0][c];
        else
          b = *reinterpret_cast<const uint2*>(pd_t + static_cast<int64_t>(nt * 8 + gr) * K + g * kGroup + 16 * c +
                                              4 * t);
        mma_16816<T>(lacc[nt], a, b.x, b.y);
      }
    }
    if (kStagedLowRank && g + kGroupStep < G) {
      __syncwarp();  // every lane has read the slice it overwrites
      stage_low_rank(g + kGroupStep);
    }
  };
  GroupInput<kLaneRows> cur, next;
  if (kPrefetch && first_group < G) load_group<T, P>(cur, x, norm_w, off, ok, first_group, t);
  if (kStagedLowRank && first_group < G) stage_low_rank(first_group);
  if (kStagedSmooth) {
    // This thread's smoothing pieces have landed (its first pd_t slice may still be in flight), then everyone's.
    if (kStagedLowRank && first_group < G)
      cp_async_wait<1>();
    else
      cp_async_wait<0>();
    __syncthreads();
  }
  for (int g = first_group; g < G; g += kGroupStep) {
    if (!kPrefetch) load_group<T, P>(cur, x, norm_w, off, ok, g, t);
    // The next group's input is loaded once this group's is in raw. Loaded before the group, ptxas moved
    // registers between the two buffers (up to 16 moves a group), and with the smoothing factors staged it waited
    // for those loads at the top of this very group.
    quantize_group(g, cur, [&] {
      if (kPrefetch && g + kGroupStep < G) load_group<T, P>(next, x, norm_w, off, ok, g + kGroupStep, t);
    });
    if (kPrefetch) cur = next;
  }

  // The warps' low-rank partial sums added up, a chunk of columns at a time: store(i, sum) for fragment element
  // i = 128 nt + 32 e + l, element (nt, e) of lane l (row gr + 8 (e >> 1), column nt * 8 + 2t + (e & 1)).
  auto add_warp_sums = [&](auto&& store) {
#pragma unroll
    for (int chunk = 0; chunk < kTiles; chunk += kChunkTiles) {
      if (chunk > 0) __syncthreads();  // the previous chunk's partial sums have been read
#pragma unroll
      for (int nt = 0; nt < kChunkTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) partial[warp][nt * 4 + e][lane] = lacc[chunk + nt][e];
      __syncthreads();
      for (int i = threadIdx.x; i < kChunkTiles * 4 * 32; i += kWarpsPerBlock * 32) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarpsPerBlock; ++w) sum += partial[w][i >> 5][i & 31];
        store(chunk * 4 * 32 + i, sum);
      }
    }
  };
  // Whether fragment element i (row gr + 8 (e >> 1)) is one of the block's rows, and its place in lora.
  auto is_block_row = [&](int i) { return kBlockRows == 16 || ((i >> 6) & 1) == half; };
  auto lora_at = [&](int i) -> float& {
    const int l = i & 31, nt = i >> 7, e = (i >> 5) & 3;
    const int row = mtile * 16 + (l >> 2) + 8 * (e >> 1), col = nt * 8 + 2 * (l & 3) + (e & 1);
    return lora[static_cast<int64_t>(row) * R + lora_position(col)];
  };

  // Thread i writes the ratios of scales 2 (i % 8) and 2 (i % 8) + 1 of scales_s (rows side by side) for groups
  // i / 8, ...: the 16 rows fill 4 of every 8 places of their 32 (the first or second 4 of them); the rows
  // gr + 8 half of an 8-row block are the pairs 2 half, 2 half + 1 of every 4 places.
  auto write_scales = [&] {
    const int pos = 2 * (threadIdx.x % 8);
    const bool mine = kBlockRows == 16 || pos % 4 == 2 * half;
    const int64_t col = static_cast<int64_t>(mtile / 2) * 32 + 8 * (pos / 4) + 4 * (mtile % 2) + pos % 4;
    // Lanes l, l + 8, l + 16 and l + 24 share pos: each takes every 4th group, then two shuffles meet them.
    float2 amax = make_float2(0.f, 0.f);
    for (int g = (threadIdx.x / 8) % 4; mine && g < G; g += 4) {
      const float2 s = *reinterpret_cast<const float2*>(scale_row(g) + pos);
      amax = make_float2(fmaxf(amax.x, s.x), fmaxf(amax.y, s.y));
    }
#pragma unroll
    for (int lanes = 8; lanes <= 16; lanes *= 2) {
      amax.x = fmaxf(amax.x, __shfl_xor_sync(0xffffffffu, amax.x, lanes));
      amax.y = fmaxf(amax.y, __shfl_xor_sync(0xffffffffu, amax.y, lanes));
    }
    const float2 inv = make_float2(amax.x > 0.f ? 1.f / amax.x : 0.f, amax.y > 0.f ? 1.f / amax.y : 0.f);
    if (threadIdx.x < 8 && mine) *reinterpret_cast<float2*>(amax_rows + col) = amax;
    for (int g = threadIdx.x / 8; mine && g < G; g += kWarpsPerBlock * 4) {
      const float2 s = *reinterpret_cast<const float2*>(scale_row(g) + pos);
      *reinterpret_cast<__half2*>(aratios + g * M_pad + col) = __floats2half2_rn(s.x * inv.x, s.y * inv.y);
    }
  };

  __syncthreads();  // scales_s is complete
  if constexpr (kCluster) {
    // Every block sends its groups' scales and its low-rank partial sums to rank 0's shared memory and leaves;
    // rank 0 waits for them and finishes alone: one cluster barrier and no reads of other blocks' memory, faster
    // than every block reading the others' row maxima and partial sums between two full cluster barriers.
    __cluster_barrier_wait();  // phase 1 (arrived at the start): every block runs, so its shared memory is there
    if (rank > 0) {
      float(*scales0)[16] = static_cast<float(*)[16]>(__cluster_map_shared_rank(scales_s, 0));
      // The block's j-th group is (j / W) C W + W rank + j % W.
      for (int j = threadIdx.x / 16;; j += kWarpsPerBlock * 2) {
        const int g = (j / kWarpsPerBlock) * kGroupStep + rank * kWarpsPerBlock + j % kWarpsPerBlock;
        if (g >= G) break;
        scales0[g][threadIdx.x % 16] = scales_s[g][threadIdx.x % 16];
      }
    }
    float* sums0 = static_cast<float*>(__cluster_map_shared_rank(&cluster_sums[rank][0], 0));
    add_warp_sums([&](int i, float sum) { sums0[i] = sum; });
    __cluster_barrier_arrive();  // release: the stores above are seen by rank 0 after its wait
    if (rank > 0) return;
    __cluster_barrier_wait();
    write_scales();
    // The blocks' sums added in rank order.
    for (int i = threadIdx.x; i < kTiles * 4 * 32; i += kWarpsPerBlock * 32) {
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < kClusterBlocks; ++c) sum += cluster_sums[c][i];
      lora_at(i) = __uint_as_float(to_tf32(sum));
    }
  } else {
    write_scales();
    add_warp_sums([&](int i, float sum) {
      if (is_block_row(i)) lora_at(i) = __uint_as_float(to_tf32(sum));
    });
  }
}

template <typename T, Prologue P, bool kSmooth, int R, int kWarps, int kClusterBlocks, int kBlockRows = 16>
cudaError_t launch_warps(const QuantizeArgs& a, cudaStream_t stream) {
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kClusterBlocks;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  auto kernel = quantize_act_lora_down_kernel<T, P, kSmooth, R, kWarps, kClusterBlocks, kBlockRows>;
  const int smem = quantize_smem_bytes<T, P, kSmooth, R, kWarps, kClusterBlocks>(a.K);
  if (smem > 0) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(a.M_pad / kBlockRows * kClusterBlocks);
  config.blockDim = dim3(kWarps * 32);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = kClusterBlocks > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, static_cast<const T*>(a.x), static_cast<const T*>(a.norm_weight), a.eps,
                            a.ldx, a.smooth, a.smooth == nullptr ? nullptr : a.smooth + a.K,
                            static_cast<const T*>(a.pd_t), static_cast<int8_t*>(a.qact),
                            static_cast<__half*>(a.aratios), a.amax, a.lora, a.M, a.M_pad, a.K);
}

// 4-warp blocks from W4A4_QUANT_SMALL_BLOCKS_FROM row sets per SM, 16-warp blocks below (of 8 rows on the
// smallest grids); clusters of 8 blocks of 4 or 6 warps on grids of at most a quarter of a row set per SM with 32+
// K groups (one or more per warp; at K = 1024, 4 blocks a cluster measured -6% to +4%), no prologue and one layer's
// rank (up to 32 columns): o_proj's and down_proj's inputs (the RMSNorm prologue feeds q/k/v and gate/up, whose K
// is the hidden size, 1024).
template <typename T, Prologue P, bool kSmooth, int R>
cudaError_t launch_typed(const QuantizeArgs& a, cudaStream_t stream) {
  int sms = 0;
  const cudaError_t err = sm_count(&sms);
  if (err != cudaSuccess) return err;
  const int row_sets = a.M_pad / 16;
  if (row_sets >= W4A4_QUANT_SMALL_BLOCKS_FROM * sms) return launch_warps<T, P, kSmooth, R, 4, 1>(a, stream);
  if constexpr (P == Prologue::kNone && R <= 32) {
    const int groups = a.K / kGroup;
    if (4 * row_sets <= sms && groups >= 4 * kClusterSize) {
      // 6 warps a block where that gives each warp one group (K = 3072, down_proj) instead of some two.
      if (groups > 4 * kClusterSize && groups <= 6 * kClusterSize)
        return launch_warps<T, P, kSmooth, R, 6, kClusterSize>(a, stream);
      return launch_warps<T, P, kSmooth, R, 4, kClusterSize>(a, stream);
    }
  }
  // 8-row blocks where they measured faster (docs/kernels.md): with the RMSNorm prologue or at 16 columns
  // up to half a row set per SM, otherwise up to an eighth; not above 48 columns.
  if constexpr (R <= 48) {
    const bool half_rows_pay = P == Prologue::kRmsNorm || R == 16;
    if ((half_rows_pay ? 2 : 8) * row_sets <= sms) return launch_warps<T, P, kSmooth, R, 16, 1, 8>(a, stream);
  }
  return launch_warps<T, P, kSmooth, R, 16, 1>(a, stream);
}

template <typename T, Prologue P, int R>
cudaError_t launch_smooth(const QuantizeArgs& a, cudaStream_t stream) {
  return a.smooth != nullptr ? launch_typed<T, P, true, R>(a, stream) : launch_typed<T, P, false, R>(a, stream);
}

// Low-rank widths: one layer's rank (16 or 32), or a group's (2 or 3 layers of one rank).
template <typename T, Prologue P>
cudaError_t launch_rank(const QuantizeArgs& a, cudaStream_t stream) {
  switch (a.R) {
    case 16: return launch_smooth<T, P, 16>(a, stream);
    case 32: return launch_smooth<T, P, 32>(a, stream);
    case 48: return launch_smooth<T, P, 48>(a, stream);
    case 64: return launch_smooth<T, P, 64>(a, stream);
    case 96: return launch_smooth<T, P, 96>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_prologue(const QuantizeArgs& a, cudaStream_t stream) {
  return a.norm_weight != nullptr ? launch_rank<T, Prologue::kRmsNorm>(a, stream)
                                  : launch_rank<T, Prologue::kNone>(a, stream);
}

}  // namespace

cudaError_t launch_quantize_act_lora_down(const QuantizeArgs& a, cudaStream_t stream) {
  if (a.M_pad % kMPad || a.K % kGroup || a.K / kGroup > kMaxGroups || a.ldx % 4) return cudaErrorInvalidValue;
  if (a.M_pad == 0) return cudaSuccess;
  return a.bf16 ? launch_prologue<__nv_bfloat16>(a, stream) : launch_prologue<__half>(a, stream);
}

}  // namespace w4a4
