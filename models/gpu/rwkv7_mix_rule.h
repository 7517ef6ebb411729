// The per-element bodies of RWKV-7's block inputs (models/architectures/rwkv7.cc): the
// LayerNorm before each mix, the token shift's interpolation, and the channel mix's
// relu(·)². Plain functions with no library calls, `__host__ __device__` under nvcc, so
// the CPU kernel (models/kernels/native_rwkv.cc's ShiftMix), the CUDA kernels
// (rwkv7_mix.cu) and their CPU mirror (rwkv7_mix_host.h) run the same arithmetic per
// element. Torch-free, header-only.
//
// One token of one session, d channels, channel c:
//   mean = Σ h / d                                   LayerNormMean (the caller sums)
//   inv = 1/√(Σ (h − mean)² / d + eps)               LayerNormInv (biased, as torch)
//   x_c = (h_c − mean) inv w_c + b_c                 LayerNormOut
//   x_p,c = x_c + (x'_c − x_c) mix_p,c               Rwkv7ShiftMix (x' the previous token's x)
//   relu(z)²                                         SquaredRelu
#pragma once

#include <cmath>
#include <cstdint>

#include "models/gpu/host_device.h"

namespace fwmodel::kernels {

// The LayerNorm's mean from Σ h over the row's d values.
FW_HOST_DEVICE inline float LayerNormMean(float sum, int64_t d) {
  return sum / static_cast<float>(d);
}

// The LayerNorm's 1/σ from Σ (h − mean)² over the row's d values: the biased variance,
// eps inside the root, as torch::layer_norm (eps cast to float, as its CUDA kernel does).
FW_HOST_DEVICE inline float LayerNormInv(float centered_squares, int64_t d, float eps) {
  return 1.0f / sqrtf(centered_squares / static_cast<float>(d) + eps);
}

// Channel c's LayerNorm output.
FW_HOST_DEVICE inline float LayerNormOut(float h, float mean, float inv, float weight, float bias) {
  return (h - mean) * inv * weight + bias;
}

// The token shift's interpolation of channel c: x + (previous − x) · mix (rwkv7.cc's
// addcmul(x, x' − x, mix)).
FW_HOST_DEVICE inline float Rwkv7ShiftMix(float x, float previous, float mix) {
  return x + (previous - x) * mix;
}

// relu(z)², NaN staying NaN as torch's relu keeps it.
FW_HOST_DEVICE inline float SquaredRelu(float z) {
  const float r = z < 0.0f ? 0.0f : z;
  return r * r;
}

// The CUDA shift-mix kernel's block width for rows of d channels: the power of two ≥ d,
// at most 256 (rwkv7_mix.cu; rwkv7_mix_host.h mirrors it). Thread i takes channels
// i, i + width, ...
FW_HOST_DEVICE inline int Rwkv7MixThreads(int64_t d) {
  int p = 1;
  while (p < 256 && p < d) p *= 2;
  return p;
}

}  // namespace fwmodel::kernels
