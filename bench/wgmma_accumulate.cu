// Does the FP8 wgmma add its products to a nonzero accumulator in float32? (docs/kernels.md, v22.)
// D_in = L, A = 2^-9 (e4m3 0x01) everywhere, B = v * 2^-9 everywhere, k = 32: each output should be
// L + 32 v 2^-18 = L + v 2^-13 rounded once to float32, as a float32 add (the fold in csrc/w4a4_gemm.cu) gives.
//
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_accumulate bench/wgmma_accumulate.cu
//   /tmp/wgmma_accumulate > bench/results/wgmma-accumulate-h200.txt
#include <cstdio>
#include <cstdint>
__global__ void k(const float* L, float* out, uint8_t bval) {
  __shared__ __align__(128) uint8_t b[8192];
  for (int i = threadIdx.x; i < 8192; i += 128) b[i] = bval;
  __syncthreads();
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  float d[4];
  for (int i = 0; i < 4; ++i) d[i] = L[0];
  uint32_t a[4] = {0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u};
  uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(b));
  uint64_t desc = static_cast<uint64_t>((addr >> 4) & 0x3FFF) | (static_cast<uint64_t>(128 >> 4) << 16) |
                  (static_cast<uint64_t>(128 >> 4) << 32);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  if (threadIdx.x == 0) out[0] = d[0];
}
int main() {
  float *L, *out;
  cudaMallocManaged(&L, 4);
  cudaMallocManaged(&out, 4);
  const float Ls[] = {0.f, 1.f, 16.f, 256.f, 4096.f, -1.f, 1.0001f};
  const int vs[] = {1, 3, 7};
  printf("L v exact_fp32(L+v*2^-13) got got-L (v*2^-13=%g per v)\n", 1.0 / 8192);
  for (float l : Ls)
    for (int v : vs) {
      *L = l;
      k<<<1, 128>>>(L, out, static_cast<uint8_t>(v));
      cudaDeviceSynchronize();
      const float exact = l + v / 8192.0f;
      printf("%g %d %.9g %.9g %.9g %s\n", l, v, exact, *out, *out - l, *out == exact ? "exact" : "DIFFERS");
    }
  printf("err=%s\n", cudaGetErrorString(cudaGetLastError()));
}
