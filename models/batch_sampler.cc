#include "models/batch_sampler.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace fwserve {
namespace {

// The repetition penalty, in float32 as SampleToken applies it, on `x` [rows, vocab] in
// place. Rows without a penalty get index 0 and factor 1: an exact no-op.
void ApplyRepetitionPenalty(absl::Span<const RowDraw> draws, int64_t vocab, torch::Tensor& x) {
  size_t width = 0;
  for (const RowDraw& d : draws) {
    if (d.params->repetition_penalty != 1.0f && d.recent != nullptr) {
      width = std::max(width, d.recent->size());
    }
  }
  if (width == 0) return;
  const int64_t rows = static_cast<int64_t>(draws.size());
  std::vector<int64_t> index(static_cast<size_t>(rows) * width, 0);
  std::vector<double> factor(static_cast<size_t>(rows), 1.0);
  for (int64_t r = 0; r < rows; ++r) {
    const RowDraw& d = draws[static_cast<size_t>(r)];
    if (d.params->repetition_penalty == 1.0f || d.recent == nullptr) continue;
    std::vector<int64_t> valid;
    for (int64_t t : *d.recent) {
      if (t >= 0 && t < vocab) valid.push_back(t);
    }
    if (valid.empty()) continue;
    factor[static_cast<size_t>(r)] = d.params->repetition_penalty;
    for (size_t i = 0; i < width; ++i) {
      // Repeats write the same value: the penalty applies once per token, as on the host.
      index[static_cast<size_t>(r) * width + i] = valid[std::min(i, valid.size() - 1)];
    }
  }
  torch::Tensor idx =
      torch::tensor(index, torch::kInt64).view({rows, static_cast<int64_t>(width)}).to(x.device());
  torch::Tensor penalty =
      torch::tensor(factor, torch::kFloat64).view({-1, 1}).to(x.device(), torch::kFloat32);
  torch::Tensor values = x.gather(1, idx);
  x.scatter_(1, idx, torch::where(values > 0, values / penalty, values * penalty));
}

}  // namespace

double CanonicalDraw(std::mt19937_64& rng) {
  return std::generate_canonical<double, std::numeric_limits<double>::digits>(rng);
}

absl::StatusOr<std::vector<SampledToken>> SampleRows(const torch::Tensor& logits,
                                                     absl::Span<const RowDraw> draws) {
  if (!logits.defined() || logits.dim() != 2) {
    return absl::InvalidArgumentError("logits must be [rows, vocab]");
  }
  for (size_t r = 0; r < draws.size(); ++r) {
    if (draws[r].params == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("draw ", r, " has no sampling params"));
    }
    const int64_t row = draws[r].row;
    if (row >= logits.size(0) || row < -1 ||
        (row == -1 && logits.size(0) != static_cast<int64_t>(draws.size()))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "draw ", r, ": row ", row, " is not a row of logits [", logits.size(0), ", vocab]"));
    }
  }
  std::vector<SampledToken> out(draws.size());
  if (draws.empty()) return out;
  try {
    torch::NoGradGuard no_grad;
    const torch::Device device = logits.device();
    const int64_t rows = static_cast<int64_t>(draws.size()), vocab = logits.size(1);
    const double inf = std::numeric_limits<double>::infinity();
    // The parameters, one column each: [6, rows] float64 in one copy to the device.
    enum { kTemperature, kTopK, kTopP, kMinP, kUniform, kRow, kColumns };
    std::vector<double> packed(static_cast<size_t>(kColumns * rows));
    for (int64_t r = 0; r < rows; ++r) {
      const RowDraw& d = draws[static_cast<size_t>(r)];
      const SamplingParams& p = *d.params;
      auto at = [&](int column) -> double& {
        return packed[static_cast<size_t>(column * rows + r)];
      };
      at(kTemperature) = p.temperature;
      at(kTopK) = static_cast<double>(p.top_k > 0 && p.top_k < vocab ? p.top_k : vocab);
      at(kTopP) = p.top_p;
      at(kMinP) = p.min_p;
      at(kUniform) = d.uniform;
      at(kRow) = static_cast<double>(d.row == -1 ? r : d.row);
    }
    const torch::Tensor columns =
        torch::tensor(packed, torch::kFloat64).view({kColumns, rows}).to(device);
    auto column = [&](int c) { return columns.select(0, c).unsqueeze(1); };  // [rows, 1]
    torch::Tensor raw =
        logits.index_select(0, columns.select(0, kRow).to(torch::kInt64)).to(torch::kFloat32);
    torch::Tensor x = raw.clone();
    ApplyRepetitionPenalty(draws, vocab, x);
    x = torch::where(torch::isfinite(x), x, torch::full({}, -inf, x.options()));
    torch::Tensor best = x.argmax(1, /*keepdim=*/true);  // first of equals
    torch::Tensor top = x.gather(1, best);
    torch::Tensor t = column(kTemperature).to(torch::kFloat32);
    torch::Tensor greedy = t.eq(0) | torch::isinf(top);  // SampleToken: argmax
    // Probabilities relative to the top token, in float32 as SampleToken computes them
    // (a greedy row divides by 1 instead of 0; its probabilities are not used).
    t = torch::where(t.eq(0), torch::ones_like(t), t);
    torch::Tensor probs = ((x - top) / t).exp();
    probs = torch::where(torch::isfinite(x), probs, torch::zeros_like(probs)).to(torch::kFloat64);
    // Ranks by descending probability, lower ids first among equals.
    torch::Tensor order = std::get<1>(torch::sort(probs, /*stable=*/true, /*dim=*/1,
                                                  /*descending=*/true));
    torch::Tensor positions =
        torch::arange(vocab, torch::dtype(torch::kInt64).device(device)).expand({rows, vocab});
    torch::Tensor rank = torch::empty_like(order).scatter_(1, order, positions);
    // top_k (k = vocab when off), then min_p (the top token has probability 1 here).
    probs = torch::where(rank.to(torch::kFloat64) < column(kTopK), probs, torch::zeros_like(probs));
    probs = torch::where(probs < column(kMinP), torch::zeros_like(probs), probs);
    // top_p: the smallest set of most likely tokens whose share reaches p.
    torch::Tensor p_col = column(kTopP);
    torch::Tensor kept_total = probs.cumsum(1).select(1, vocab - 1).unsqueeze(1);
    torch::Tensor sorted = probs.gather(1, order);
    torch::Tensor share = (sorted / kept_total).cumsum(1);
    torch::Tensor below = (share < p_col).sum(1, /*keepdim=*/true);  // positions before the cut
    torch::Tensor keep_sorted = positions <= below;
    torch::Tensor keep = torch::empty_like(keep_sorted).scatter_(1, order, keep_sorted);
    probs = torch::where(p_col.lt(1) & ~keep, torch::zeros_like(probs), probs);
    // Inverse CDF in id order: the first token whose running sum exceeds u · mass.
    torch::Tensor running = probs.cumsum(1);
    torch::Tensor u = column(kUniform) * running.select(1, vocab - 1).unsqueeze(1);
    torch::Tensor positive = probs > 0;
    torch::Tensor hit = (running > u) & positive;
    torch::Tensor first_hit = hit.to(torch::kInt32).argmax(1, /*keepdim=*/true);
    torch::Tensor last_positive =
        torch::where(positive, positions, torch::full({}, -1, positions.options()))
            .amax(1, /*keepdim=*/true);
    torch::Tensor drawn = torch::where(hit.any(1, /*keepdim=*/true), first_hit, last_positive);
    drawn = torch::where(drawn < 0, best, drawn);
    torch::Tensor token = torch::where(greedy, best, drawn);
    // log softmax of the raw logits at the token (TokenLogProb), in float64.
    torch::Tensor r64 = raw.to(torch::kFloat64);
    torch::Tensor finite = torch::isfinite(r64);
    torch::Tensor masked = torch::where(finite, r64, torch::full({}, -inf, r64.options()));
    torch::Tensor raw_top = masked.amax(1, /*keepdim=*/true);
    torch::Tensor total = torch::where(finite, (masked - raw_top).exp(), torch::zeros_like(r64))
                              .sum(1, /*keepdim=*/true);
    torch::Tensor logprob = masked.gather(1, token) - raw_top - total.log();
    logprob =
        torch::where(torch::isfinite(logprob), logprob, torch::full({}, -inf, logprob.options()));
    // One copy to the host: [rows, 2] = (token, logprob).
    torch::Tensor result = torch::cat({token.to(torch::kFloat64), logprob}, 1).cpu().contiguous();
    const double* values = result.data_ptr<double>();
    for (int64_t r = 0; r < rows; ++r) {
      out[static_cast<size_t>(r)].token = static_cast<int64_t>(values[2 * r]);
      out[static_cast<size_t>(r)].logprob = static_cast<float>(values[2 * r + 1]);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("sampling: ", e.what_without_backtrace()));
  }
  return out;
}

}  // namespace fwserve
