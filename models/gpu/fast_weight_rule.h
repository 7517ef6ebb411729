// The per-element bodies of one `fast_weight` head's token (models/architectures/
// fast_weight.cc has the math; ../shared/spec/models.md, "Mixer fast_weight"): plain
// functions with no library calls, `__host__ __device__` under nvcc, so the CUDA kernel
// (fast_weight.cu) and its CPU mirror (fast_weight_host.h) run the same arithmetic per
// element. Torch-free, header-only.
//
// One token of a head of width n, d_phi = 2·ν·n, W [n (value channel i), d_phi (feature j)];
// the features are kept unnormalised (f = DPFP_ν(z), φ = f / (Σ f + eps)) and the
// normalisers applied to the dots and to the write:
//   f_t = x_j · x_{(j − r) mod 2n}, r = t / 2n + 1, j = t mod 2n      FastWeightFeature
//   inv_k = 1 / (Σ fk + eps), inv_q = 1 / (Σ fq + eps), kq = inv_k inv_q Σ fk fq
//   chunk c of row i (features c·n .. c·n + n − 1): Σ W_ij fk_j, Σ W_ij fq_j
//                                                                    FastWeightChunkDots
//   v̄_i = inv_k Σ_c (chunk c's Σ W fk);  read_i = inv_q Σ_c (chunk c's Σ W fq)
//                                                                    FastWeightRowSum
//   δ_i = β (v_i − v̄_i)                                             FastWeightDelta
//   W_ij ← W_ij + (δ_i inv_k) fk_j                                   FastWeightChunkUpdate
//   y_i = read_i + δ_i kq   (= Σ_j W_ij(new) φ(q)_j)                 FastWeightOutput
#pragma once

#include <cstdint>

#include "models/gpu/host_device.h"

namespace fwmodel::kernels {

// x_j of DPFP for z [n]: relu(z_j) for j < n, relu(−z_{j−n}) for n ≤ j < 2n.
FW_HOST_DEVICE inline float FastWeightDpfpX(const float* z, int n, int j) {
  const float x = j < n ? z[j] : -z[j - n];
  return x > 0.0f ? x : 0.0f;
}

// Feature t (0 ≤ t < 2·ν·n) of DPFP_ν(z), unnormalised: block r = t / 2n + 1 of the
// concatenation, x ⊙ roll(x, r) at j = t mod 2n (torch.roll: x_{(j − r) mod 2n}).
FW_HOST_DEVICE inline float FastWeightFeature(const float* z, int n, int t) {
  const int two_n = 2 * n;
  const int r = t / two_n + 1, j = t % two_n;
  const int rolled = ((j - r) % two_n + two_n) % two_n;
  return FastWeightDpfpX(z, n, j) * FastWeightDpfpX(z, n, rolled);
}

// The dots of a chunk of row i (n floats of W, `chunk`) with the chunk's unnormalised
// features fk, fq [n]: sequential sums, m = 0, ..., n − 1 (fully unrolled under nvcc when
// n is a compile-time constant after inlining, so that the chunk stays in registers).
struct FastWeightDots {
  float k;
  float q;
};
FW_HOST_DEVICE inline FastWeightDots FastWeightChunkDots(int n, const float* __restrict__ chunk,
                                                         const float* __restrict__ fk,
                                                         const float* __restrict__ fq) {
  FastWeightDots dots{0.0f, 0.0f};
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int m = 0; m < n; ++m) {
    dots.k += chunk[m] * fk[m];
    dots.q += chunk[m] * fq[m];
  }
  return dots;
}

// Σ over a row's `chunks` chunk dots, parts[c·n + i] for c = 0, ..., chunks − 1, in order,
// times the normaliser `inv`.
FW_HOST_DEVICE inline float FastWeightRowSum(const float* parts, int chunks, int n, int i,
                                             float inv) {
  float sum = 0.0f;
  for (int c = 0; c < chunks; ++c) sum += parts[c * n + i];
  return sum * inv;
}

// δ_i = β (v_i − v̄_i).
FW_HOST_DEVICE inline float FastWeightDelta(float beta, float v, float retrieved) {
  return beta * (v - retrieved);
}

// The chunk's write, in place: chunk[m] += scale · fk[m] (scale = δ_i · inv_k). FkPointer:
// const float* or, in the CUDA kernel, const volatile float* into shared memory (each fk_m
// loaded where it is used, as delta_rule_column.h's DeltaRuleColumnUpdate, so that the
// loads do not need n registers beside the chunk's n).
template <typename FkPointer>
FW_HOST_DEVICE inline void FastWeightChunkUpdate(int n, float* __restrict__ chunk, FkPointer fk,
                                                 float scale) {
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int m = 0; m < n; ++m) chunk[m] += scale * fk[m];
}

// y_i = read_i + δ_i · kq: row i of the new W times φ(q).
FW_HOST_DEVICE inline float FastWeightOutput(float read, float delta, float kq) {
  return read + delta * kq;
}

// The normaliser's reciprocal 1 / (Σ f + eps).
FW_HOST_DEVICE inline float FastWeightInverse(float sum, float eps) { return 1.0f / (sum + eps); }

}  // namespace fwmodel::kernels
