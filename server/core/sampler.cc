#include "server/core/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"

namespace fwserve {

absl::Status SamplingParams::Validate() const {
  if (!(temperature >= 0 && temperature <= 100)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be in [0, 100], got ", temperature));
  }
  if (top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", top_k));
  if (!(top_p > 0 && top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", top_p));
  }
  if (!(min_p >= 0 && min_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p must be in [0, 1], got ", min_p));
  }
  if (!(repetition_penalty > 0 && repetition_penalty <= 10)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty must be in (0, 10], got ", repetition_penalty));
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

  // Candidates by descending logit (stable: lower id first among equals).
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  const int64_t keep = params.top_k > 0 ? std::min<int64_t>(params.top_k, vocab) : vocab;
  auto by_logit = [&](int64_t a, int64_t b) {
    return value(a) != value(b) ? value(a) > value(b) : a < b;
  };
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), by_logit);
  order.resize(static_cast<size_t>(keep));

  std::vector<double> probs(order.size());
  const double top = value(order[0]);
  double total = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    probs[i] = std::exp((value(order[i]) - top) / params.temperature);
    total += probs[i];
  }
  size_t cut = order.size();
  if (params.min_p > 0) {
    // probs[0] is the top token's (unnormalised) probability.
    const double floor = params.min_p * probs[0];
    size_t kept = 1;
    while (kept < cut && probs[kept] >= floor) ++kept;
    cut = kept;
  }
  if (params.top_p < 1) {
    double cumulative = 0;
    double kept_total = 0;
    for (size_t i = 0; i < cut; ++i) kept_total += probs[i];
    for (size_t i = 0; i < cut; ++i) {
      cumulative += probs[i] / kept_total;
      if (cumulative >= params.top_p) {
        cut = i + 1;
        break;
      }
    }
  }
  double mass = 0;
  for (size_t i = 0; i < cut; ++i) mass += probs[i];
  const double u = std::uniform_real_distribution<double>(0.0, mass)(rng);
  double acc = 0;
  for (size_t i = 0; i < cut; ++i) {
    acc += probs[i];
    if (u < acc) return order[i];
  }
  return order[cut - 1];
}

}  // namespace fwserve
