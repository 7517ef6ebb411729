// The per-element bodies of one `linear_attention` head's token
// (models/architectures/linear_attention.cc has the math; ../shared/spec/models.md, "Mixer
// linear_attention"): plain functions with no library calls, `__host__ __device__` under
// nvcc, so the CUDA kernel (linear_attention.cu) and its CPU mirror
// (linear_attention_host.h) run the same arithmetic per element. Torch-free, header-only.
//
// One token of a head of width n, with S [n (key channel i), n (value channel j)] and
// z [n]:
//   φ(x) = elu(x) + 1                                    LinearAttentionFeature
//   z_i ← z_i + φ(k_i)                                   (the caller's, per channel)
//   column j of S: S_ij ← S_ij + φ(k_i) v_j;  num_j = Σ_i φ(q_i) S_ij
//                                                        LinearAttentionColumn
//   den = Σ_i φ(q_i) z_i + attn_eps                      LinearAttentionDen
//   y_j = num_j / den
#pragma once

#include <cstdint>

#include "models/gpu/host_device.h"

namespace fwmodel::kernels {

// φ(x) = elu(x) + 1: x + 1 above 0, e^x (FastExpF) else.
FW_HOST_DEVICE inline float LinearAttentionFeature(float x) {
  return x > 0.0f ? x + 1.0f : FastExpF(x);
}

// Column j of the head's state (n floats, key channel i at column[i]) advanced in place
// past the token, fk = φ(k), v_j the token's value of channel j; returns num_j, the new
// column's dot with fq = φ(q).
FW_HOST_DEVICE inline float LinearAttentionColumn(int64_t n, float* __restrict__ column,
                                                  const float* __restrict__ fq,
                                                  const float* __restrict__ fk, float v_j) {
  float num = 0.0f;
  FW_SIMD_SUM(num)
  for (int64_t i = 0; i < n; ++i) {
    const float s = column[i] + fk[i] * v_j;
    column[i] = s;
    num += fq[i] * s;
  }
  return num;
}

// The token's normaliser: fq · z (z already advanced past the token) + eps.
FW_HOST_DEVICE inline float LinearAttentionDen(int64_t n, const float* __restrict__ fq,
                                               const float* __restrict__ z, float eps) {
  float den = 0.0f;
  FW_SIMD_SUM(den)
  for (int64_t i = 0; i < n; ++i) den += fq[i] * z[i];
  return den + eps;
}

}  // namespace fwmodel::kernels
