// Kernel 2: W4A4 GEMM on INT8 tensor cores with per-group float32 scaling and the low-rank
// up-projection fused into the epilogue; one write of the output.
//
// Tiles: a block computes BM x 128 outputs (BM = 64 or 128) with 4 or 8 warps, each warp 64 x 32.
// Each 64-wide K group streams through shared memory (cp.async, kStages deep): the packed 4-bit A and
// B tiles, the group's activation scales and weight scales. Per group a warp unpacks the nibbles to
// int8 (values times 16, two bit operations per register), runs two m16n8k32 IMMA per 16x8 tile into
// int32 registers pre-loaded with the float bit pattern of 1.5 * 2^23, and folds the group into the
// float32 accumulators with two FMAs per element:
//   f = float_bits(0x4B400000 + 256 * dot) = 12582912 + 256 * dot           (exact: |256 dot| <= 2^20)
//   t = fma(f, ws', -12582912 * ws') = round(dot * wscale)   with ws' = wscale / 256
//   acc = fma(t, ascale, acc)
// The product 12582912 * ws' is exact because wscale has at most 22 significant bits (fp16 scales
// have 11; the loader rounds wider ones to 22 bits).
// Epilogue: acc += lora[M, R] @ proj_up[N, R]^T with tf32 MMA, + bias, cast, store rows < M, columns < N
// (weights are padded with zero rows to N_pad, a multiple of 128).
#include "w4a4_common.cuh"
#include "w4a4_launch.h"

namespace w4a4 {
namespace {

// Tuning knobs (OVBATCH_KERNEL_DEFINES): pipeline depth, blocks per SM the registers are capped for,
// m16 tiles per IMMA pass.
#ifndef W4A4_GEMM_STAGES
#define W4A4_GEMM_STAGES 4
#endif
constexpr int kStages = W4A4_GEMM_STAGES;
static_assert((kStages & (kStages - 1)) == 0, "stage count must be a power of two");
constexpr int kWarpsN = 4;
constexpr int kMagic = 0x4B400000;
#ifndef W4A4_GEMM_MIN_BLOCKS
#define W4A4_GEMM_MIN_BLOCKS 2
#endif
constexpr int kMinBlocks = W4A4_GEMM_MIN_BLOCKS;
#ifndef W4A4_GEMM_PASS
#define W4A4_GEMM_PASS 2
#endif
constexpr int kPass = W4A4_GEMM_PASS;

template <int BM>
struct Stage {
  int4 a[BM / 16 * 32];
  int4 b[kBlockN / 16 * 32];
  float as[BM];
  float2 ws[kBlockN];
};

template <int WARPS_M, int R, typename OutT>
__global__ void __launch_bounds__(WARPS_M * kWarpsN * 32, kMinBlocks)
    w4a4_gemm_lora_up_kernel(const int4* __restrict__ qact, const float* __restrict__ ascales,
                             const int4* __restrict__ qweight, const float2* __restrict__ wscales,
                             const float* __restrict__ lora, const float* __restrict__ proj_up,
                             const float* __restrict__ bias, OutT* __restrict__ y, int M, int M_pad, int N,
                             int N_pad, int K) {
  constexpr int BM = 64 * WARPS_M;
  constexpr int kThreads = WARPS_M * kWarpsN * 32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Stage<BM>* stages = reinterpret_cast<Stage<BM>*>(smem_raw);

  const int G = K / kGroup;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * kBlockN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int gr = lane >> 2, t = lane & 3;

  // Static copy assignment: thread tid copies A record tid, B records tid (+ kThreads), and the first
  // BM/4 + 64 threads one 16-byte piece of the scales; per group only the base offsets move.
  constexpr int kBPerThread = kBlockN / 16 * 32 / kThreads;
  constexpr int kAsChunks = BM / 4, kWsChunks = kBlockN / 2;
  static_assert(BM / 16 * 32 == kThreads, "one A record per thread");
  static_assert(kAsChunks + kWsChunks <= kThreads, "scale pieces fit one per thread");
  const int4* a_src = qact + static_cast<int64_t>(m0 / 16 + (tid >> 5)) * G * 32 + lane;
  const int4* b_src[kBPerThread];
#pragma unroll
  for (int j = 0; j < kBPerThread; ++j) {
    const int c = tid + j * kThreads;
    b_src[j] = qweight + static_cast<int64_t>(n0 / 16 + (c >> 5)) * G * 32 + (c & 31);
  }
  const bool copies_as = tid < kAsChunks, copies_ws = !copies_as && tid < kAsChunks + kWsChunks;
  const float* s_src = copies_as ? ascales + m0 + 4 * tid
                                 : reinterpret_cast<const float*>(wscales + n0 + 2 * (tid - kAsChunks));
  const int64_t s_stride = copies_as ? M_pad : 2 * static_cast<int64_t>(N_pad);

  auto load_stage = [&](int g, Stage<BM>& s) {
    cp_async_16(&s.a[tid], a_src + g * 32);
#pragma unroll
    for (int j = 0; j < kBPerThread; ++j) cp_async_16(&s.b[tid + j * kThreads], b_src[j] + g * 32);
    if (copies_as) cp_async_16(&s.as[4 * tid], s_src + g * s_stride);
    if (copies_ws) cp_async_16(&s.ws[2 * (tid - kAsChunks)], s_src + g * s_stride);
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < G) load_stage(s, stages[s]);
    cp_async_commit();
  }

  for (int g = 0; g < G; ++g) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (g + kStages - 1 < G) load_stage(g + kStages - 1, stages[(g + kStages - 1) & (kStages - 1)]);
    cp_async_commit();

    const Stage<BM>& s = stages[g & (kStages - 1)];
    uint32_t blo[4][2], bhi[4][2];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int4 w = s.b[(wn * 2 + p) * 32 + lane];
      const uint32_t wv[4] = {static_cast<uint32_t>(w.x), static_cast<uint32_t>(w.y), static_cast<uint32_t>(w.z),
                              static_cast<uint32_t>(w.w)};
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          blo[2 * p + j][r] = nibbles_step0(wv[2 * j + r]);
          bhi[2 * p + j][r] = nibbles_step1(wv[2 * j + r]);
        }
    }
    float4 wsc[4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
      wsc[nt] = *reinterpret_cast<const float4*>(&s.ws[wn * 32 + nt * 8 + 2 * t]);

    // kPass m16 tiles at a time: 4 * kPass independent IMMAs for k-step 0, then the ones that continue
    // them for k-step 1, then the float folds, so no instruction waits right behind the one it depends on.
#pragma unroll
    for (int mp = 0; mp < 4 / kPass; ++mp) {
      uint32_t alo[kPass][4], ahi[kPass][4];
      float asr[kPass][2];
#pragma unroll
      for (int h = 0; h < kPass; ++h) {
        const int mt = kPass * mp + h;
        const int4 w = s.a[(wm * 4 + mt) * 32 + lane];
        const uint32_t wv[4] = {static_cast<uint32_t>(w.x), static_cast<uint32_t>(w.y),
                                static_cast<uint32_t>(w.z), static_cast<uint32_t>(w.w)};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          alo[h][i] = nibbles_step0(wv[i]);
          ahi[h][i] = nibbles_step1(wv[i]);
        }
        asr[h][0] = s.as[wm * 64 + mt * 16 + gr];
        asr[h][1] = s.as[wm * 64 + mt * 16 + gr + 8];
      }
      int d[kPass][4][4];
#pragma unroll
      for (int h = 0; h < kPass; ++h)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          mma_s8_16832(d[h][nt], alo[h], blo[nt][0], blo[nt][1], kMagic, kMagic, kMagic, kMagic);
#pragma unroll
      for (int h = 0; h < kPass; ++h)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          mma_s8_16832(d[h][nt], ahi[h], bhi[nt][0], bhi[nt][1], d[h][nt][0], d[h][nt][1], d[h][nt][2],
                       d[h][nt][3]);
#pragma unroll
      for (int h = 0; h < kPass; ++h)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          float* a = acc[kPass * mp + h][nt];
          a[0] = fmaf(fmaf(__int_as_float(d[h][nt][0]), wsc[nt].x, wsc[nt].y), asr[h][0], a[0]);
          a[1] = fmaf(fmaf(__int_as_float(d[h][nt][1]), wsc[nt].z, wsc[nt].w), asr[h][0], a[1]);
          a[2] = fmaf(fmaf(__int_as_float(d[h][nt][2]), wsc[nt].x, wsc[nt].y), asr[h][1], a[2]);
          a[3] = fmaf(fmaf(__int_as_float(d[h][nt][3]), wsc[nt].z, wsc[nt].w), asr[h][1], a[3]);
        }
    }
  }
  cp_async_wait<0>();

  // Low-rank up-projection: acc += lora[rows, :] @ proj_up[cols, :]^T (tf32 MMA, float32 accumulate).
  const int row_base = m0 + wm * 64 + gr;
  const int col_base = n0 + wn * 32;
#pragma unroll
  for (int ks = 0; ks < R / 8; ++ks) {
    uint32_t b[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const float* pu = proj_up + static_cast<int64_t>(col_base + nt * 8 + gr) * R + ks * 8 + t;
      b[nt][0] = to_tf32(pu[0]);
      b[nt][1] = to_tf32(pu[4]);
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      const float* l0 = lora + static_cast<int64_t>(row_base + mt * 16) * R + ks * 8 + t;
      const float* l1 = l0 + 8 * R;
      const uint32_t a[4] = {to_tf32(l0[0]), to_tf32(l1[0]), to_tf32(l0[4]), to_tf32(l1[4])};
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) mma_tf32_1688(acc[mt][nt], a, b[nt][0], b[nt][1]);
    }
  }

#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const int col = col_base + nt * 8 + 2 * t;
    if (col >= N) continue;  // the padded columns of an N that is a multiple of 64 but not of 128
    float2 bv = make_float2(0.f, 0.f);
    if (bias != nullptr) bv = *reinterpret_cast<const float2*>(bias + col);
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      const int r0 = row_base + mt * 16, r1 = r0 + 8;
      if (r0 < M)
        *reinterpret_cast<uint32_t*>(y + static_cast<int64_t>(r0) * N + col) =
            pack2<OutT>(acc[mt][nt][0] + bv.x, acc[mt][nt][1] + bv.y);
      if (r1 < M)
        *reinterpret_cast<uint32_t*>(y + static_cast<int64_t>(r1) * N + col) =
            pack2<OutT>(acc[mt][nt][2] + bv.x, acc[mt][nt][3] + bv.y);
    }
  }
}

template <int WARPS_M, int R, typename OutT>
cudaError_t launch_tile(const GemmArgs& a, cudaStream_t stream) {
  constexpr int BM = 64 * WARPS_M;
  const size_t smem = kStages * sizeof(Stage<BM>);
  auto kernel = w4a4_gemm_lora_up_kernel<WARPS_M, R, OutT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  const dim3 grid(a.N_pad / kBlockN, (a.M + BM - 1) / BM);
  kernel<<<grid, WARPS_M * kWarpsN * 32, smem, stream>>>(
      static_cast<const int4*>(a.qact), a.ascales, static_cast<const int4*>(a.qweight),
      reinterpret_cast<const float2*>(a.wscales), a.lora, a.proj_up, a.bias, static_cast<OutT*>(a.y), a.M,
      a.M_pad, a.N, a.N_pad, a.K);
  return cudaGetLastError();
}

template <int R, typename OutT>
cudaError_t launch_rank(const GemmArgs& a, cudaStream_t stream) {
  // 128-row tiles when they fill the chip, 64-row tiles (twice the blocks) otherwise.
  const int big_tiles = ((a.M + 127) / 128) * (a.N_pad / kBlockN);
  return big_tiles >= a.num_sms ? launch_tile<2, R, OutT>(a, stream) : launch_tile<1, R, OutT>(a, stream);
}

template <typename OutT>
cudaError_t launch_typed(const GemmArgs& a, cudaStream_t stream) {
  if (a.R == 16) return launch_rank<16, OutT>(a, stream);
  if (a.R == 32) return launch_rank<32, OutT>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_w4a4_gemm_lora_up(const GemmArgs& a, cudaStream_t stream) {
  if (a.M_pad % kMPad || a.M > a.M_pad || a.N_pad % kBlockN || a.N > a.N_pad || a.N % 64 || a.K % kGroup)
    return cudaErrorInvalidValue;
  if (a.M == 0) return cudaSuccess;
  return a.bf16 ? launch_typed<__nv_bfloat16>(a, stream) : launch_typed<__half>(a, stream);
}

}  // namespace w4a4
