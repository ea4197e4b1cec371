// Correctly rounded float32 division and reciprocal without a division instruction or the compiler's range
// checks.
//
// `1.0f / b` compiles to a fast path guarded by an exponent test, a branch and a call to a slow path: about 6
// instructions beside the arithmetic. Where the caller knows b is in range, rcp_rn gives the same bits in 3.
// tests/test_exact_division.py checks both functions against IEEE division on the GPU.
#pragma once

namespace w4a4 {

// RN(a / b) from y = RN(1 / b): q = RN(a y), r = fma(-q, b, a) is exact, and RN(q + r y) = RN(a / b)
// (Markstein), barring overflow and underflow.
__device__ __forceinline__ float div_rn(float a, float b, float rb) {
  const float q = a * rb;
  const float r = fmaf(-q, b, a);
  return fmaf(r, rb, q);
}

// RN(1 / b) for b in [2^-126, 2^126): the approximate reciprocal refined by one Newton step, the compiler's own
// fast path of `1.0f / b` (MUFU.RCP, then two FMAs).
__device__ __forceinline__ float rcp_rn(float b) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(b));
  return fmaf(y, fmaf(-b, y, 1.0f), y);
}

}  // namespace w4a4
