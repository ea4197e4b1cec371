// Host-side entry points of the W4A4 kernels (plain C++; the torch binding lives in binding.cpp).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace w4a4 {

// Rows of the activation buffers are padded to a multiple of this (the GEMM's largest M tile).
constexpr int kMPad = 256;
// The quantized activations: tiles of e4m3 bytes, 128 rows x one 64-wide K group (csrc/w4a4_common.cuh).
constexpr int kActBlockRows = 128;
constexpr int kActTileBytes = kActBlockRows * 64;
// Packed weights are padded with zero rows to a multiple of this (N itself must be a multiple of 64).
constexpr int kBlockN = 128;
// A grouped GEMM (several layers that read one input, their weights stacked along N) has at most this many
// layers; each has its own R low-rank columns, side by side in the activations' low-rank buffer.
constexpr int kMaxSegments = 3;  // q/k/v
// The GEMM's fp16 accumulators gain at most 2^-18 * 3584 * 2^15 = 448 a group (|q| <= 7 in activations):
// 127 groups stay below fp16's largest finite 65504. Both kernels refuse more.
constexpr int kMaxGroups = 127;

struct QuantizeArgs {
  const void* x;            // [M, K] bf16 or fp16, rows ldx elements apart
  const void* norm_weight;  // [K] x's dtype for the RMSNorm prologue, else nullptr
  float eps;                // the RMSNorm's epsilon
  int ldx;                  // row stride of x in elements, a multiple of 4
  const float* smooth;  // [2, K]: smooth and its correctly rounded reciprocal, or nullptr
  const void* pd_t;     // [R, K], x's dtype: proj_down.T / smooth (smoothing folded in); R = 16 * (1..6)
  void* qact;           // int8 [M_pad/128, K/64, 8192]: e4m3 bytes of q in wgmma's layout (w4a4_common.cuh)
  void* aratios;        // fp16 [K/64, M_pad]: scale / amax_row  } columns in activation_scale_position order
  float* amax;          // [M_pad]: each row's largest scale     }
  float* lora;          // [M_pad, R] = x_smoothed @ proj_down, tf32-rounded, columns in lora_position order
  int M, M_pad, K, R;
  bool bf16;
};

struct GemmArgs {
  const void* qact;        // as written by the quantize kernel
  const void* aratios;     // fp16 [K/64, M_pad] } as the quantize kernel writes them
  const float* amax;       // [M_pad]            }
  const void* qweight;     // int32 [N_pad/16, K/64, 32, 4] packed int4, A-fragment layout
  const float* wscales;    // [K/64 + 1, N_pad]: wscale / wmax_row * 2^15 rounded to fp16, then 8 wmax_row
  const float* lora;       // [M_pad, lora_ld] as the quantize kernel writes it
  const float* proj_up;    // [N_pad, R]: output row n's R low-rank weights
  const float* bias;       // [N] or nullptr
  const void* residual;    // [M, N] y's dtype, contiguous, or nullptr: y = T(residual + T(y)) (not with swiglu)
  void* y;                 // [M, N] bf16 or fp16 ([M, N / 2] with swiglu)
  int M, M_pad, N, N_pad, K, R;
  // Segment s (output rows from segment_start[s - 1], multiples of 64, increasing) reads low-rank columns
  // s * R .. s * R + R - 1 of lora; a plain layer is one segment with lora_ld = R.
  int lora_ld, segments;
  int segment_start[kMaxSegments - 1];
  // Gate and up rows interleaved 8 by 8 (one segment, R = 32: both layers' 16 low-rank columns, proj_up block
  // diagonal): y = silu(gate) * up.
  bool swiglu;
  bool bf16;
};

// Qwen3's q/k head norm + RoPE (csrc/qk_norm_rope.cu): head dims 16, 32, 64, 128 and 256, 16-byte aligned rows.
bool qk_norm_rope_supports(int head_dim);

struct QkNormRopeArgs {
  const void* q;         // [tokens, q_heads, D], heads contiguous, tokens q_stride elements apart
  const void* k;         // [tokens, k_heads, D], tokens k_stride elements apart
  const void* q_weight;  // [D] the norms' weights
  const void* k_weight;
  const void* cos;       // [tokens, D] the rotary tables, contiguous
  const void* sin;
  void* q_out;           // [tokens, q_heads, D] contiguous
  void* k_out;           // [tokens, k_heads, D] contiguous
  int64_t q_stride, k_stride;
  int tokens, q_heads, k_heads, D;
  float eps;
  bool bf16;  // else fp16; every tensor has this dtype
};

// Row RMSNorm (csrc/rms_norm.cu): K a multiple of 8, every pointer 16-byte aligned.
struct RmsNormArgs {
  void* x;             // [rows, K] contiguous; with delta, x + delta is written over it before the norm
  const void* delta;   // [rows, K] contiguous, or nullptr
  const void* weight;  // [K]
  void* y;             // [rows, K] contiguous
  int rows, K;
  float eps;
  bool bf16;  // else fp16; every tensor has this dtype
};

// silu(gate) * up elementwise (csrc/silu_mul.cu): numel a multiple of 8, every pointer 16-byte aligned.
struct SiluMulArgs {
  const void* gate;  // [rows, cols], rows gate_ld elements apart (gate and up may be halves of one tensor)
  const void* up;    // [rows, cols], rows up_ld elements apart
  void* out;         // [rows, cols] contiguous
  int64_t rows, gate_ld, up_ld;  // cols and both strides multiples of 8, pointers 16-byte aligned
  int cols;
  bool bf16;  // else fp16; every tensor has this dtype
};

// The codec's Snake activation (csrc/snake.cu) over float32 [rows = batch * channels, length], contiguous.
struct SnakeArgs {
  const float* x;          // [rows, length]
  const float* alpha;      // [channels]; row r has channel r % channels
  const float* inv_alpha;  // [channels]: 1 / (alpha + 1e-9), as torch computes it
  const float* bias;       // [channels] added to x first, or nullptr
  const int64_t* limits;   // [rows / channels]: each item's valid length, past which out is 0; or nullptr
  float* out;              // [rows, length]
  int64_t rows, length;
  int channels;
};

// Row-wise e4m3 quantization of an FP8 linear's input in the kernel that produces it (csrc/fp8_quantize.cu).
enum class Fp8Source { kCopy, kRmsNorm, kAddRmsNorm, kSiluMul };
constexpr float kFp8MinAmax = 1e-12f;  // a row of zeros gets this tiny scale, not 0 (its codes are 0 either way)
constexpr int kFp8MaxK = 3072;         // a row is held in registers: 12 16-byte pieces per lane of a warp
struct Fp8QuantizeArgs {
  void* x;              // [rows, K], rows x_ld elements apart (silu_mul: gate); add_rms_norm writes x + delta
  int64_t x_ld;         //   over it, then norms that
  const void* delta;    // add_rms_norm: [rows, K] contiguous
  const void* second;   // (add_)rms_norm: the norm weight [K]; silu_mul: up [rows, K], rows second_ld apart
  int64_t second_ld;
  void* q;              // [rows, K] e4m3 codes, contiguous
  float* scale;         // [rows]
  int rows, K;          // K a multiple of 8, at most kFp8MaxK; pointers and row strides 16-byte aligned
  float eps;            // (add_)rms_norm only
  bool bf16;            // else fp16; x and second have this dtype
};

// Multiprocessors of the current device (the launchers size their grids by it), queried once per device.
inline cudaError_t sm_count(int* sms) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};  // 0: not queried yet; concurrent first calls store the same value
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device < kMaxDevices && cached[device] > 0) {
    *sms = cached[device];
    return cudaSuccess;
  }
  err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess && device < kMaxDevices) cached[device] = *sms;
  return err;
}

cudaError_t launch_quantize_act_lora_down(const QuantizeArgs& args, cudaStream_t stream);
cudaError_t launch_w4a4_gemm_lora_up(const GemmArgs& args, cudaStream_t stream);
// How many warpgroups split the K groups of each block of that GEMM (its fold order: emulate_gemm_fold).
cudaError_t w4a4_gemm_k_splits(int M, int N, int K, int* k_splits);
cudaError_t launch_qk_norm_rope(const QkNormRopeArgs& args, cudaStream_t stream);
cudaError_t launch_rms_norm(const RmsNormArgs& args, cudaStream_t stream);
cudaError_t launch_silu_mul(const SiluMulArgs& args, cudaStream_t stream);
cudaError_t launch_snake(const SnakeArgs& args, cudaStream_t stream);
cudaError_t launch_fp8_quantize(const Fp8QuantizeArgs& args, Fp8Source source, cudaStream_t stream);

}  // namespace w4a4
