// The per-column bodies of one DeltaNet / Gated DeltaNet value head's token
// (models/architectures/delta_net.h has the math): plain functions with no library calls
// but sqrtf and expf, `__host__ __device__` under nvcc, so the CUDA kernel
// (delta_rule_cuda.cu) and its CPU mirror (delta_rule_cuda_host.h) run the same
// arithmetic per column. Column j of the head's state S [K, V] (row i: key channel i) is
// value channel j; DeltaRuleColumn is models/kernels/delta_rule.h's DeltaRuleToken
// restricted to that column (the same expressions, summed in the same order), and
// DeltaNetOutputColumn is DeltaNetOutputNorm's per-channel part. Torch-free, header-only.
//
// One token, column j:
//   read_j = Σ_i k_i S[i][j];  o_j = Σ_i q_i S[i][j];  qk = Σ_i q_i k_i   (old state)
//   u_j = β (v_j − decay · read_j)
//   S[i][j] ← decay · S[i][j] + k_i u_j
//   o_j ← decay · o_j + qk · u_j          (= Σ_i q_i S_new[i][j])
//   then: inv = 1/√(Σ_j o_j² / V + eps)   DeltaNetNormInv (the caller sums over j)
//         out_j = o_j · inv · w_j [· silu(g_j)]   DeltaNetOutputColumn
#pragma once

#include <cmath>
#include <cstdint>

#include "models/gpu/host_device.h"

namespace fwmodel::kernels {

// The sums of one token's delta rule over column j of a head's state (the old state):
// read = Σ_i k_i S[i][j], o = Σ_i q_i S[i][j], qk = q·k. Sequential sums (i = 0, ...,
// K − 1), as DeltaRuleToken's; fully unrolled under nvcc when K is a compile-time constant
// after inlining, so that the column stays in registers.
struct DeltaRuleSums {
  float read;
  float o;
  float qk;
};
FW_HOST_DEVICE inline DeltaRuleSums DeltaRuleColumnSums(int K, const float* __restrict column,
                                                        const float* __restrict q,
                                                        const float* __restrict k) {
  DeltaRuleSums sums{0.0f, 0.0f, 0.0f};
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < K; ++i) {
    const float ki = k[i], qi = q[i], s = column[i];
    sums.qk += qi * ki;
    sums.read += ki * s;
    sums.o += qi * s;
  }
  return sums;
}

// u_j = β (v_j − decay · read_j).
FW_HOST_DEVICE inline float DeltaRuleDelta(float v, float beta, float decay, float read) {
  return beta * (v - decay * read);
}

// The column's update, in place: S[i][j] ← decay · S[i][j] + k_i u_j. KPointer: const
// float* or, in the CUDA kernel, const volatile float* into shared memory (each k_i
// loaded where it is used: ptxas otherwise issues all K loads first and, at K = 128, needs
// K registers beside the column's K and spills).
template <typename KPointer>
FW_HOST_DEVICE inline void DeltaRuleColumnUpdate(int K, float* __restrict column, KPointer k,
                                                 float decay, float u) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int i = 0; i < K; ++i) column[i] = decay * column[i] + k[i] * u;
}

// o_j of the new state: decay · o + qk · u (= Σ_i q_i S_new[i][j]), before the norm.
FW_HOST_DEVICE inline float DeltaRuleColumnOutput(const DeltaRuleSums& sums, float decay, float u) {
  return decay * sums.o + sums.qk * u;
}

// One token of the delta rule on column j of a head's state: `column` [K] (S[:, j]), in
// place; q, k [K] already activated, normalised and (q) scaled; v = v_j. Returns o_j,
// the column's output before the norm: the four bodies above in order.
FW_HOST_DEVICE inline float DeltaRuleColumn(int K, float* __restrict column,
                                            const float* __restrict q, const float* __restrict k,
                                            float v, float beta, float decay) {
  const DeltaRuleSums sums = DeltaRuleColumnSums(K, column, q, k);
  const float u = DeltaRuleDelta(v, beta, decay, sums.read);
  DeltaRuleColumnUpdate<const float*>(K, column, k, decay, u);
  return DeltaRuleColumnOutput(sums, decay, u);
}

// The output RMSNorm's 1/√(mean(o²) + eps) from the head's Σ_j o_j² over its V channels.
FW_HOST_DEVICE inline float DeltaNetNormInv(float squares, int V, float eps) {
  return 1.0f / sqrtf(squares / static_cast<float>(V) + eps);
}

// Channel j's output: o_j · inv · weight_j, then ⊙ silu(g_j) when gated (use_gate; g_j is
// g_proj's output before its silu).
FW_HOST_DEVICE inline float DeltaNetOutputColumn(float o, float inv, float weight, bool gated,
                                                 float g) {
  if (!gated) return o * inv * weight;
  return o * inv * weight * (g / (1.0f + expf(-g)));
}

}  // namespace fwmodel::kernels
