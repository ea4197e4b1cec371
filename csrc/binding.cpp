// torch.library registration of the W4A4 ops (namespace ovbatch_w4a4). Shapes and dtypes are checked here,
// so a wrong call fails with a message instead of reading out of bounds. Fake (meta) implementations,
// used by CUDA-graph capture and torch.compile, are registered in engine/kernels/ops.py.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include "w4a4_launch.h"

namespace {

using torch::Tensor;

constexpr int64_t kGroup = 64;

int64_t pad_rows(int64_t m) { return (m + w4a4::kMPad - 1) / w4a4::kMPad * w4a4::kMPad; }

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "ovbatch_w4a4: ", what, " launch failed: ", cudaGetErrorString(err));
}

void check_cuda(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "ovbatch_w4a4: ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.is_contiguous(), "ovbatch_w4a4: ", name, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "ovbatch_w4a4: ", name,
              " must be 16-byte aligned (pass a fresh contiguous tensor)");
}

void check_dtype(const Tensor& t, at::ScalarType want, const char* name) {
  TORCH_CHECK(t.scalar_type() == want, "ovbatch_w4a4: ", name, " must be ", want, ", got ", t.scalar_type());
}

void check_half(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, "ovbatch_w4a4: ", name,
              " must be bfloat16 or float16, got ", t.scalar_type());
}

// A [M, K] input whose rows may be `ld` elements apart (a slice of a wider output), unit column stride.
void check_rows(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "ovbatch_w4a4: ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.size(1) % kGroup == 0, "ovbatch_w4a4: ", name,
              " must be [M, K] with K a multiple of 64, got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1 && (t.size(0) <= 1 || t.stride(0) % 4 == 0) &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 8 == 0,
              "ovbatch_w4a4: ", name, " needs unit column stride, a row stride that is a multiple of 4 and ",
              "8-byte alignment, got strides ", t.strides(), " (pass a contiguous tensor)");
  check_half(t, name);
}

// Activation quantization + low-rank down-projection of the input `a` describes (x, or a prologue of it):
// -> (qact int8 [M_pad/128, K/64, 8192] of e4m3 bytes, aratios fp16 [K/64, M_pad] (each scale over its row's
// largest), amax f32 [M_pad] (that largest), lora f32 [M_pad, R]).
std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_input(const Tensor& x, const std::optional<Tensor>& smooth,
                                                  const Tensor& pd_t, w4a4::QuantizeArgs a) {
  check_rows(x, "x");
  check_cuda(pd_t, "pd_t");
  check_dtype(pd_t, x.scalar_type(), "pd_t");
  const int64_t M = x.size(0), K = x.size(1), R = pd_t.size(0);
  TORCH_CHECK(pd_t.dim() == 2 && pd_t.size(1) == K && (R == 16 || R == 32 || R == 48 || R == 64 || R == 96),
              "ovbatch_w4a4: pd_t must be [R, K] with R 16, 32 (one layer) or 48, 64, 96 (a group of layers) and K = ",
              K, ", got ", pd_t.sizes());
  if (smooth) {
    check_cuda(*smooth, "smooth");
    check_dtype(*smooth, at::kFloat, "smooth");
    TORCH_CHECK(smooth->dim() == 2 && smooth->size(0) == 2 && smooth->size(1) == K,
                "ovbatch_w4a4: smooth must be [2, K = ", K, "] (smooth, 1 / smooth), got ", smooth->sizes());
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t M_pad = pad_rows(M);
  auto f32 = x.options().dtype(at::kFloat);
  Tensor qact =
      torch::empty({M_pad / w4a4::kActBlockRows, K / kGroup, w4a4::kActTileBytes}, x.options().dtype(at::kChar));
  TORCH_CHECK(K / kGroup <= w4a4::kMaxGroups, "ovbatch_w4a4: K = ", K, " has more than ", w4a4::kMaxGroups,
              " groups of 64, the most the W4A4 kernels take (K <= ", w4a4::kMaxGroups * kGroup, ")");
  Tensor aratios = torch::empty({K / kGroup, M_pad}, x.options().dtype(at::kHalf));
  Tensor amax = torch::empty({M_pad}, f32);
  Tensor lora = torch::empty({M_pad, R}, f32);
  a.x = x.data_ptr();
  a.ldx = static_cast<int>(M > 1 ? x.stride(0) : K);
  a.smooth = smooth ? smooth->data_ptr<float>() : nullptr;
  a.pd_t = pd_t.data_ptr();
  a.qact = qact.data_ptr();
  a.aratios = aratios.data_ptr();
  a.amax = amax.data_ptr<float>();
  a.lora = lora.data_ptr<float>();
  a.M = static_cast<int>(M);
  a.M_pad = static_cast<int>(M_pad);
  a.K = static_cast<int>(K);
  a.R = static_cast<int>(R);
  a.bf16 = x.scalar_type() == at::kBFloat16;
  check_launch(w4a4::launch_quantize_act_lora_down(a, c10::cuda::getCurrentCUDAStream()), "quantize_act_lora_down");
  return {qact, aratios, amax, lora};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_act_lora_down(const Tensor& x,
                                                                  const std::optional<Tensor>& smooth,
                                                                  const Tensor& pd_t) {
  return quantize_input(x, smooth, pd_t, w4a4::QuantizeArgs{});
}

// The same on RMSNorm(x) with weight `norm_weight` [K], computed in the kernel.
std::tuple<Tensor, Tensor, Tensor, Tensor> rmsnorm_quantize_act_lora_down(const Tensor& x,
                                                                          const Tensor& norm_weight, double eps,
                                                                          const std::optional<Tensor>& smooth,
                                                                          const Tensor& pd_t) {
  check_cuda(norm_weight, "norm_weight");
  check_dtype(norm_weight, x.scalar_type(), "norm_weight");
  TORCH_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == x.size(-1), "ovbatch_w4a4: norm_weight must be [",
              x.size(-1), "], got ", norm_weight.sizes());
  w4a4::QuantizeArgs a{};
  a.norm_weight = norm_weight.data_ptr();
  a.eps = static_cast<float>(eps);
  return quantize_input(x, smooth, pd_t, a);
}

// q [T, Hq, D], k [T, Hk, D] (token rows may be strided) -> normed and rotated, contiguous.
std::tuple<Tensor, Tensor> qk_norm_rope(const Tensor& q, const Tensor& k, const Tensor& q_weight,
                                        const Tensor& k_weight, const Tensor& cos, const Tensor& sin, double eps) {
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}}) {
    TORCH_CHECK(t->is_cuda() && t->dim() == 3, "ovbatch_w4a4: ", name, " must be a CUDA [tokens, heads, D], got ",
                t->sizes(), " on ", t->device());
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2), "ovbatch_w4a4: ", name,
                " must have contiguous heads (strides [*, D, 1]), got ", t->strides());
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0 && (t->size(0) <= 1 || t->stride(0) % 8 == 0),
                "ovbatch_w4a4: ", name, " needs 16-byte aligned token rows, got strides ", t->strides());
    check_half(*t, name);
  }
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && k.size(2) == D && k.scalar_type() == q.scalar_type(),
              "ovbatch_w4a4: k ", k.sizes(), " does not match q ", q.sizes());
  TORCH_CHECK(w4a4::qk_norm_rope_supports(static_cast<int>(D)), "ovbatch_w4a4: head dim ", D,
              " is not one of 16, 32, 64, 128, 256");
  for (auto [t, name, want] : {std::tuple{&q_weight, "q_weight", std::vector<int64_t>{D}},
                               {&k_weight, "k_weight", std::vector<int64_t>{D}}, {&cos, "cos", std::vector<int64_t>{T, D}},
                               {&sin, "sin", std::vector<int64_t>{T, D}}}) {
    check_cuda(*t, name);
    check_dtype(*t, q.scalar_type(), name);
    TORCH_CHECK(t->sizes() == torch::IntArrayRef(want), "ovbatch_w4a4: ", name, " must be ",
                torch::IntArrayRef(want), ", got ", t->sizes());
  }
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor q_out = torch::empty(q.sizes(), q.options());
  Tensor k_out = torch::empty(k.sizes(), k.options());
  w4a4::QkNormRopeArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.q_weight = q_weight.data_ptr();
  a.k_weight = k_weight.data_ptr();
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.q_out = q_out.data_ptr();
  a.k_out = k_out.data_ptr();
  a.q_stride = q.stride(0);
  a.k_stride = k.stride(0);
  a.tokens = static_cast<int>(T);
  a.q_heads = static_cast<int>(q.size(1));
  a.k_heads = static_cast<int>(k.size(1));
  a.D = static_cast<int>(D);
  a.eps = static_cast<float>(eps);
  a.bf16 = q.scalar_type() == at::kBFloat16;
  check_launch(w4a4::launch_qk_norm_rope(a, c10::cuda::getCurrentCUDAStream()), "qk_norm_rope");
  return {q_out, k_out};
}

// The residual stream x and the block output delta added to it in place: one contiguous [rows, K] shape and
// dtype on one device, 16-byte aligned (the kernels read 16 bytes at a time).
void check_residual_pair(const Tensor& x, const Tensor& delta) {
  check_cuda(delta, "delta");
  check_dtype(delta, x.scalar_type(), "delta");
  TORCH_CHECK(delta.sizes() == x.sizes(), "ovbatch_w4a4: delta ", delta.sizes(), " must have x's shape ", x.sizes());
  for (auto [t, name] : {std::pair{&x, "x"}, {&delta, "delta"}})
    TORCH_CHECK(t->is_contiguous() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, "ovbatch_w4a4: ", name,
                " must be contiguous and 16-byte aligned for the residual add, got strides ", t->strides());
}

// x [rows, K] -> RMSNorm(x) with weight [K] (K a multiple of 8); with delta [rows, K], x + delta is first
// written over x (the residual add before the norm) and normed.
Tensor rms_norm_impl(const Tensor& x, const Tensor* delta, const Tensor& weight, double eps) {
  check_cuda(x, "x");
  check_cuda(weight, "weight");
  check_half(x, "x");
  check_dtype(weight, x.scalar_type(), "weight");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 8 == 0, "ovbatch_w4a4: x must be [rows, K] with K a multiple of 8, got ",
              x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "ovbatch_w4a4: weight must be [", x.size(1),
              "], got ", weight.sizes());
  if (delta != nullptr) check_residual_pair(x, *delta);
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor y = torch::empty_like(x);
  w4a4::RmsNormArgs a{};
  a.x = x.data_ptr();
  a.delta = delta != nullptr ? delta->data_ptr() : nullptr;
  a.weight = weight.data_ptr();
  a.y = y.data_ptr();
  a.rows = static_cast<int>(x.size(0));
  a.K = static_cast<int>(x.size(1));
  a.eps = static_cast<float>(eps);
  a.bf16 = x.scalar_type() == at::kBFloat16;
  check_launch(w4a4::launch_rms_norm(a, c10::cuda::getCurrentCUDAStream()), "rms_norm");
  return y;
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) { return rms_norm_impl(x, nullptr, weight, eps); }

Tensor add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps) {
  return rms_norm_impl(x, &delta, weight, eps);
}

// silu(gate) * up for gate and up [rows, cols] (cols a multiple of 8; rows may be strided, e.g. the two halves
// of a grouped gate/up output) -> contiguous [rows, cols].
Tensor silu_mul(const Tensor& gate, const Tensor& up) {
  for (auto [t, name] : {std::pair{&gate, "gate"}, {&up, "up"}}) {
    TORCH_CHECK(t->is_cuda() && t->dim() == 2, "ovbatch_w4a4: ", name, " must be a CUDA [rows, cols], got ",
                t->sizes(), " on ", t->device());
    TORCH_CHECK(t->stride(1) == 1 && (t->size(0) <= 1 || t->stride(0) % 8 == 0) &&
                    reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "ovbatch_w4a4: ", name, " needs unit column stride, a row stride that is a multiple of 8 and ",
                "16-byte alignment, got strides ", t->strides());
  }
  check_half(gate, "gate");
  check_dtype(up, gate.scalar_type(), "up");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.size(1) % 8 == 0, "ovbatch_w4a4: gate ", gate.sizes(), " and up ",
              up.sizes(), " must have one shape with a multiple of 8 columns");
  const c10::cuda::CUDAGuard guard(gate.device());
  Tensor out = torch::empty(gate.sizes(), gate.options());
  w4a4::SiluMulArgs a{};
  a.gate = gate.data_ptr();
  a.up = up.data_ptr();
  a.out = out.data_ptr();
  a.rows = gate.size(0);
  a.cols = static_cast<int>(gate.size(1));
  a.gate_ld = gate.size(0) > 1 ? gate.stride(0) : gate.size(1);
  a.up_ld = up.size(0) > 1 ? up.stride(0) : up.size(1);
  a.bf16 = gate.scalar_type() == at::kBFloat16;
  check_launch(w4a4::launch_silu_mul(a, c10::cuda::getCurrentCUDAStream()), "silu_mul");
  return out;
}

// The codec's Snake activation of x [batch, channels, length] (float32, contiguous) with alpha and
// inv_alpha = 1 / (alpha + 1e-9), one each per channel (float32, contiguous) -> a new [batch, channels, length].
// bias: one per channel (float32), added to x first; limits: each item's valid length (int64 [batch]), past
// which the output is 0.
Tensor snake(const Tensor& x, const Tensor& alpha, const Tensor& inv_alpha, const std::optional<Tensor>& bias,
             const std::optional<Tensor>& limits) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.is_contiguous(), "ovbatch_w4a4: x must be a contiguous CUDA ",
              "[batch, channels, length], got ", x.sizes(), " on ", x.device());
  check_dtype(x, at::kFloat, "x");
  std::vector<std::pair<const Tensor*, const char*>> per_channel{{&alpha, "alpha"}, {&inv_alpha, "inv_alpha"}};
  if (bias) per_channel.emplace_back(&*bias, "bias");
  for (auto [t, name] : per_channel) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous() && t->numel() == x.size(1), "ovbatch_w4a4: ", name,
                " must be a contiguous CUDA tensor of ", x.size(1), " values (one per channel), got ", t->sizes());
    check_dtype(*t, at::kFloat, name);
  }
  if (limits) {
    TORCH_CHECK(limits->is_cuda() && limits->is_contiguous() && limits->numel() == x.size(0), "ovbatch_w4a4: ",
                "limits must be a contiguous CUDA tensor of ", x.size(0), " lengths (one per item), got ",
                limits->sizes());
    check_dtype(*limits, at::kLong, "limits");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor out = torch::empty(x.sizes(), x.options());
  w4a4::SnakeArgs a{};
  a.x = x.data_ptr<float>();
  a.alpha = alpha.data_ptr<float>();
  a.inv_alpha = inv_alpha.data_ptr<float>();
  a.bias = bias ? bias->data_ptr<float>() : nullptr;
  a.limits = limits ? limits->data_ptr<int64_t>() : nullptr;
  a.out = out.data_ptr<float>();
  a.rows = x.size(0) * x.size(1);
  a.length = x.size(2);
  a.channels = static_cast<int>(x.size(1));
  check_launch(w4a4::launch_snake(a, c10::cuda::getCurrentCUDAStream()), "snake");
  return out;
}

// Row-wise e4m3 codes [rows, K] and scales [rows, 1] (float32) of x, RMSNorm(x) or silu(gate) * up: the
// operands _scaled_mm takes with scale_a.
std::tuple<Tensor, Tensor> fp8_quantize_rows(const Tensor& x, const Tensor* second, int64_t second_ld, double eps,
                                             w4a4::Fp8Source source, const Tensor* delta = nullptr) {
  const c10::cuda::CUDAGuard guard(x.device());
  Tensor q = torch::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  Tensor scale = torch::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
  w4a4::Fp8QuantizeArgs a{};
  a.x = x.data_ptr();
  a.x_ld = x.size(0) > 1 ? x.stride(0) : x.size(1);
  a.delta = delta != nullptr ? delta->data_ptr() : nullptr;
  a.second = second ? second->data_ptr() : nullptr;
  a.second_ld = second_ld;
  a.q = q.data_ptr();
  a.scale = scale.data_ptr<float>();
  a.rows = static_cast<int>(x.size(0));
  a.K = static_cast<int>(x.size(1));
  a.eps = static_cast<float>(eps);
  a.bf16 = x.scalar_type() == at::kBFloat16;
  check_launch(w4a4::launch_fp8_quantize(a, source, c10::cuda::getCurrentCUDAStream()), "fp8_quantize");
  return {q, scale};
}

void check_fp8_rows(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.dim() == 2 && t.size(1) % 8 == 0 && t.size(1) <= w4a4::kFp8MaxK, "ovbatch_w4a4: ",
              name, " must be a CUDA [rows, K] with K a multiple of 8 up to ", w4a4::kFp8MaxK, ", got ", t.sizes(),
              " on ", t.device());
  TORCH_CHECK(t.stride(1) == 1 && (t.size(0) <= 1 || t.stride(0) % 8 == 0) &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "ovbatch_w4a4: ", name, " needs unit column stride, a row stride that is a multiple of 8 and ",
              "16-byte alignment, got strides ", t.strides());
  check_half(t, name);
}

std::tuple<Tensor, Tensor> fp8_quantize(const Tensor& x) {
  check_fp8_rows(x, "x");
  return fp8_quantize_rows(x, nullptr, 0, 0.0, w4a4::Fp8Source::kCopy);
}

void check_norm_weight(const Tensor& x, const Tensor& weight) {
  check_cuda(weight, "weight");
  check_dtype(weight, x.scalar_type(), "weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "ovbatch_w4a4: weight must be [", x.size(1),
              "], got ", weight.sizes());
}

std::tuple<Tensor, Tensor> rms_norm_fp8(const Tensor& x, const Tensor& weight, double eps) {
  check_fp8_rows(x, "x");
  check_norm_weight(x, weight);
  return fp8_quantize_rows(x, &weight, 0, eps, w4a4::Fp8Source::kRmsNorm);
}

// Codes of RMSNorm(x + delta), x + delta written over x.
std::tuple<Tensor, Tensor> add_rms_norm_fp8(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps) {
  check_fp8_rows(x, "x");
  check_residual_pair(x, delta);
  check_norm_weight(x, weight);
  return fp8_quantize_rows(x, &weight, 0, eps, w4a4::Fp8Source::kAddRmsNorm, &delta);
}

std::tuple<Tensor, Tensor> silu_mul_fp8(const Tensor& gate, const Tensor& up) {
  check_fp8_rows(gate, "gate");
  check_fp8_rows(up, "up");
  check_dtype(up, gate.scalar_type(), "up");
  TORCH_CHECK(gate.sizes() == up.sizes(), "ovbatch_w4a4: gate ", gate.sizes(), " and up ", up.sizes(),
              " must have one shape");
  return fp8_quantize_rows(gate, &up, up.size(0) > 1 ? up.stride(0) : up.size(1), 0.0, w4a4::Fp8Source::kSiluMul);
}

// Packed activations of M real rows times packed weights of N real columns -> y [M, N] in out_dtype.
// segment_starts: for a group of layers stacked along N, the first output column of each layer after the
// first (multiples of 64); layer s reads low-rank columns s * R .. s * R + R - 1 of lora.
// swiglu: the N rows are gate and up rows interleaved 8 by 8 (engine/kernels/w4a4.py swiglu_row_order) with
// a block-diagonal proj_up [N_pad, 32] -> y = silu(gate) * up [M, N / 2].
// residual [M, N] in out_dtype -> y = residual + y, rounded as torch adds them (not with swiglu).
Tensor gemm_lora_up(const Tensor& qact, const Tensor& aratios, const Tensor& amax, const Tensor& lora,
                    const Tensor& qweight, const Tensor& wscales, const Tensor& proj_up,
                    const std::optional<Tensor>& bias, int64_t M, int64_t N, at::ScalarType out_dtype,
                    at::IntArrayRef segment_starts, bool swiglu, const std::optional<Tensor>& residual) {
  for (auto [t, name] : {std::pair{&qact, "qact"}, {&aratios, "aratios"}, {&amax, "amax"}, {&lora, "lora"},
                         {&qweight, "qweight"}, {&wscales, "wscales"}, {&proj_up, "proj_up"}}) {
    check_cuda(*t, name);
  }
  check_dtype(qact, at::kChar, "qact");
  check_dtype(qweight, at::kInt, "qweight");
  check_dtype(aratios, at::kHalf, "aratios");
  check_dtype(amax, at::kFloat, "amax");
  check_dtype(lora, at::kFloat, "lora");
  check_dtype(wscales, at::kFloat, "wscales");
  check_dtype(proj_up, at::kFloat, "proj_up");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf, "ovbatch_w4a4: out_dtype must be bf16 or fp16");
  TORCH_CHECK(qact.dim() == 3 && qact.size(2) == w4a4::kActTileBytes,
              "ovbatch_w4a4: qact must be [M_pad/128, K/64, 8192] as quantize_act_lora_down writes it, got ",
              qact.sizes());
  const int64_t M_pad = qact.size(0) * w4a4::kActBlockRows, G = qact.size(1), K = G * kGroup;
  const int64_t N_pad = qweight.size(0) * 16, R = proj_up.size(1);
  const int64_t segments = static_cast<int64_t>(segment_starts.size()) + 1;
  TORCH_CHECK(segments <= w4a4::kMaxSegments, "ovbatch_w4a4: at most ", w4a4::kMaxSegments,
              " layers in a group, got segment_starts ", segment_starts);
  for (size_t s = 0; s < segment_starts.size(); ++s)
    TORCH_CHECK(segment_starts[s] % kGroup == 0 && segment_starts[s] > (s ? segment_starts[s - 1] : 0) &&
                    segment_starts[s] < N,
                "ovbatch_w4a4: segment_starts must be increasing multiples of 64 inside (0, N = ", N, "), got ",
                segment_starts);
  TORCH_CHECK(M_pad % w4a4::kMPad == 0 && M >= 0 && M <= M_pad, "ovbatch_w4a4: M = ", M,
              " does not fit the quantized activations of ", M_pad, " rows");
  TORCH_CHECK(qweight.dim() == 3 && qweight.size(1) == G && qweight.size(2) == 128 && N_pad % w4a4::kBlockN == 0,
              "ovbatch_w4a4: qweight must be [N_pad/16, ", G, ", 128] with N_pad a multiple of 128, got ",
              qweight.sizes());
  TORCH_CHECK(N % kGroup == 0 && N <= N_pad && N > N_pad - w4a4::kBlockN, "ovbatch_w4a4: N = ", N,
              " must be a multiple of 64 matching the packed weights of ", N_pad, " rows");
  TORCH_CHECK(G <= w4a4::kMaxGroups, "ovbatch_w4a4: K = ", K, " has more than ", w4a4::kMaxGroups,
              " groups of 64, the most the GEMM's fp16 accumulators hold (K <= ", w4a4::kMaxGroups * kGroup, ")");
  TORCH_CHECK(aratios.sizes() == torch::IntArrayRef({G, M_pad}) && amax.sizes() == torch::IntArrayRef({M_pad}),
              "ovbatch_w4a4: aratios and amax must be [", G, ", ", M_pad, "] and [", M_pad,
              "] as quantize_act_lora_down writes them, got ", aratios.sizes(), " and ", amax.sizes());
  TORCH_CHECK(R == 16 || R == 32, "ovbatch_w4a4: proj_up must be [N_pad, R] with R 16 or 32, got ",
              proj_up.sizes());
  TORCH_CHECK(lora.dim() == 2 && lora.size(0) == M_pad && lora.size(1) == segments * R, "ovbatch_w4a4: lora must be [",
              M_pad, ", ", segments * R, "] (", segments, " layers of rank ", R, "), got ", lora.sizes());
  TORCH_CHECK(wscales.sizes() == torch::IntArrayRef({G + 1, N_pad}), "ovbatch_w4a4: wscales must be [", G + 1, ", ",
              N_pad, "] (kernel_weight_scales), got ", wscales.sizes());
  TORCH_CHECK(proj_up.sizes() == torch::IntArrayRef({N_pad, R}), "ovbatch_w4a4: proj_up must be [", N_pad, ", ", R,
              "], got ", proj_up.sizes());
  TORCH_CHECK(!swiglu || (segments == 1 && R == 32),
              "ovbatch_w4a4: swiglu takes one segment of interleaved gate/up rows with proj_up [N_pad, 32] (two rank-16 "
              "layers), got segment_starts ",
              segment_starts, " and R = ", R);
  if (residual) {
    check_cuda(*residual, "residual");
    check_dtype(*residual, out_dtype, "residual");
    TORCH_CHECK(!swiglu && residual->sizes() == torch::IntArrayRef({M, N}), "ovbatch_w4a4: residual must be [", M,
                ", ", N, "] (the output's shape; not with swiglu), got ", residual->sizes());
  }
  if (bias) {
    check_cuda(*bias, "bias");
    check_dtype(*bias, at::kFloat, "bias");
    TORCH_CHECK(bias->numel() == N, "ovbatch_w4a4: bias must have N = ", N, " elements, got ", bias->numel());
  }
  const c10::cuda::CUDAGuard guard(qact.device());
  Tensor y = torch::empty({M, swiglu ? N / 2 : N}, qact.options().dtype(out_dtype));
  w4a4::GemmArgs a{};
  a.qact = qact.data_ptr();
  a.aratios = aratios.data_ptr();
  a.amax = amax.data_ptr<float>();
  a.qweight = qweight.data_ptr();
  a.wscales = wscales.data_ptr<float>();
  a.lora = lora.data_ptr<float>();
  a.proj_up = proj_up.data_ptr<float>();
  a.bias = bias ? bias->data_ptr<float>() : nullptr;
  a.y = y.data_ptr();
  a.M = static_cast<int>(M);
  a.M_pad = static_cast<int>(M_pad);
  a.N = static_cast<int>(N);
  a.N_pad = static_cast<int>(N_pad);
  a.K = static_cast<int>(K);
  a.R = static_cast<int>(R);
  a.lora_ld = static_cast<int>(segments * R);
  a.segments = static_cast<int>(segments);
  for (size_t s = 0; s < segment_starts.size(); ++s) a.segment_start[s] = static_cast<int>(segment_starts[s]);
  a.swiglu = swiglu;
  a.residual = residual ? residual->data_ptr() : nullptr;
  a.bf16 = out_dtype == at::kBFloat16;
  check_launch(w4a4::launch_w4a4_gemm_lora_up(a, c10::cuda::getCurrentCUDAStream()), "w4a4_gemm_lora_up");
  return y;
}

int64_t gemm_k_splits(int64_t M, int64_t N, int64_t K) {
  int k_splits = 0;
  check_launch(w4a4::w4a4_gemm_k_splits(static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), &k_splits),
               "gemm_k_splits");
  return k_splits;
}

// The whole W4A4 linear on x [M, K]: both kernels, intermediates from the caching allocator.
Tensor w4a4_linear(const Tensor& x, const std::optional<Tensor>& smooth, const Tensor& pd_t, const Tensor& qweight,
                   const Tensor& wscales, const Tensor& proj_up, const std::optional<Tensor>& bias, int64_t N) {
  auto [qact, aratios, amax, lora] = quantize_act_lora_down(x, smooth, pd_t);
  return gemm_lora_up(qact, aratios, amax, lora, qweight, wscales, proj_up, bias, x.size(0), N, x.scalar_type(),
                      {}, false, std::nullopt);
}

}  // namespace

TORCH_LIBRARY(ovbatch_w4a4, m) {
  m.def("quantize_act_lora_down(Tensor x, Tensor? smooth, Tensor pd_t) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "rmsnorm_quantize_act_lora_down(Tensor x, Tensor norm_weight, float eps, Tensor? smooth, Tensor pd_t) -> "
      "(Tensor, Tensor, Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("snake(Tensor x, Tensor alpha, Tensor inv_alpha, Tensor? bias=None, Tensor? limits=None) -> Tensor");
  m.def("fp8_quantize(Tensor x) -> (Tensor, Tensor)");
  m.def("rms_norm_fp8(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("add_rms_norm_fp8(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul_fp8(Tensor gate, Tensor up) -> (Tensor, Tensor)");
  m.def(
      "qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, Tensor sin, float eps) -> "
      "(Tensor, Tensor)");
  m.def(
      "gemm_lora_up(Tensor qact, Tensor aratios, Tensor amax, Tensor lora, Tensor qweight, Tensor wscales, "
      "Tensor proj_up, Tensor? bias, int M, int N, ScalarType out_dtype, int[] segment_starts=[], "
      "bool swiglu=False, Tensor? residual=None) -> Tensor");
  m.def("gemm_k_splits(int M, int N, int K) -> int", &gemm_k_splits);
  m.def(
      "w4a4_linear(Tensor x, Tensor? smooth, Tensor pd_t, Tensor qweight, Tensor wscales, Tensor proj_up, "
      "Tensor? bias, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(ovbatch_w4a4, CUDA, m) {
  m.impl("quantize_act_lora_down", &quantize_act_lora_down);
  m.impl("rmsnorm_quantize_act_lora_down", &rmsnorm_quantize_act_lora_down);
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("snake", &snake);
  m.impl("fp8_quantize", &fp8_quantize);
  m.impl("rms_norm_fp8", &rms_norm_fp8);
  m.impl("add_rms_norm_fp8", &add_rms_norm_fp8);
  m.impl("silu_mul_fp8", &silu_mul_fp8);
  m.impl("gemm_lora_up", &gemm_lora_up);
  m.impl("w4a4_linear", &w4a4_linear);
}
