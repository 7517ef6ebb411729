// The per-element bodies of one RWKV-7 head's token (models/architectures/rwkv7.cc has
// the math): plain functions with no library calls, `__host__ __device__` under nvcc, so
// the CPU kernel (models/kernels/native_rwkv.cc, HeadStep), the CUDA kernel
// (rwkv7_wkv.cu) and its CPU mirror (rwkv7_wkv_host.h) run the same arithmetic per
// element, and the CPU suite tests it on every run. Torch-free, header-only.
//
// One token of one head of width n, channel j (key side) and row i (value side):
//   kk_raw_j = k_j · k_k_j                         Rwkv7KkRaw
//   norm = max(√Σ kk_raw², 1e-12)                   Rwkv7KkNorm (the caller sums)
//   w_j, −kk_j, kk_j·a_j, k_j ← k_j (1 + (a_j − 1) k_a_j)     Rwkv7PrepareChannel
//   v_i ← v_i + (v_first_i − v_i) σ(v_raw_i)        Rwkv7ValueMix (blocks > 0)
//   row i of S: sa = row·(−kk); row ← row ⊙ w + sa (kk ⊙ a) + v_i k; y_i = row·r
//                                                   Rwkv7RowUpdate
//   bonus = Σ_j r_j k_j r_k_j                       Rwkv7BonusTerm (the caller sums)
//   mean = Σ y / n;  inv = 1/√(Σ (y − mean)² / n + eps)   Rwkv7GroupNormMean, ...Inv
//   out_i = ((y_i − mean) inv ln_w_i + ln_b_i + bonus v_i) g_i   Rwkv7Output
// The reductions (Σ kk_raw², Σ y, Σ (y − mean)², the bonus) are the caller's:
// sequential or vectorised on the CPU, a block reduction on the GPU.
#pragma once

#include <cmath>
#include <cstdint>

#include "models/gpu/host_device.h"

namespace fwmodel::kernels {

// −e^{−1/2}: w = exp(−e^{−1/2} · sigmoid(w_raw)), rounded to float as rwkv7.cc's
// `-std::exp(-0.5)` is when it multiplies a float32 tensor.
constexpr float kRwkv7DecayScale = static_cast<float>(-0.60653065971263342);

// kk of channel j before the head's normalisation: k ⊙ k_k.
FW_HOST_DEVICE inline float Rwkv7KkRaw(float k, float k_k) { return k * k_k; }

// The head's ‖kk_raw‖ from Σ kk_raw², clamped as F.normalize's eps = 1e-12 clamps it.
FW_HOST_DEVICE inline float Rwkv7KkNorm(float squares) {
  const float norm = sqrtf(squares);
  return norm < 1e-12f ? 1e-12f : norm;
}

// What channel j contributes to the state update, from the projections' raw outputs.
struct Rwkv7Channel {
  float w;       // decay: exp(−e^{−1/2} · sigmoid(w_raw)), in (0, 1)
  float neg_kk;  // −kk_raw / norm
  float kk_a;    // kk · a, a = sigmoid(a_raw)
  float k;       // the adjusted key: k · (1 + (a − 1) · k_a)
};

// Channel j's prepare: w_raw, a_raw, its kk_raw (Rwkv7KkRaw) and the head's norm
// (Rwkv7KkNorm), its raw key k and the weight k_a.
FW_HOST_DEVICE inline Rwkv7Channel Rwkv7PrepareChannel(float w_raw, float a_raw, float kk_raw,
                                                       float norm, float k, float k_a) {
  const float a = SigmoidF(a_raw);
  const float kk = kk_raw / norm;
  Rwkv7Channel c;
  c.w = FastExpF(SigmoidF(w_raw) * kRwkv7DecayScale);
  c.neg_kk = -kk;
  c.kk_a = kk * a;
  c.k = k * (1 + (a - 1) * k_a);
  return c;
}

// The value residual's mix of row i (blocks > 0): v + (v_first − v) · sigmoid(v_raw).
FW_HOST_DEVICE inline float Rwkv7ValueMix(float v, float v_first, float v_raw) {
  return v + (v_first - v) * SigmoidF(v_raw);
}

// Row i of the head's state S (value channel i, n key channels), advanced in place past
// the token; returns y_i = row · r of the new row. w, neg_kk, kk_a, k (adjusted) are the
// channels' Rwkv7PrepareChannel results, r the receptance, v_i the (mixed) value of row i.
FW_HOST_DEVICE inline float Rwkv7RowUpdate(int64_t n, float* __restrict__ row,
                                           const float* __restrict__ w,
                                           const float* __restrict__ neg_kk,
                                           const float* __restrict__ kk_a,
                                           const float* __restrict__ k, const float* __restrict__ r,
                                           float v_i) {
  float sa = 0.0f;
  FW_SIMD_SUM(sa)
  for (int64_t j = 0; j < n; ++j) sa += row[j] * neg_kk[j];
  float y = 0.0f;
  FW_SIMD_SUM(y)
  for (int64_t j = 0; j < n; ++j) {
    const float s = row[j] * w[j] + sa * kk_a[j] + v_i * k[j];
    row[j] = s;
    y += s * r[j];
  }
  return y;
}

// Channel j's term of the bonus's dot r · (k ⊙ r_k), k the adjusted key.
FW_HOST_DEVICE inline float Rwkv7BonusTerm(float r, float k, float r_k) { return r * k * r_k; }

// The GroupNorm's mean from Σ y over the head's n values.
FW_HOST_DEVICE inline float Rwkv7GroupNormMean(float sum, int64_t n) {
  return sum / static_cast<float>(n);
}

// The GroupNorm's 1/σ from Σ (y − mean)² over the head's n values (biased variance).
FW_HOST_DEVICE inline float Rwkv7GroupNormInv(float centered_squares, int64_t n, float eps) {
  return 1.0f / sqrtf(centered_squares / static_cast<float>(n) + eps);
}

// Row i's output: (GroupNorm(y)_i + bonus · v_i) · g_i, mean = Σ y / n and inv from
// Rwkv7GroupNormInv, v_i the mixed value.
FW_HOST_DEVICE inline float Rwkv7Output(float y, float mean, float inv, float ln_w, float ln_b,
                                        float bonus, float v, float g) {
  return ((y - mean) * inv * ln_w + ln_b + bonus * v) * g;
}

// The width of the GPU's halving reductions over n values: the power of two ≥ n
// (rwkv7_wkv.cu's BlockSum, rwkv7_wkv_host.h's mirror).
FW_HOST_DEVICE inline int TreeWidth(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

}  // namespace fwmodel::kernels
