// The per-element bodies of the sampling kernel (sample.cu; sample_host.h runs the same
// grid on the CPU): fwserve::SampleOnDevice's arithmetic (models/sampling/batch_sampler.cc),
// element by element. Plain functions, `__host__
// __device__` under nvcc, so the CUDA kernel and its CPU mirror compute the same values
// per element (expf/exp/log are each side's own: CUDA's and glibc's agree within an ulp
// or two). Torch-free, header-only.
//
// One row of logits ℓ (float32), vocab V, its draw's temperature τ (float32) and number u:
//   x_i = ℓ_i, penalised (ℓ > 0 ? ℓ / f : ℓ · f) where i is in the penalty set,
//         then + the row's logit_bias at i                        SampleAdjusted
//   x_i = −inf where x_i is not finite or the mask disallows i    SampleFiniteOrMinusInf
//   best = argmax x (first of equals), top = x_best; with a mask and top = −inf, best =
//          the first allowed id (if any)
//   greedy when τ = 0 or top = −inf                              SampleIsGreedy
//   p_i = double(expf((x_i − top) / τ)), 0 where x_i = −inf      SampleProbability
//   token: the first i with p_i > 0 whose running Σ_{j ≤ i} p_j exceeds u · Σ p, else the
//          last i with p_i > 0, else best                        SampleChooseToken
//   logprob = ℓ_token − max ℓ − log Σ exp(ℓ_i − max ℓ) in float64 over the finite ℓ,
//             −inf where that is not finite                      SampleLogProb
// With the filters (SampleArgs::top_k set; not greedy), before the draw p_i becomes 0
// unless token i is kept (SampleFiltered): rank r_i by (p desc, id asc);
//   A = {i : r_i < top_k and not p_i < min_p}, a prefix of the ranks  SampleKeepCount,
//                                                                      SampleInTopKMinP
//   T = Σ_A p_i; top_p < 1 and T > 0: keep the ranks of A up to the first whose running
//       share Σ p/T in rank order reaches top_p (at least one)        SampleNucleusTies
// Each cut is a threshold (value bits b, last id l): i passes where bits(p_i) > b, or
// = b and i ≤ l (SampleAtOrAbove). p_i is a float32 widened to float64, so its float32
// bits order the non-negative values; the kernel finds b by binary search over the bits
// and l by counting the ties in id order.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "models/gpu/host_device.h"
#include "models/gpu/sample.h"

namespace fwmodel::kernels {

// Whether x is neither ±inf nor NaN (x − x is 0 only for finite x; IEEE arithmetic, no
// -ffinite-math-only anywhere in the build).
FW_HOST_DEVICE inline bool SampleIsFinite(float x) { return x - x == 0.0f; }
FW_HOST_DEVICE inline bool SampleIsFinite(double x) { return x - x == 0.0; }

// The repetition penalty of one logit, in float32 as SampleToken applies it.
FW_HOST_DEVICE inline float SamplePenalized(float logit, float factor) {
  return logit > 0.0f ? logit / factor : logit * factor;
}

// x, or −inf where x is not finite.
FW_HOST_DEVICE inline float SampleFiniteOrMinusInf(float x) {
  return SampleIsFinite(x) ? x : -INFINITY;
}

// Whether the row takes its argmax: temperature 0, or no finite logit at all.
FW_HOST_DEVICE inline bool SampleIsGreedy(float temperature, float top) {
  return temperature == 0.0f || !SampleIsFinite(top);
}

// Token i's unnormalised probability relative to the top token, in float32 widened to
// float64 (SampleOnDevice's ((x − top) / τ).exp() then .to(kFloat64)); 0 for x = −inf.
// `temperature` is not 0 (greedy rows compute no probabilities).
FW_HOST_DEVICE inline double SampleProbability(float x, float top, float temperature) {
  if (!SampleIsFinite(x)) return 0.0;
  return static_cast<double>(expf((x - top) / temperature));
}

// Token i's term of the log-softmax's normaliser: exp(ℓ_i − max ℓ) in float64, 0 where ℓ_i
// is not finite.
FW_HOST_DEVICE inline double SampleSoftmaxTerm(float raw, float raw_top) {
  if (!SampleIsFinite(raw)) return 0.0;
  return exp(static_cast<double>(raw) - static_cast<double>(raw_top));
}

// log softmax(ℓ)[token] from ℓ_token, max ℓ (over the finite) and Σ SampleSoftmaxTerm:
// (ℓ_token − max ℓ) − log Σ, −inf where that is not finite (ℓ_token not finite, no finite
// logit).
FW_HOST_DEVICE inline double SampleLogProb(float raw_token, float raw_top, double total) {
  if (!SampleIsFinite(raw_token)) return -INFINITY;
  const double value = static_cast<double>(raw_token) - static_cast<double>(raw_top) - log(total);
  return SampleIsFinite(value) ? value : -INFINITY;
}

// The drawn token: the argmax when greedy; else the first crossing of u · mass (`found`,
// −1 when no running sum exceeded it), else the last token with a positive probability
// (`last_positive`, −1 when none), else the argmax.
FW_HOST_DEVICE inline int64_t SampleChooseToken(bool greedy, int64_t best, int64_t found,
                                                int64_t last_positive) {
  if (greedy) return best;
  if (found >= 0) return found;
  if (last_positive >= 0) return last_positive;
  return best;
}

// Whether (value_b, index_b) beats (value_a, index_a) in the argmax: larger, or equal and
// a lower id (first of equals). A total order on distinct ids, so the block's reductions
// give one answer whatever their shape.
FW_HOST_DEVICE inline bool SampleArgmaxBeats(float value_b, int64_t index_b, float value_a,
                                             int64_t index_a) {
  return value_b > value_a || (value_b == value_a && index_b < index_a);
}

// The kernel's block: kSampleThreads threads (sample.h); thread t takes the contiguous
// ids [t · chunk, min((t + 1) · chunk, V)) with chunk = ceil(V / threads) rounded up to a
// multiple of 4 (so a chunk of a 16-byte aligned row reads four floats at a time).
FW_HOST_DEVICE inline int64_t SampleChunk(int64_t vocab, int threads) {
  return ((vocab + threads - 1) / threads + 3) / 4 * 4;
}

// A row's chunks combined (SampleCombineChunks).
struct SampleChunkResult {
  float best_value = -INFINITY;  // the argmax's adjusted logit
  int64_t best_index = 0;        // the argmax (first of equals)
  float raw_top = -INFINITY;     // max finite raw logit (−inf: none)
  double total = 0.0;            // Σ of the chunks' normalisers
  double mass = 0.0;             // Σ of the chunks' masses
  double mass_before = 0.0;      // Σ of the masses of the chunks before `before`
  int64_t last_positive = -1;    // the max of the chunks' last positives
  int64_t found = INT64_MAX;     // the min of the chunks' crossings
};

// The partials of a row's `chunks` chunks (≥ 1) combined in chunk order: from pass 1 on,
// the argmax (chunk 0's, then each later chunk's where it beats) and the raw max; from
// pass 2 on (`passes` ≥ 2), the float64 sums 0.0 + chunk 0 + chunk 1 + ... (mass_before:
// the running mass when chunk `before` comes) and the last positive; with passes 3, the
// lowest crossing. Reads only what those passes wrote. The kernel's passes and finish and
// the mirror combine chunks only through this, so their sums go in one order.
FW_HOST_DEVICE inline SampleChunkResult SampleCombineChunks(const SampleChunkPartial* partials,
                                                            int64_t chunks, int64_t before,
                                                            int passes) {
  SampleChunkResult r;
  r.best_value = partials[0].best_value;
  r.best_index = partials[0].best_index;
  r.raw_top = partials[0].raw_top;
  for (int64_t c = 0; c < chunks; ++c) {
    const SampleChunkPartial& p = partials[c];
    if (c > 0) {
      if (SampleArgmaxBeats(p.best_value, p.best_index, r.best_value, r.best_index)) {
        r.best_value = p.best_value;
        r.best_index = p.best_index;
      }
      if (p.raw_top > r.raw_top) r.raw_top = p.raw_top;
    }
    if (passes < 2) continue;
    if (c == before) r.mass_before = r.mass;
    r.total += p.total;
    r.mass += p.mass;
    if (p.last_positive > r.last_positive) r.last_positive = p.last_positive;
    if (passes >= 3 && p.found < r.found) r.found = p.found;
  }
  return r;
}

// ---- The filters.

// The largest float32 bit pattern a probability can have (+inf); every non-negative
// probability's bits are in [0, kSampleMaxBits].
constexpr uint32_t kSampleMaxBits = 0x7f800000u;

// The float32 bits of a probability (a float32 value widened to float64, ≥ 0): they
// order the probabilities as their values.
FW_HOST_DEVICE inline uint32_t SampleBits(double p) {
  const float value = static_cast<float>(p);
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return bits;
}

// How many ranks top_k keeps: the ranks r (0, 1, ..., vocab − 1) with r < top_k (0 where
// top_k is NaN or ≤ 0, vocab from top_k ≥ vocab).
FW_HOST_DEVICE inline int64_t SampleKeepCount(double top_k, int64_t vocab) {
  if (!(top_k > 0.0)) return 0;
  if (top_k >= static_cast<double>(vocab)) return vocab;
  return static_cast<int64_t>(ceil(top_k));
}

// A row's filter cuts (SampleFiltered): each a threshold (bits, last id); the defaults
// keep every token.
struct SampleFilter {
  uint32_t k_bits = 0;         // top_k: the value of rank top_k − 1 (its float32 bits)
  int64_t k_last = INT64_MAX;  // top_k: the last id kept among the ties at k_bits
  double min_p = 0.0;          // min_p: probabilities below it dropped
  uint32_t p_bits = 0;         // top_p: the value of the last rank kept
  int64_t p_last = INT64_MAX;  // top_p: the last id kept among the ties at p_bits
};

// Where a cut keeps nothing (top_k below 1): no bits are above it, none equal it.
constexpr uint32_t kSampleNoBits = 0xffffffffu;

// Whether (bits, i) is at or above the threshold (cut_bits, last): a larger value, or the
// same value and an id ≤ last (rank order: lower ids first among equals).
FW_HOST_DEVICE inline bool SampleAtOrAbove(uint32_t bits, int64_t i, uint32_t cut_bits,
                                           int64_t last) {
  return bits > cut_bits || (bits == cut_bits && i <= last);
}

// Whether token i (probability p) is in A: within top_k's ranks and not below min_p.
FW_HOST_DEVICE inline bool SampleInTopKMinP(const SampleFilter& f, double p, int64_t i) {
  return !(p < f.min_p) && SampleAtOrAbove(SampleBits(p), i, f.k_bits, f.k_last);
}

// Token i's probability after the filters: p where kept, else 0.
FW_HOST_DEVICE inline double SampleFiltered(const SampleFilter& f, double p, int64_t i) {
  if (!(p > 0.0) || !SampleInTopKMinP(f, p, i)) return 0.0;
  return SampleAtOrAbove(SampleBits(p), i, f.p_bits, f.p_last) ? p : 0.0;
}

// The largest candidate between lo and hi (lo < hi) tried next by a binary search for
// the largest bits with a property that lo has: the search keeps lo = mid where mid has
// it, else hi = mid − 1.
FW_HOST_DEVICE inline uint32_t SampleSearchMid(uint32_t lo, uint32_t hi) {
  return lo + (hi - lo + 1) / 2;
}

// top_p's cut inside the `ties` (≥ 1) tokens of A at the threshold value, each of share
// q = p/T, after the share `above` of A's tokens above it: the smallest m ≥ 1 whose
// running share above + q + ... + q (m terms, added in order as the rank-order cumsum adds
// them) reaches top_p; `ties` where none does.
FW_HOST_DEVICE inline int64_t SampleNucleusTies(double above, double q, int64_t ties,
                                                double top_p) {
  double running = above;
  for (int64_t m = 1; m < ties; ++m) {
    running += q;
    if (running >= top_p) return m;
  }
  return ties;
}

}  // namespace fwmodel::kernels
