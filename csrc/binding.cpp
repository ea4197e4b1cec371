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

// x [M, K] bf16/fp16 -> (qact int32 [M_pad/16, K/64, 128], ascales f32 [K/64, M_pad], lora f32 [M_pad, R]).
std::tuple<Tensor, Tensor, Tensor> quantize_act_lora_down(const Tensor& x, const std::optional<Tensor>& smooth,
                                                          const Tensor& pd_t) {
  check_cuda(x, "x");
  check_cuda(pd_t, "pd_t");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kGroup == 0, "ovbatch_w4a4: x must be [M, K] with K a multiple of 64, got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "ovbatch_w4a4: x must be bfloat16 or float16, got ", x.scalar_type());
  check_dtype(pd_t, x.scalar_type(), "pd_t");
  const int64_t M = x.size(0), K = x.size(1), R = pd_t.size(0);
  TORCH_CHECK(pd_t.dim() == 2 && pd_t.size(1) == K && (R == 16 || R == 32),
              "ovbatch_w4a4: pd_t must be [R, K] with R 16 or 32 and K = ", K, ", got ", pd_t.sizes());
  if (smooth) {
    check_cuda(*smooth, "smooth");
    check_dtype(*smooth, at::kFloat, "smooth");
    TORCH_CHECK(smooth->dim() == 2 && smooth->size(0) == 2 && smooth->size(1) == K,
                "ovbatch_w4a4: smooth must be [2, K = ", K, "] (smooth, 1 / smooth), got ", smooth->sizes());
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t M_pad = pad_rows(M);
  auto i32 = x.options().dtype(at::kInt);
  auto f32 = x.options().dtype(at::kFloat);
  Tensor qact = torch::empty({M_pad / 16, K / kGroup, 128}, i32);
  Tensor ascales = torch::empty({K / kGroup, M_pad}, f32);
  Tensor lora = torch::empty({M_pad, R}, f32);
  w4a4::QuantizeArgs a{};
  a.x = x.data_ptr();
  a.smooth = smooth ? smooth->data_ptr<float>() : nullptr;
  a.pd_t = pd_t.data_ptr();
  a.qact = qact.data_ptr();
  a.ascales = ascales.data_ptr<float>();
  a.lora = lora.data_ptr<float>();
  a.M = static_cast<int>(M);
  a.M_pad = static_cast<int>(M_pad);
  a.K = static_cast<int>(K);
  a.R = static_cast<int>(R);
  a.bf16 = x.scalar_type() == at::kBFloat16;
  check_launch(w4a4::launch_quantize_act_lora_down(a, c10::cuda::getCurrentCUDAStream()), "quantize_act_lora_down");
  return {qact, ascales, lora};
}

// Packed activations of M real rows times packed weights of N real columns -> y [M, N] in out_dtype.
Tensor gemm_lora_up(const Tensor& qact, const Tensor& ascales, const Tensor& lora, const Tensor& qweight,
                    const Tensor& wscales, const Tensor& proj_up, const std::optional<Tensor>& bias, int64_t M,
                    int64_t N, at::ScalarType out_dtype) {
  for (auto [t, name] : {std::pair{&qact, "qact"}, {&ascales, "ascales"}, {&lora, "lora"}, {&qweight, "qweight"},
                         {&wscales, "wscales"}, {&proj_up, "proj_up"}}) {
    check_cuda(*t, name);
  }
  check_dtype(qact, at::kInt, "qact");
  check_dtype(qweight, at::kInt, "qweight");
  check_dtype(ascales, at::kFloat, "ascales");
  check_dtype(lora, at::kFloat, "lora");
  check_dtype(wscales, at::kFloat, "wscales");
  check_dtype(proj_up, at::kFloat, "proj_up");
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf, "ovbatch_w4a4: out_dtype must be bf16 or fp16");
  TORCH_CHECK(qact.dim() == 3 && qact.size(2) == 128, "ovbatch_w4a4: qact must be [M_pad/16, K/64, 128], got ",
              qact.sizes());
  const int64_t M_pad = qact.size(0) * 16, G = qact.size(1), K = G * kGroup;
  const int64_t N_pad = qweight.size(0) * 16, R = lora.size(1);
  TORCH_CHECK(M_pad % w4a4::kMPad == 0 && M >= 0 && M <= M_pad, "ovbatch_w4a4: M = ", M,
              " does not fit the packed activations of ", M_pad, " rows");
  TORCH_CHECK(qweight.dim() == 3 && qweight.size(1) == G && qweight.size(2) == 128 && N_pad % w4a4::kBlockN == 0,
              "ovbatch_w4a4: qweight must be [N_pad/16, ", G, ", 128] with N_pad a multiple of 128, got ",
              qweight.sizes());
  TORCH_CHECK(N % kGroup == 0 && N <= N_pad && N > N_pad - w4a4::kBlockN, "ovbatch_w4a4: N = ", N,
              " must be a multiple of 64 matching the packed weights of ", N_pad, " rows");
  TORCH_CHECK(ascales.sizes() == torch::IntArrayRef({G, M_pad}), "ovbatch_w4a4: ascales must be [", G, ", ", M_pad,
              "], got ", ascales.sizes());
  TORCH_CHECK(lora.size(0) == M_pad && (R == 16 || R == 32), "ovbatch_w4a4: lora must be [", M_pad,
              ", 16 or 32], got ", lora.sizes());
  TORCH_CHECK(wscales.sizes() == torch::IntArrayRef({G, N_pad, 2}), "ovbatch_w4a4: wscales must be [", G, ", ",
              N_pad, ", 2], got ", wscales.sizes());
  TORCH_CHECK(proj_up.sizes() == torch::IntArrayRef({N_pad, R}), "ovbatch_w4a4: proj_up must be [", N_pad, ", ", R,
              "], got ", proj_up.sizes());
  if (bias) {
    check_cuda(*bias, "bias");
    check_dtype(*bias, at::kFloat, "bias");
    TORCH_CHECK(bias->numel() == N, "ovbatch_w4a4: bias must have N = ", N, " elements, got ", bias->numel());
  }
  const c10::cuda::CUDAGuard guard(qact.device());
  Tensor y = torch::empty({M, N}, qact.options().dtype(out_dtype));
  w4a4::GemmArgs a{};
  a.qact = qact.data_ptr();
  a.ascales = ascales.data_ptr<float>();
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
  a.bf16 = out_dtype == at::kBFloat16;
  check_launch(w4a4::launch_w4a4_gemm_lora_up(a, c10::cuda::getCurrentCUDAStream()), "w4a4_gemm_lora_up");
  return y;
}

// The whole W4A4 linear on x [M, K]: both kernels, intermediates from the caching allocator.
Tensor w4a4_linear(const Tensor& x, const std::optional<Tensor>& smooth, const Tensor& pd_t, const Tensor& qweight,
                   const Tensor& wscales, const Tensor& proj_up, const std::optional<Tensor>& bias, int64_t N) {
  auto [qact, ascales, lora] = quantize_act_lora_down(x, smooth, pd_t);
  return gemm_lora_up(qact, ascales, lora, qweight, wscales, proj_up, bias, x.size(0), N, x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(ovbatch_w4a4, m) {
  m.def("quantize_act_lora_down(Tensor x, Tensor? smooth, Tensor pd_t) -> (Tensor, Tensor, Tensor)");
  m.def(
      "gemm_lora_up(Tensor qact, Tensor ascales, Tensor lora, Tensor qweight, Tensor wscales, Tensor proj_up, "
      "Tensor? bias, int M, int N, ScalarType out_dtype) -> Tensor");
  m.def(
      "w4a4_linear(Tensor x, Tensor? smooth, Tensor pd_t, Tensor qweight, Tensor wscales, Tensor proj_up, "
      "Tensor? bias, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(ovbatch_w4a4, CUDA, m) {
  m.impl("quantize_act_lora_down", &quantize_act_lora_down);
  m.impl("gemm_lora_up", &gemm_lora_up);
  m.impl("w4a4_linear", &w4a4_linear);
}
