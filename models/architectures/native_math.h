// Float32 building blocks of the native decode kernels (native_step.cc and the
// mixers' native rows). Torch-free, header-only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// The per-session kernels are compiled twice, for AVX2 + FMA (x86-64-v3) and for the
// baseline, and the loader picks one for the CPU (GCC/Clang function multiversioning),
// so the image runs on any x86-64 and vectorises where it can. Files holding such
// kernels are compiled with -fopenmp-simd -fno-trapping-math (models/CMakeLists.txt).
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define FW_VECTOR_KERNEL __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
#endif
#ifndef FW_VECTOR_KERNEL
#define FW_VECTOR_KERNEL
#endif

namespace fwmodel::native {

// Internal linkage (static), as when these lived in native_step.cc: each kernel file
// inlines its own copy into its x86-64-v3 and default clones.

// e^x in float32 to within 2 ulp (Cephes' expf: 2^n · a degree-6 polynomial on
// [-ln2/2, ln2/2]); exactly 0 below -87.3 (so the aft state's p0 = -1e30 weighs
// nothing). Branch-free, so loops of it vectorise.
static inline float FastExp(float x) {
  const float clamped = std::min(std::max(x, -87.3f), 88.7f);
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
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? 0.0f : y * scale;
}

static inline float Sigmoid(float z) { return 1.0f / (1.0f + FastExp(-z)); }

// y = LN(x) per row of width d, with weight and bias (biased variance, as torch). y may
// be x.
static inline void LayerNormRows(const float* x, int64_t rows, int64_t d, const float* weight,
                                 const float* bias, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float* yr = y + r * d;
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < d; ++c) sum += xr[c];
    const float mean = sum / static_cast<float>(d);
    float squares = 0;
#pragma omp simd reduction(+ : squares)
    for (int64_t c = 0; c < d; ++c) squares += (xr[c] - mean) * (xr[c] - mean);
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(d) + eps);
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) yr[c] = (xr[c] - mean) * inv * weight[c] + bias[c];
  }
}

}  // namespace fwmodel::native
