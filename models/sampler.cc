#include "models/sampler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#if defined(FWSERVE_HAVE_LIBMVEC)
#include <immintrin.h>
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
#endif
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
  return absl::OkStatus();
}

double TokenLogProb(const float* logits, int64_t vocab, int64_t token) {
  double top = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isfinite(logits[i])) top = std::max<double>(top, logits[i]);
  }
  if (token < 0 || token >= vocab || !std::isfinite(logits[token]) || !std::isfinite(top)) {
    return -std::numeric_limits<double>::infinity();
  }
  double total = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isfinite(logits[i])) total += std::exp(static_cast<double>(logits[i]) - top);
  }
  return static_cast<double>(logits[token]) - top - std::log(total);
}

int64_t SampleToken(const float* raw_logits, int64_t vocab, const SamplingParams& params,
                    std::mt19937_64& rng, const std::vector<int64_t>& recent) {
  const float* logits = raw_logits;
  std::vector<float> penalized;
  if (params.repetition_penalty != 1.0f && !recent.empty()) {
    penalized.assign(raw_logits, raw_logits + vocab);
    std::vector<bool> seen(static_cast<size_t>(vocab), false);
    for (int64_t t : recent) {
      if (t < 0 || t >= vocab || seen[static_cast<size_t>(t)]) continue;
      seen[static_cast<size_t>(t)] = true;
      float& v = penalized[static_cast<size_t>(t)];
      v = v > 0 ? v / params.repetition_penalty : v * params.repetition_penalty;
    }
    logits = penalized.data();
  }
  auto value = [&](int64_t i) {
    return std::isfinite(logits[i]) ? logits[i] : -std::numeric_limits<float>::infinity();
  };
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (value(i) > value(best)) best = i;
  }
  if (params.temperature == 0 || !std::isfinite(value(best))) return best;

  // Unnormalised probabilities relative to the top token (which gets 1). No sort unless
  // top_p asks for one: profiling showed a full sort per token was a fifth of the
  // engine thread's time at 32 streams.
  const double top = value(best);
  std::vector<double> probs(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) {
    const float v = value(i);
    probs[static_cast<size_t>(i)] = std::isfinite(v) ? (v - top) / params.temperature
                                                     : -std::numeric_limits<double>::infinity();
  }
  // A fifth of the engine thread's time at 64 streams went to this exp, one row at a
  // time (perf, docs/benchmarks.md): vectorised where the CPU allows.
  ExpInPlace(probs.data(), probs.size());
  if (params.top_k > 0 && params.top_k < vocab) {
    // Keep the k most likely; among equals at the boundary, the lowest ids.
    std::vector<double> sorted = probs;
    const auto kth = sorted.begin() + (params.top_k - 1);
    std::nth_element(sorted.begin(), kth, sorted.end(), std::greater<double>());
    const double threshold = *kth;
    int64_t above = 0;
    for (double p : probs) above += p > threshold ? 1 : 0;
    int64_t ties_kept = params.top_k - above;
    for (double& p : probs) {
      if (p > threshold) continue;
      if (p == threshold && ties_kept > 0) {
        --ties_kept;
      } else {
        p = 0;
      }
    }
  }
  if (params.min_p > 0) {
    for (double& p : probs) {
      if (p < params.min_p) p = 0;  // the top token's probability is 1 here
    }
  }
  if (params.top_p < 1) {
    // The smallest set of most likely tokens whose probability reaches top_p.
    std::vector<int64_t> order;
    double kept_total = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (probs[static_cast<size_t>(i)] > 0) {
        order.push_back(i);
        kept_total += probs[static_cast<size_t>(i)];
      }
    }
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      const double pa = probs[static_cast<size_t>(a)], pb = probs[static_cast<size_t>(b)];
      return pa != pb ? pa > pb : a < b;
    });
    double cumulative = 0;
    size_t cut = order.size();
    for (size_t i = 0; i < order.size(); ++i) {
      cumulative += probs[static_cast<size_t>(order[i])] / kept_total;
      if (cumulative >= params.top_p) {
        cut = i + 1;
        break;
      }
    }
    for (size_t i = cut; i < order.size(); ++i) probs[static_cast<size_t>(order[i])] = 0;
  }
  double mass = 0;
  for (double p : probs) mass += p;
  const double u = std::uniform_real_distribution<double>(0.0, mass)(rng);
  double acc = 0;
  int64_t last = best;
  for (int64_t i = 0; i < vocab; ++i) {
    const double p = probs[static_cast<size_t>(i)];
    if (p <= 0) continue;
    acc += p;
    last = i;
    if (u < acc) return i;
  }
  return last;
}

}  // namespace fwserve
