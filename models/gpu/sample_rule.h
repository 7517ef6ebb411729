// The per-element bodies of the plain sampling kernel (sample.cu; sample_host.h runs the
// same grid on the CPU): fwserve::SampleOnDevice's arithmetic with `filters` false
// (models/sampling/batch_sampler.cc), element by element. Plain functions, `__host__
// __device__` under nvcc, so the CUDA kernel and its CPU mirror compute the same values
// per element (expf/exp/log are each side's own: CUDA's and glibc's agree within an ulp
// or two). Torch-free, header-only.
//
// One row of logits ℓ (float32), vocab V, its draw's temperature τ (float32) and number u:
//   x_i = ℓ_i, penalised (ℓ > 0 ? ℓ / f : ℓ · f) where i is in the penalty set,
//         then + the row's logit_bias at i                        SampleAdjusted
//   x_i = −inf where x_i is not finite                           SampleFiniteOrMinusInf
//   best = argmax x (first of equals), top = x_best
//   greedy when τ = 0 or top = −inf                              SampleIsGreedy
//   p_i = double(expf((x_i − top) / τ)), 0 where x_i = −inf      SampleProbability
//   token: the first i with p_i > 0 whose running Σ_{j ≤ i} p_j exceeds u · Σ p, else the
//          last i with p_i > 0, else best                        SampleChooseToken
//   logprob = ℓ_token − max ℓ − log Σ exp(ℓ_i − max ℓ) in float64 over the finite ℓ,
//             −inf where that is not finite                      SampleLogProb
#pragma once

#include <cmath>
#include <cstdint>

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

}  // namespace fwmodel::kernels
