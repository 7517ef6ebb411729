// Row kernels both native kernels use (native_step.cc and native_rwkv.cc), defined once
// in native_step.cc, each built for x86-64-v3 and the baseline and picked at load
// (FW_VECTOR_KERNEL, models/architectures/native_math.h). Torch-free.
#pragma once

#include <cstdint>

namespace fwmodel::native {

// y = LN(x) per row of width d, with weight and bias (biased variance, as torch).
void LayerNorm(const float* x, int64_t rows, int64_t d, const float* weight, const float* bias,
               float eps, float* y);
// h[i] += y[i] for i < n; h and y do not overlap.
void AddInPlace(float* __restrict h, const float* __restrict y, int64_t n);

}  // namespace fwmodel::native
