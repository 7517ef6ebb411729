#include "models/sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(FWSERVE_HAVE_LIBMVEC)
// glibc's vector math library (libmvec): exp of 4 doubles, AVX2 (the x86-64 vector ABI).
extern "C" __attribute__((target("avx2"))) __m256d _ZGVdN4v_exp(__m256d);
#endif

namespace fwserve {
namespace {
// A float as the client sent it: 100.0001 must not read "100" (StrCat keeps 6 digits).
std::string Exact(double value) { return absl::StrFormat("%.9g", value); }

#if defined(FWSERVE_HAVE_LIBMVEC)
__attribute__((target("avx2,fma"))) void ExpAvx2(double* values, size_t n) {
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    _mm256_storeu_pd(values + i, _ZGVdN4v_exp(_mm256_loadu_pd(values + i)));
  }
  for (; i < n; ++i) values[i] = std::exp(values[i]);
}

// RelativeProbabilities on AVX2: the exponents of 4 logits at a time, straight into
// libmvec's exp (ExpAvx2's chunks and tail).
__attribute__((target("avx2,fma"))) void RelativeProbabilitiesAvx2(const float* logits,
                                                                   int64_t vocab, double top,
                                                                   double temperature,
                                                                   double* probs) {
  const __m256d abs_mask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffff));
  const __m256d inf = _mm256_set1_pd(std::numeric_limits<double>::infinity());
  const __m256d minus_inf = _mm256_set1_pd(-std::numeric_limits<double>::infinity());
  const __m256d top_v = _mm256_set1_pd(top), temperature_v = _mm256_set1_pd(temperature);
  int64_t i = 0;
  for (; i + 4 <= vocab; i += 4) {
    const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(logits + i));
    const __m256d finite = _mm256_cmp_pd(_mm256_and_pd(v, abs_mask), inf, _CMP_LT_OQ);
    const __m256d exponent = _mm256_div_pd(_mm256_sub_pd(v, top_v), temperature_v);
    _mm256_storeu_pd(probs + i, _ZGVdN4v_exp(_mm256_blendv_pd(minus_inf, exponent, finite)));
  }
  for (; i < vocab; ++i) {
    probs[i] = std::isfinite(logits[i])
                   ? std::exp((static_cast<double>(logits[i]) - top) / temperature)
                   : std::exp(-std::numeric_limits<double>::infinity());
  }
}
#endif

// The lowest index of the largest finite logit; 0 when none is finite (the non-finite
// count as -inf).
int64_t FiniteArgmaxPortable(const float* logits, int64_t vocab) {
  int64_t best = 0;
  float best_value = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isfinite(logits[i]) && logits[i] > best_value) {
      best = i;
      best_value = logits[i];
    }
  }
  return best;
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) int64_t FiniteArgmaxAvx2(const float* logits, int64_t vocab) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 top = minus_inf;
  int64_t i = 0;
  for (; i + 8 <= vocab; i += 8) {
    const __m256 v = _mm256_loadu_ps(logits + i);
    const __m256 finite = _mm256_cmp_ps(_mm256_and_ps(v, abs_mask), inf, _CMP_LT_OQ);
    top = _mm256_max_ps(top, _mm256_blendv_ps(minus_inf, v, finite));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  float best_value = -std::numeric_limits<float>::infinity();
  for (float lane : lanes) best_value = std::max(best_value, lane);
  for (int64_t j = i; j < vocab; ++j) {
    if (std::isfinite(logits[j])) best_value = std::max(best_value, logits[j]);
  }
  if (!std::isfinite(best_value)) return 0;
  const __m256 wanted = _mm256_set1_ps(best_value);
  for (i = 0; i + 8 <= vocab; i += 8) {
    const int equal =
        _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(logits + i), wanted, _CMP_EQ_OQ));
    if (equal != 0) return i + __builtin_ctz(static_cast<unsigned>(equal));
  }
  for (; i < vocab; ++i) {
    if (logits[i] == best_value) return i;
  }
  return 0;  // not reached: best_value is one of the logits
}
#endif

int64_t FiniteArgmax(const float* logits, int64_t vocab) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return FiniteArgmaxAvx2(logits, vocab);
#endif
  return FiniteArgmaxPortable(logits, vocab);
}

// probs[i] := exp((logits[i] - top) / temperature) in double, 0 for a non-finite logit.
// The exponent goes through ExpInPlace's function on the same 4-wide chunks, so the
// values are those of filling the exponents and calling ExpInPlace on them.
void RelativeProbabilities(const float* logits, int64_t vocab, float top, float temperature,
                           double* probs) {
  const double top_d = top, temperature_d = temperature;
  auto exponent = [&](float v) {
    return std::isfinite(v) ? (static_cast<double>(v) - top_d) / temperature_d
                            : -std::numeric_limits<double>::infinity();
  };
#if defined(FWSERVE_HAVE_LIBMVEC)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return RelativeProbabilitiesAvx2(logits, vocab, top_d, temperature_d, probs);
#endif
  for (int64_t i = 0; i < vocab; ++i) probs[i] = exponent(logits[i]);
  ExpInPlace(probs, static_cast<size_t>(vocab));
}

// Keeps the k most likely (k < probs->size()); among equals at the boundary, the lowest
// ids. The rest become 0.
void KeepTopK(int64_t k, std::vector<double>* probs) {
  // The k-th largest value: a heap of the k largest seen (most values are rejected by
  // one comparison with its least) for the usual small k, a selection over a copy else.
  thread_local std::vector<double> largest;
  double threshold;
  if (k <= 4096) {
    largest.resize(static_cast<size_t>(k));
    std::partial_sort_copy(probs->begin(), probs->end(), largest.begin(), largest.end(),
                           std::greater<double>());
    threshold = largest.back();
  } else {
    largest.assign(probs->begin(), probs->end());
    const auto kth = largest.begin() + (k - 1);
    std::nth_element(largest.begin(), kth, largest.end(), std::greater<double>());
    threshold = *kth;
  }
  int64_t above = 0;
  for (double p : *probs) above += p > threshold ? 1 : 0;
  int64_t ties_kept = k - above;
  for (double& p : *probs) {
    if (p > threshold) continue;
    if (p == threshold && ties_kept > 0) {
      --ties_kept;
    } else {
      p = 0;
    }
  }
}

// Keeps the smallest set of most likely tokens whose probability reaches top_p (ties by
// lowest id); the rest become 0. The running sum goes over the tokens in that order, as
// over a full sort, but only the head of the order is sorted: the m most likely, m
// growing 8x until the sum reaches top_p (a full sort of 65,536 ids was 6 ms a token).
void KeepNucleus(float top_p, std::vector<double>* probs_vector) {
  std::vector<double>& probs = *probs_vector;
  thread_local std::vector<int64_t> order;
  order.clear();
  double kept_total = 0;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] > 0) {
      order.push_back(static_cast<int64_t>(i));
      kept_total += probs[i];
    }
  }
  const auto more_likely = [&](int64_t a, int64_t b) {
    const double pa = probs[static_cast<size_t>(a)], pb = probs[static_cast<size_t>(b)];
    return pa != pb ? pa > pb : a < b;
  };
  size_t cut = order.size();
  for (size_t head = std::min<size_t>(order.size(), 256);;
       head = std::min(order.size(), head * 8)) {
    if (head < order.size()) {
      std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(head),
                       order.end(), more_likely);
    }
    std::sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(head), more_likely);
    double cumulative = 0;
    bool reached = false;
    for (size_t i = 0; i < head; ++i) {
      cumulative += probs[static_cast<size_t>(order[i])] / kept_total;
      if (cumulative >= top_p) {
        cut = i + 1;
        reached = true;
        break;
      }
    }
    if (reached || head == order.size()) break;
  }
  for (size_t i = cut; i < order.size(); ++i) probs[static_cast<size_t>(order[i])] = 0;
}

}  // namespace

void ExpInPlace(double* values, size_t n) {
#if defined(FWSERVE_HAVE_LIBMVEC)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return ExpAvx2(values, n);
#endif
  for (size_t i = 0; i < n; ++i) values[i] = std::exp(values[i]);
}

absl::Status SamplingParams::Validate() const {
  if (!(temperature >= 0 && temperature <= 100)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be in [0, 100], got ", Exact(temperature)));
  }
  if (top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", top_k));
  if (!(top_p > 0 && top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", Exact(top_p)));
  }
  if (!(min_p >= 0 && min_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p must be in [0, 1], got ", Exact(min_p)));
  }
  if (!(repetition_penalty > 0 && repetition_penalty <= 10)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty must be in (0, 10], got ", Exact(repetition_penalty)));
  }
  if (!(presence_penalty >= -2 && presence_penalty <= 2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("presence_penalty must be in [-2, 2], got ", Exact(presence_penalty)));
  }
  if (!(frequency_penalty >= -2 && frequency_penalty <= 2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("frequency_penalty must be in [-2, 2], got ", Exact(frequency_penalty)));
  }
  if (logit_bias.size() > kMaxLogitBias) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit_bias: at most ", kMaxLogitBias, " tokens, got ", logit_bias.size()));
  }
  for (size_t i = 0; i < logit_bias.size(); ++i) {
    const auto& [token, value] = logit_bias[i];
    if (token < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias: token id ", token, " is negative"));
    }
    if (i > 0 && token <= logit_bias[i - 1].first) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias: token ids must be distinct and ascending, got ", token,
                       " after ", logit_bias[i - 1].first));
    }
    if (!(value >= -100 && value <= 100)) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias: the value for token ", token,
                                                     " must be in [-100, 100], got ",
                                                     Exact(value)));
    }
  }
  return absl::OkStatus();
}

double TokenLogProb(const float* logits, int64_t vocab, int64_t token) {
  if (token < 0 || token >= vocab || !std::isfinite(logits[token])) {
    return -std::numeric_limits<double>::infinity();
  }
  const float top = logits[FiniteArgmax(logits, vocab)];  // finite: logits[token] is
  // exp(logit - top) over the finite logits (the others add exp(-inf) = 0), a block at a
  // time through the vectorised exp.
  constexpr int64_t kBlock = 1024;
  double block[kBlock];
  double total = 0;
  for (int64_t begin = 0; begin < vocab; begin += kBlock) {
    const int64_t n = std::min(kBlock, vocab - begin);
    for (int64_t i = 0; i < n; ++i) {
      const float v = logits[begin + i];
      block[i] = std::isfinite(v) ? static_cast<double>(v) - top
                                  : -std::numeric_limits<double>::infinity();
    }
    ExpInPlace(block, static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) total += block[i];
  }
  return static_cast<double>(logits[token]) - top - std::log(total);
}

std::vector<std::pair<int64_t, float>> TopLogProbs(const float* logits, int64_t vocab, int k) {
  std::vector<std::pair<int64_t, float>> out;
  if (k <= 0 || vocab <= 0) return out;
  std::vector<int64_t> ids;
  ids.reserve(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isfinite(logits[i])) ids.push_back(i);
  }
  const size_t n = std::min(ids.size(), static_cast<size_t>(k));
  const auto more_likely = [&](int64_t a, int64_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  };
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n), ids.end(),
                    more_likely);
  if (n == 0) return out;
  // log softmax = logit - top - log Σ exp(logit - top), the sum once for all k.
  const double first = TokenLogProb(logits, vocab, ids[0]);
  const float top = logits[ids[0]];
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const double shift = static_cast<double>(logits[ids[i]]) - top;
    out.emplace_back(ids[i], static_cast<float>(first + shift));
  }
  return out;
}

int64_t SampleToken(const float* raw_logits, int64_t vocab, const SamplingParams& params,
                    std::mt19937_64& rng, const std::vector<int64_t>& recent,
                    const uint8_t* allowed) {
  // Every draw equals the one the first, one-pass-per-step version made for the same
  // logits, parameters and generator (tests/unit/sampler_test.cc keeps that version as
  // its reference): the same IEEE operations on the same values in the same order, only
  // vectorised, fused or skipped where their result is known.
  const float* logits = raw_logits;
  thread_local std::vector<float> penalized;
  if (params.repetition_penalty != 1.0f && !recent.empty()) {
    penalized.assign(raw_logits, raw_logits + vocab);
    for (int64_t t : recent) {
      if (t < 0 || t >= vocab) continue;
      float& v = penalized[static_cast<size_t>(t)];
      // Once per distinct token: a value the penalty changed was penalised already; one it
      // leaves as it is (0, ±inf, NaN) comes out the same however often it is applied.
      if (v != raw_logits[t]) continue;
      v = v > 0 ? v / params.repetition_penalty : v * params.repetition_penalty;
    }
    logits = penalized.data();
  }
  if (!params.logit_bias.empty()) {
    if (logits == raw_logits) penalized.assign(raw_logits, raw_logits + vocab);
    for (const auto& [token, value] : params.logit_bias) {
      if (token >= 0 && token < vocab) penalized[static_cast<size_t>(token)] += value;
    }
    logits = penalized.data();
  }
  if (allowed != nullptr) {
    if (logits == raw_logits) penalized.assign(raw_logits, raw_logits + vocab);
    const float minus_inf = -std::numeric_limits<float>::infinity();
    bool any = false;
    for (int64_t i = 0; i < vocab; ++i) {
      if (allowed[i] == 0) {
        penalized[static_cast<size_t>(i)] = minus_inf;
      } else {
        any = any || std::isfinite(penalized[static_cast<size_t>(i)]);
      }
    }
    // Nothing allowed is finite: the first allowed token (the caller's contract says one
    // is), else the unmasked argmax.
    if (!any) {
      for (int64_t i = 0; i < vocab; ++i) {
        if (allowed[i] != 0) return i;
      }
      return FiniteArgmax(raw_logits, vocab);
    }
    logits = penalized.data();
  }
  const int64_t best = FiniteArgmax(logits, vocab);
  const float best_value = logits[best];
  if (params.temperature == 0 || !std::isfinite(best_value)) return best;

  // Unnormalised probabilities relative to the top token (which gets 1). No sort unless
  // top_p asks for one: profiling showed a full sort per token was a fifth of the
  // engine thread's time at 32 streams.
  thread_local std::vector<double> probs;
  probs.resize(static_cast<size_t>(vocab));
  RelativeProbabilities(logits, vocab, best_value, params.temperature, probs.data());
  if (params.top_k > 0 && params.top_k < vocab) KeepTopK(params.top_k, &probs);
  if (params.min_p > 0) {
    for (double& p : probs) {
      if (p < params.min_p) p = 0;  // the top token's probability is 1 here
    }
  }
  if (params.top_p < 1) KeepNucleus(params.top_p, &probs);
  // probs[i] becomes the running total up to i, summed in index order: the last is the
  // mass the draw scales to, and the first total above the draw is the token.
  double mass = 0;
  int64_t last = best;  // the last token with mass: the answer if rounding overshoots
  for (int64_t i = 0; i < vocab; ++i) {
    double& p = probs[static_cast<size_t>(i)];
    if (p > 0) last = i;
    mass += p;
    p = mass;
  }
  const double u = std::uniform_real_distribution<double>(0.0, mass)(rng);
  const auto above = std::upper_bound(probs.begin(), probs.end(), u);
  return above == probs.end() ? last : static_cast<int64_t>(above - probs.begin());
}

}  // namespace fwserve
