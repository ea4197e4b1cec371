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

enum Part : int { kWait = 1, kFold = 2, kConvert = 4, kBarrier = 8, kSwizzle64 = 16, kFoldPer128 = 32, kCopies = 64 };
constexpr int kSlots = 4;  // ring slots the loop walks through, as the GEMM's 4-deep ring
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

template <int BM>
struct Ring {
  // The activation tiles first, each 16 KB (256 rows) or 8 KB: every tile 512-byte aligned for the swizzle.
  alignas(1024) int8_t act[kSlots][BM * kGroup];
  int4 w[kSlots][128];  // a 16-byte packed weight record per thread
  __half ra[kSlots][BM];
  float ws[kSlots][64];
};

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

template <int BM, int kParts, int kBlocksPerSm>
__global__ void __launch_bounds__(kThreadsPerBlock, kBlocksPerSm)
    loop_kernel(int groups, Sources src, uint32_t* sink) {
  static_assert((kParts & kFold) == 0 || (kParts & kWait) != 0, "the fold reads the sums it waited for");
  static_assert((kParts & kConvert) == 0 || (kParts & kWait) != 0, "A registers are rewritten only after a wait");
  static_assert((kParts & kCopies) == 0 || (kParts & (kWait | kBarrier)) == (kWait | kBarrier),
                "a slot is refilled once every warp's wgmma has read it");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& ring = *reinterpret_cast<Ring<BM>*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, t = lane & 3;

  // Operands, unless the copies bring them: activation bytes 1..7 (e4m3 2^-9 * 1..7, as the quantize kernel
  // writes), weight codes 1..7, scale ratios near those of real data.
  if constexpr ((kParts & kCopies) == 0) {
    for (int i = tid; i < kSlots * BM * kGroup; i += kThreadsPerBlock) (&ring.act[0][0])[i] = 1 + (i * 5 + 3) % 7;
    for (int i = tid; i < kSlots * 128; i += kThreadsPerBlock) {
      const uint32_t c = 0x01010101u * (1 + i % 7) + 0x10101010u * (1 + (i / 7) % 7);
      (&ring.w[0][0])[i] = make_int4(c, c + 0x01000000u, c + 0x00010000u, c + 0x00000100u);
    }
    for (int i = tid; i < kSlots * BM; i += kThreadsPerBlock)
      (&ring.ra[0][0])[i] = __float2half(0.25f + (i % 13) / 17.0f);
    for (int i = tid; i < kSlots * 64; i += kThreadsPerBlock) (&ring.ws[0][0])[i] = 1.0f + (i % 11) / 11.0f;
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
  fence_proxy_async();
  __syncthreads();

  const uint32_t act0 = smem_addr(&ring.act[0][0]);
  const int wrow0 = warp * 16 + (lane >> 2);
  uint32_t acc_h[BM / 4], d[BM / 4];
#pragma unroll
  for (int i = 0; i < BM / 4; ++i) acc_h[i] = d[i] = 0;
  // One pass folds kGroupsPerFold groups' sums: 2 where the scales would cover 128-wide groups.
  constexpr int kGroupsPerFold = (kParts & kFoldPer128) != 0 ? 2 : 1;
  uint32_t a[2 * kGroupsPerFold][4];
#pragma unroll
  for (int s = 0; s < 2 * kGroupsPerFold; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) a[s][i] = 0x03020104u + i;

  for (int g = 0; g < groups; g += kGroupsPerFold) {
    const int slot = g & (kSlots - 1);
#pragma unroll
    for (int s = 0; s < kGroupsPerFold; ++s) {
      if constexpr ((kParts & kConvert) != 0) {
        const int4 wrec = ring.w[slot + s][tid];
        const uint32_t wv[4] = {static_cast<uint32_t>(wrec.x), static_cast<uint32_t>(wrec.y),
                                static_cast<uint32_t>(wrec.z), static_cast<uint32_t>(wrec.w)};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          a[2 * s][i] = e4m3_from_code(wv[i]);
          a[2 * s + 1][i] = e4m3_from_code(wv[i] >> 4);
        }
      }
    }
#pragma unroll
    for (int s = 0; s < 2 * kGroupsPerFold; ++s) fence_operands(a[s]);
    fence_operands(d);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < kGroupsPerFold; ++s) {
      const uint32_t tile = act0 + (slot + s) * BM * kGroup;
      // Without the fold nothing reads a group's sums: accumulate across groups, or the compiler drops the
      // wgmma whose results the next group's fresh start would discard.
      wgmma_e4m3_rs(d, a[2 * s], act_desc<BM, kParts>(tile, 0), (kParts & kFold) != 0 && s == 0 ? 0 : 1);
      wgmma_e4m3_rs(d, a[2 * s + 1], act_desc<BM, kParts>(tile, 1), 1);
    }
    wgmma_commit();
    __half2 rw0 = {}, rw1 = {};
    if constexpr ((kParts & kFold) != 0) {
      rw0 = __float2half2_rn(ring.ws[slot][wrow0]);
      rw1 = __float2half2_rn(ring.ws[slot][wrow0 + 8]);
    }
    if constexpr ((kParts & kCopies) != 0) {
      // Group g + 3 into the slot group g - 1 used (free since the barrier that ended iteration g - 1), then
      // this thread's copies of group g + 1 waited for and fenced for wgmma.
      refill((g + kSlots - 1) & (kSlots - 1), g + kSlots - 1);
      cp_async_commit();
      cp_async_wait<kSlots - 2>();
      fence_proxy_async();
    }
    if constexpr ((kParts & kWait) != 0) {
      wgmma_wait_all();
    } else {
      wgmma_wait_one();
    }
    fence_operands(d);
#pragma unroll
    for (int s = 0; s < 2 * kGroupsPerFold; ++s) fence_operands(a[s]);
    if constexpr ((kParts & kFold) != 0) {
#pragma unroll
      for (int p = 0; p < BM / 32; ++p) {
        fold_ratio_pairs(acc_h, d, p, *reinterpret_cast<const uint4*>(&ring.ra[slot][32 * p + 8 * t]), rw0, rw1);
      }
    }
    if constexpr ((kParts & kBarrier) != 0) __syncthreads();
  }
  wgmma_wait_all();
  fence_operands(d);
  uint32_t x = 0;
#pragma unroll
  for (int i = 0; i < BM / 4; ++i) x ^= acc_h[i] ^ d[i];
  sink[blockIdx.x * kThreadsPerBlock + tid] = x;
}

// One wave of blocks that each walk 1024 groups, or `tiles` blocks of 16 groups (the qkv GEMM's at M = 8192:
// 2048), each block starting with its first stages' copies, as the GEMM's blocks do (no epilogue).
template <int BM, int kParts, int kBlocksPerSm>
void run(const char* name, int sms, const Sources& src, uint32_t* sink, double seconds, bool first, int tiles = 0) {
  constexpr size_t kRingBytes = sizeof(Ring<BM>);
  // Shared memory sized so that exactly kBlocksPerSm blocks fit an SM (228 KB, 1 KB reserved a block).
  const size_t smem = std::max(kRingBytes, static_cast<size_t>(228 * 1024 / kBlocksPerSm - 1024) / 1024 * 1024);
  auto kernel = loop_kernel<BM, kParts, kBlocksPerSm>;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  int fit = 0;
  CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, kThreadsPerBlock, smem));
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
    kernel<<<blocks, kThreadsPerBlock, smem>>>(groups, src, sink);
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
  const double ops = 2.0 * 64 * BM * kGroup * static_cast<double>(groups) * blocks;
  // The qkv GEMM at M = 8192 is 32768 warpgroup-groups of 256-row tiles: its loop at this rate.
  const double qkv8192_us = 2.0 * 8192 * 4096 * 1024 / (ops / median_us);
  std::printf("%s    {\"parts\": \"%s\", \"bm\": %d, \"blocks_per_sm\": %d, \"blocks_fit\": %d, \"registers\": %d, "
              "\"groups_per_block\": %d, \"median_us\": %.2f, \"tops\": %.1f, \"qkv_m8192_loop_us\": %.2f, "
              "\"launches\": %zu, \"wall_start\": %.3f, \"wall_end\": %.3f}",
              first ? "" : ",\n", name, BM, kBlocksPerSm, fit, attr.numRegs, groups, median_us, ops / median_us / 1e6,
              qkv8192_us, ms.size(), wall_start, wall_end);
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
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
  run<128, 0, 4>("raw", sms, src, sink, seconds, false);
  run<128, kWait | kFold, 4>("+wait +fold", sms, src, sink, seconds, false);
  run<128, kLoop, 4>("+wait +fold +convert +barrier", sms, src, sink, seconds, false);
  run<128, kLoop | kCopies, 4>("+wait +fold +convert +barrier +copies", sms, src, sink, seconds, false);
  std::printf("\n]}\n");
  CHECK_CUDA(cudaDeviceSynchronize());
  return 0;
}
