#include "models/sampling/batch_sampler.h"

#include <cstring>

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

#if defined(FWSERVE_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/gpu/sample.h"
#endif

namespace fwserve {

double CanonicalDraw(std::mt19937_64& rng) {
  return std::generate_canonical<double, std::numeric_limits<double>::digits>(rng);
}

bool PackDraws(absl::Span<const RowDraw> draws, int64_t vocab, int64_t penalty_width,
               double* columns, int64_t* penalty_index, double* penalty_factor) {
  const size_t rows = draws.size();
  for (size_t r = 0; r < rows; ++r) {
    const RowDraw& d = draws[r];
    const SamplingParams& p = *d.params;
    columns[kSampleTemperature * rows + r] = p.temperature;
    columns[kSampleTopK * rows + r] =
        static_cast<double>(p.top_k > 0 && p.top_k < vocab ? p.top_k : vocab);
    columns[kSampleTopP * rows + r] = p.top_p;
    columns[kSampleMinP * rows + r] = p.min_p;
    columns[kSampleUniform * rows + r] = d.uniform;
    columns[kSampleRow * rows + r] =
        static_cast<double>(d.row == -1 ? static_cast<int64_t>(r) : d.row);
    if (penalty_width <= 0) continue;
    int64_t* index = penalty_index + r * static_cast<size_t>(penalty_width);
    std::fill(index, index + penalty_width, int64_t{0});
    penalty_factor[r] = 1.0;
    if (p.repetition_penalty == 1.0f || d.recent == nullptr) continue;
    int64_t kept = 0;
    for (int64_t t : *d.recent) {
      if (t < 0 || t >= vocab) continue;
      if (kept == penalty_width) return false;
      index[kept++] = t;
    }
    if (kept == 0) continue;
    // Repeats write the same value: the penalty applies once per token, as on the host.
    std::fill(index + kept, index + penalty_width, index[kept - 1]);
    penalty_factor[r] = p.repetition_penalty;
  }
  return true;
}

int64_t PenaltyWidth(absl::Span<const RowDraw> draws) {
  size_t width = 0;
  for (const RowDraw& d : draws) {
    if (d.params->repetition_penalty != 1.0f && d.recent != nullptr) {
      width = std::max(width, d.recent->size());
    }
  }
  return static_cast<int64_t>(width);
}

bool NeedsFilters(const SamplingParams& params, int64_t vocab) {
  return (params.top_k > 0 && params.top_k < vocab) || params.top_p < 1.0f || params.min_p > 0.0f;
}

#if defined(FWSERVE_CUDA_KERNELS)
namespace {

// Whether SampleOnDevice may run as the sampling kernel (models/gpu/sample.h):
// contiguous float32 CUDA logits [rows, vocab] and, on the same device, contiguous float64
// columns [kSampleColumns, rows], int64 penalty ids [rows, W] with float64 factors (rows
// values), int64 bias ids [rows, B] with float32 values, W + B within the kernel's
// kSampleMaxAdjustments, a bool mask [rows, vocab] (or none). Anything else takes the
// LibTorch ops.
bool SampleKernelApplies(const torch::Tensor& raw_logits, const torch::Tensor& columns,
                         const torch::Tensor& penalty_index, const torch::Tensor& penalty_factor,
                         const torch::Tensor& bias_index, const torch::Tensor& bias_value,
                         const torch::Tensor& allowed) {
  if (!raw_logits.is_cuda() || raw_logits.dim() != 2 ||
      raw_logits.scalar_type() != torch::kFloat32 || !raw_logits.is_contiguous()) {
    return false;
  }
  const int64_t rows = raw_logits.size(0), vocab = raw_logits.size(1);
  const torch::Device device = raw_logits.device();
  if (vocab < 1 || vocab > std::numeric_limits<int32_t>::max() ||
      rows > std::numeric_limits<int32_t>::max()) {
    return false;
  }
  auto on_device = [&](const torch::Tensor& t, torch::ScalarType type) {
    return t.device() == device && t.scalar_type() == type && t.is_contiguous();
  };
  if (!on_device(columns, torch::kFloat64) || columns.dim() != 2 ||
      columns.size(0) != kSampleColumns || columns.size(1) != rows) {
    return false;
  }
  if (allowed.defined() && (!on_device(allowed, torch::kBool) || allowed.dim() != 2 ||
                            allowed.size(0) != rows || allowed.size(1) != vocab)) {
    return false;
  }
  int64_t entries = 0;
  if (penalty_index.defined() && penalty_index.size(1) > 0) {
    if (!on_device(penalty_index, torch::kInt64) || penalty_index.dim() != 2 ||
        penalty_index.size(0) != rows || !penalty_factor.defined() ||
        !on_device(penalty_factor, torch::kFloat64) || penalty_factor.numel() != rows) {
      return false;
    }
    entries += penalty_index.size(1);
  }
  if (bias_index.defined() && bias_index.size(1) > 0) {
    if (!on_device(bias_index, torch::kInt64) || bias_index.dim() != 2 ||
        bias_index.size(0) != rows || !bias_value.defined() ||
        !on_device(bias_value, torch::kFloat32) || bias_value.sizes() != bias_index.sizes()) {
      return false;
    }
    entries += bias_index.size(1);
  }
  return entries <= fwmodel::kernels::kSampleMaxAdjustments;
}

// SampleOnDevice by the sampling kernel on the current stream of the logits' device
// (`filters`: with the top_k, top_p and min_p columns; `allowed`: the mask, or undefined):
// [rows, 2] float64 (token, logprob) and, for few rows of a launch without filters or
// mask (chunked), the kernel's scratch (SampleScratchBytes, stream-ordered by the caching
// allocator), the only allocations. No host synchronisation: it runs inside CUDA Graph
// capture as the ops it replaces did.
torch::Tensor SampleWithKernel(const torch::Tensor& raw_logits, const torch::Tensor& columns,
                               const torch::Tensor& penalty_index,
                               const torch::Tensor& penalty_factor, const torch::Tensor& bias_index,
                               const torch::Tensor& bias_value, bool filters,
                               const torch::Tensor& allowed) {
  const c10::cuda::CUDAGuard guard(raw_logits.device());
  const int64_t rows = raw_logits.size(0);
  torch::Tensor out = torch::empty({rows, 2}, raw_logits.options().dtype(torch::kFloat64));
  fwmodel::kernels::SampleArgs args;
  args.rows = rows;
  args.vocab = raw_logits.size(1);
  args.logits = raw_logits.data_ptr<float>();
  const double* column_data = columns.data_ptr<double>();
  args.temperature = column_data + kSampleTemperature * rows;
  args.uniform = column_data + kSampleUniform * rows;
  if (filters) {
    args.top_k = column_data + kSampleTopK * rows;
    args.top_p = column_data + kSampleTopP * rows;
    args.min_p = column_data + kSampleMinP * rows;
  }
  if (allowed.defined()) {
    static_assert(sizeof(bool) == 1, "a bool mask is read as bytes");
    args.allowed = reinterpret_cast<const uint8_t*>(allowed.data_ptr<bool>());
  }
  if (penalty_index.defined() && penalty_index.size(1) > 0) {
    args.penalty_width = penalty_index.size(1);
    args.penalty_index = penalty_index.data_ptr<int64_t>();
    args.penalty_factor = penalty_factor.data_ptr<double>();
  }
  if (bias_index.defined() && bias_index.size(1) > 0) {
    args.bias_width = bias_index.size(1);
    args.bias_index = bias_index.data_ptr<int64_t>();
    args.bias_value = bias_value.data_ptr<float>();
  }
  args.out = out.data_ptr<double>();
  torch::Tensor scratch;
  const int64_t scratch_bytes = fwmodel::kernels::SampleLaunchChunks(args) > 1
                                    ? fwmodel::kernels::SampleScratchBytes(rows, args.vocab)
                                    : 0;
  if (scratch_bytes > 0) {
    scratch = torch::empty({scratch_bytes / 8}, raw_logits.options().dtype(torch::kFloat64));
    args.partials =
        reinterpret_cast<fwmodel::kernels::SampleChunkPartial*>(scratch.data_ptr<double>());
  }
  const int error =
      fwmodel::kernels::LaunchSample(args, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(error == 0,
              "the sampling kernel failed: ", fwmodel::kernels::SampleErrorString(error));
  return out;
}

}  // namespace
#endif

torch::Tensor SampleOnDevice(const torch::Tensor& raw_logits, const torch::Tensor& columns,
                             const torch::Tensor& penalty_index,
                             const torch::Tensor& penalty_factor, bool filters,
                             const torch::Tensor& bias_index, const torch::Tensor& bias_value,
                             const torch::Tensor& allowed) {
#if defined(FWSERVE_CUDA_KERNELS)
  if (SampleKernelApplies(raw_logits, columns, penalty_index, penalty_factor, bias_index,
                          bias_value, allowed)) {
    return SampleWithKernel(raw_logits, columns, penalty_index, penalty_factor, bias_index,
                            bias_value, filters, allowed);
  }
#endif
  const torch::Device device = raw_logits.device();
  const int64_t rows = raw_logits.size(0), vocab = raw_logits.size(1);
  const double inf = std::numeric_limits<double>::infinity();
  auto column = [&](int c) { return columns.select(0, c).unsqueeze(1); };  // [rows, 1]
  torch::Tensor raw = raw_logits.to(torch::kFloat32);
  torch::Tensor x = raw.clone();
  if (penalty_index.defined() && penalty_index.size(1) > 0) {
    // In float32, as SampleToken applies it. Rows without a penalty have index 0 and
    // factor 1: an exact no-op.
    torch::Tensor penalty = penalty_factor.to(torch::kFloat32);
    torch::Tensor values = x.gather(1, penalty_index);
    x.scatter_(1, penalty_index, torch::where(values > 0, values / penalty, values * penalty));
  }
  if (bias_index.defined() && bias_index.size(1) > 0) {
    // Distinct ids per row; the (0, 0) pads add nothing.
    x.scatter_add_(1, bias_index, bias_value.to(torch::kFloat32));
  }
  if (allowed.defined()) {
    // SampleToken's rule: a row with no finite allowed logit takes its first allowed
    // token (the argmax below then picks it from a row of zeros and -inf).
    torch::Tensor masked = x.masked_fill(allowed.logical_not(), -inf);
    torch::Tensor none_finite = torch::isfinite(masked).any(1, /*keepdim=*/true).logical_not();
    torch::Tensor first_allowed = allowed.to(torch::kInt32).argmax(1, /*keepdim=*/true);
    torch::Tensor fallback = torch::full_like(x, -inf).scatter_(1, first_allowed, 0.0);
    x = torch::where(none_finite & allowed.any(1, /*keepdim=*/true), fallback, masked);
  }
  x = torch::where(torch::isfinite(x), x, torch::full({}, -inf, x.options()));
  torch::Tensor best = x.argmax(1, /*keepdim=*/true);  // first of equals
  torch::Tensor top = x.gather(1, best);
  torch::Tensor t = column(kSampleTemperature).to(torch::kFloat32);
  torch::Tensor greedy = t.eq(0) | torch::isinf(top);  // SampleToken: argmax
  // Probabilities relative to the top token, in float32 as SampleToken computes them
  // (a greedy row divides by 1 instead of 0; its probabilities are not used).
  t = torch::where(t.eq(0), torch::ones_like(t), t);
  torch::Tensor probs = ((x - top) / t).exp();
  probs = torch::where(torch::isfinite(x), probs, torch::zeros_like(probs)).to(torch::kFloat64);
  torch::Tensor positions =
      torch::arange(vocab, torch::dtype(torch::kInt64).device(device)).expand({rows, vocab});
  if (filters) {
    // Ranks by descending probability, lower ids first among equals.
    torch::Tensor order =
        std::get<1>(torch::sort(probs, /*stable=*/true, /*dim=*/1, /*descending=*/true));
    torch::Tensor rank = torch::empty_like(order).scatter_(1, order, positions);
    // top_k (k = vocab when off), then min_p (the top token has probability 1 here).
    probs = torch::where(rank.to(torch::kFloat64) < column(kSampleTopK), probs,
                         torch::zeros_like(probs));
    probs = torch::where(probs < column(kSampleMinP), torch::zeros_like(probs), probs);
    // top_p: the smallest set of most likely tokens whose share reaches p.
    torch::Tensor p_col = column(kSampleTopP);
    torch::Tensor kept_total = probs.cumsum(1).select(1, vocab - 1).unsqueeze(1);
    torch::Tensor sorted = probs.gather(1, order);
    torch::Tensor share = (sorted / kept_total).cumsum(1);
    torch::Tensor below = (share < p_col).sum(1, /*keepdim=*/true);  // positions before the cut
    torch::Tensor keep_sorted = positions <= below;
    torch::Tensor keep = torch::empty_like(keep_sorted).scatter_(1, order, keep_sorted);
    probs = torch::where(p_col.lt(1) & ~keep, torch::zeros_like(probs), probs);
  }
  // Inverse CDF in id order: the first token whose running sum exceeds u · mass.
  torch::Tensor running = probs.cumsum(1);
  torch::Tensor u = column(kSampleUniform) * running.select(1, vocab - 1).unsqueeze(1);
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
  return torch::cat({token.to(torch::kFloat64), logprob}, 1);
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
    c10::NoGradGuard no_grad;
    const torch::Device device = logits.device();
    const int64_t rows = static_cast<int64_t>(draws.size()), vocab = logits.size(1);
    const int64_t width = PenaltyWidth(draws);
    std::vector<double> packed(static_cast<size_t>(kSampleColumns * rows));
    std::vector<int64_t> index(static_cast<size_t>(rows * width));
    std::vector<double> factor(static_cast<size_t>(rows));
    PackDraws(draws, vocab, width, packed.data(), index.data(), factor.data());
    // The parameters, one column each: [kSampleColumns, rows] float64 in one copy to the
    // device (a second one with a repetition penalty).
    const torch::Tensor columns =
        torch::tensor(packed, torch::kFloat64).view({kSampleColumns, rows}).to(device);
    torch::Tensor penalty_index, penalty_factor;
    if (width > 0) {
      penalty_index = torch::tensor(index, torch::kInt64).view({rows, width}).to(device);
      penalty_factor = torch::tensor(factor, torch::kFloat64).view({rows, 1}).to(device);
    }
    torch::Tensor raw = logits.index_select(0, columns.select(0, kSampleRow).to(torch::kInt64));
    bool filters = false;
    size_t bias_width = 0;
    bool any_mask = false;
    for (const RowDraw& d : draws) {
      filters = filters || NeedsFilters(*d.params, vocab);
      bias_width = std::max(bias_width, d.params->logit_bias.size());
      any_mask = any_mask || d.allowed != nullptr;
    }
    torch::Tensor allowed;
    if (any_mask) {
      // One upload of every row's mask (rows without one allow everything).
      torch::Tensor host = torch::ones({rows, vocab}, torch::kBool);
      for (size_t r = 0; r < draws.size(); ++r) {
        if (draws[r].allowed == nullptr) continue;
        std::memcpy(host[static_cast<int64_t>(r)].data_ptr<bool>(), draws[r].allowed,
                    static_cast<size_t>(vocab));
      }
      allowed = host.to(device);
    }
    torch::Tensor bias_index, bias_value;
    if (bias_width > 0) {
      std::vector<int64_t> ids(static_cast<size_t>(rows) * bias_width, 0);
      std::vector<float> values(ids.size(), 0.0f);
      for (size_t r = 0; r < draws.size(); ++r) {
        const auto& bias = draws[r].params->logit_bias;
        for (size_t j = 0; j < bias.size(); ++j) {
          if (bias[j].first < 0 || bias[j].first >= vocab) continue;  // as SampleToken
          ids[r * bias_width + j] = bias[j].first;
          values[r * bias_width + j] = bias[j].second;
        }
      }
      const int64_t width = static_cast<int64_t>(bias_width);
      bias_index = torch::tensor(ids, torch::kInt64).view({rows, width}).to(device);
      bias_value = torch::tensor(values, torch::kFloat32).view({rows, width}).to(device);
    }
    // One copy to the host: [rows, 2] = (token, logprob).
    torch::Tensor result = SampleOnDevice(raw, columns, penalty_index, penalty_factor, filters,
                                          bias_index, bias_value, allowed)
                               .cpu()
                               .contiguous();
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
