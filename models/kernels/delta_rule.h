// The per-(row, value head) bodies of the DeltaNet and Gated DeltaNet decode and prefill
// kernels (models/architectures/delta_net.h has the math): one token's delta rule on one
// head's state, and the output's RMSNorm and gate. Plain functions with no library calls,
// `__host__ __device__` under nvcc, so the CPU kernel (native_delta_net.cc) and a CUDA
// launch run the same body over the same grid and the CPU suite tests the math on every
// stop. Torch-free, header-only.
#pragma once

#include <cmath>
#include <cstdint>

#include "models/gpu/host_device.h"

namespace fwmodel::kernels {

// One token of the delta rule on value head j's state S [K, V] (row i: key channel i,
// row-major), in place, float32:
//   S ← decay · S                      (Gated DeltaNet; decay = 1 for DeltaNet)
//   u = β (v − Sᵀk);  S ← S + k uᵀ;  o = Sᵀq   (o read after the update)
// q, k [K] already activated, normalised and (q) scaled; v [V]. Two passes over S, each
// along V: the first reads Sᵀk and Sᵀq of the old state (o = decay·Sᵀq + (q·k) u, the
// same value as reading the new state), the second writes decay·S + k uᵀ. `read` is V
// floats of scratch; o [V] is written.
FW_HOST_DEVICE inline void DeltaRuleToken(int64_t K, int64_t V, float* __restrict S,
                                          const float* __restrict q, const float* __restrict k,
                                          const float* __restrict v, float beta, float decay,
                                          float* __restrict o, float* __restrict read) {
  FW_SIMD
  for (int64_t j = 0; j < V; ++j) {
    read[j] = 0.0f;
    o[j] = 0.0f;
  }
  float qk = 0.0f;
  for (int64_t i = 0; i < K; ++i) {
    const float* __restrict row = S + i * V;
    const float ki = k[i], qi = q[i];
    qk += qi * ki;
    FW_SIMD
    for (int64_t j = 0; j < V; ++j) {
      read[j] += ki * row[j];
      o[j] += qi * row[j];
    }
  }
  FW_SIMD
  for (int64_t j = 0; j < V; ++j) {
    const float u = beta * (v[j] - decay * read[j]);
    read[j] = u;  // now u
    o[j] = decay * o[j] + qk * u;
  }
  for (int64_t i = 0; i < K; ++i) {
    float* __restrict row = S + i * V;
    const float ki = k[i];
    FW_SIMD
    for (int64_t j = 0; j < V; ++j) row[j] = decay * row[j] + ki * read[j];
  }
}

// o [V] ← RMSNorm(o) ⊙ weight (eps inside the mean), then ⊙ silu(gate) when gate is not
// null (use_gate: gate is g_proj's row for this head, before its silu).
FW_HOST_DEVICE inline void DeltaNetOutputNorm(int64_t V, float* __restrict o,
                                              const float* __restrict weight, float eps,
                                              const float* __restrict gate) {
  float squares = 0.0f;
  FW_SIMD_SUM(squares)
  for (int64_t j = 0; j < V; ++j) squares += o[j] * o[j];
  const float inv = 1.0f / sqrtf(squares / static_cast<float>(V) + eps);
  if (gate == nullptr) {
    FW_SIMD
    for (int64_t j = 0; j < V; ++j) o[j] = o[j] * inv * weight[j];
    return;
  }
  FW_SIMD
  for (int64_t j = 0; j < V; ++j) {
    const float g = gate[j];
    o[j] = o[j] * inv * weight[j] * (g / (1.0f + expf(-g)));
  }
}

}  // namespace fwmodel::kernels
