// The portability macros of the bodies that both a CPU kernel and a CUDA kernel run
// (delta_rule.h, rwkv7_rule.h): plain functions with no library calls, `__host__
// __device__` under nvcc, whose loops are `#pragma omp simd` for GCC (the CPU kernels are
// compiled with -fopenmp-simd or -fopenmp) and `#pragma unroll` for nvcc (fully unrolled
// when the trip count is a compile-time constant, as in the CUDA kernels' per-thread rows,
// which then stay in registers; left alone otherwise). Torch-free, header-only.
#pragma once

#include <cstdint>

#define FW_PRAGMA(text) _Pragma(#text)
#if defined(__CUDACC__)
#define FW_HOST_DEVICE __host__ __device__
#define FW_SIMD FW_PRAGMA(unroll)
#define FW_SIMD_SUM(x) FW_PRAGMA(unroll)
#else
#define FW_HOST_DEVICE
#define FW_SIMD FW_PRAGMA(omp simd)
#define FW_SIMD_SUM(x) FW_PRAGMA(omp simd reduction(+ : x))
#endif

namespace fwmodel::kernels {

// The float whose bits are `bits`.
FW_HOST_DEVICE inline float FloatFromBits(int32_t bits) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(bits);
#else
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// e^x in float32 to within 2 ulp (Cephes' expf: 2^n · a degree-6 polynomial on
// [-ln2/2, ln2/2]); exactly 0 below -87.3. The same arithmetic as native_math.h's
// native::FastExp (the CPU kernels'), so host and device bodies agree; branch-free, so
// loops of it vectorise.
FW_HOST_DEVICE inline float FastExpF(float x) {
  const float low = x < -87.3f ? -87.3f : x;        // std::max(x, -87.3f)
  const float clamped = 88.7f < low ? 88.7f : low;  // std::min(·, 88.7f)
  // Round to nearest through the float mantissa (|x·log2e| < 2^22).
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float scale = FloatFromBits((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.3f ? 0.0f : y * scale;
}

// 1 / (1 + e^{−z}) on FastExpF.
FW_HOST_DEVICE inline float SigmoidF(float z) { return 1.0f / (1.0f + FastExpF(-z)); }

}  // namespace fwmodel::kernels
