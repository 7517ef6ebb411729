#include "server/core/sampler.h"

#include <algorithm>
#include <cmath>
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
  return absl::OkStatus();
}

int64_t SampleToken(const float* logits, int64_t vocab, const SamplingParams& params,
                    std::mt19937_64& rng) {
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
  if (params.top_p < 1) {
    double cumulative = 0;
    for (size_t i = 0; i < order.size(); ++i) {
      cumulative += probs[i] / total;
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
