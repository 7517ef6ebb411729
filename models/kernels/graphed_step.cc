#include "models/kernels/graphed_step.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

#ifdef FWSERVE_CUDA_GRAPHS
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace fwmodel {

using fwserve::kSampleColumns;

struct GraphedStep::Bucket {
  using SamplingKind = GraphedStep::SamplingKind;
  int64_t size = 0;
  // Views of device_indices_ (fixed addresses, so a graph can read them).
  torch::Tensor tokens, rows;
  State input;           // [size, ...]: the gathered rows
  State output;          // the rows after the step
  torch::Tensor logits;  // [size, vocab]
  // In place: views of device_upload_ (this bucket's layout) and the sampling result.
  torch::Tensor columns, penalty_index, penalty_factor;
  // [size, 2] float64: the sampling with the ranked filters (top_k, top_p, min_p), the
  // one without them (fwserve::NeedsFilters false for every row of the pass), and the
  // one with the filters and the constraint masks.
  torch::Tensor sampled, sampled_plain, sampled_masked;
#ifdef FWSERVE_CUDA_GRAPHS
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  // In place with sample_in_step: the step with the plain sampling, and the one with
  // the masks, captured into the same memory pool as `graph` (they never run at once).
  std::unique_ptr<at::cuda::CUDAGraph> plain_graph, masked_graph;
#endif
  const torch::Tensor& Sampled(SamplingKind kind) const {
    switch (kind) {
      case SamplingKind::kPlain:
        return sampled_plain;
      case SamplingKind::kMasked:
        return sampled_masked;
      case SamplingKind::kFiltered:
        break;
    }
    return sampled;
  }
};

GraphedStep::GraphedStep(const Model& model, GraphedStepOptions options)
    : model_(model), options_(std::move(options)) {}

GraphedStep::~GraphedStep() {
#ifdef FWSERVE_CUDA_GRAPHS
  if (timing_) {
    cudaEventDestroy(static_cast<cudaEvent_t>(start_event_));
    cudaEventDestroy(static_cast<cudaEvent_t>(end_event_));
  }
#endif
}

namespace {

// Whether any of `draws` needs the sampling's ranked filters (fwserve::NeedsFilters).
bool AnyNeedsFilters(absl::Span<const RowDraw> draws, int64_t vocab) {
  for (const RowDraw& d : draws) {
    if (d.params != nullptr && fwserve::NeedsFilters(*d.params, vocab)) return true;
  }
  return false;
}

// `pool` ([capacity, spec...] per state tensor) and `row_logits` (when given: [capacity,
// vocab] float32) have the model's layout, on its device, in its dtype; with
// `contiguous`, every state tensor is contiguous too.
absl::Status CheckPoolLayout(const Model& model, const State& pool, const torch::Tensor* row_logits,
                             bool contiguous) {
  const std::vector<StateTensorSpec>& spec = model.state_spec();
  if (pool.tensors.size() != spec.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool has ", pool.tensors.size(), " state tensors, expected ", spec.size()));
  }
  const int64_t capacity = pool.tensors.empty() ? 0 : pool.tensors[0].size(0);
  for (size_t i = 0; i < spec.size(); ++i) {
    const torch::Tensor& t = pool.tensors[i];
    std::vector<int64_t> shape = {capacity};
    shape.insert(shape.end(), spec[i].shape.begin(), spec[i].shape.end());
    if (!t.defined() || t.sizes().vec() != shape || t.device() != model.options().device ||
        t.scalar_type() != model.options().dtype || (contiguous && !t.is_contiguous())) {
      return absl::InvalidArgumentError(
          absl::StrCat("pool tensor '", spec[i].name,
                       "' does not match the model's state (shape, device, dtype or layout)"));
    }
  }
  if (row_logits != nullptr &&
      (!row_logits->defined() ||
       row_logits->sizes().vec() != std::vector<int64_t>{capacity, model.config().vocab_size} ||
       row_logits->device() != model.options().device ||
       row_logits->scalar_type() != torch::kFloat32)) {
    return absl::InvalidArgumentError(
        "row_logits must be [pool capacity, vocab] float32 on the model's device");
  }
  return absl::OkStatus();
}

absl::Status CheckBinding(const Model& model, const PoolBinding& pool) {
  if (pool.logits == nullptr) {
    return absl::InvalidArgumentError("the pool binding needs the state and the logits");
  }
  if (absl::Status layout = CheckPoolLayout(model, *pool.state, pool.logits, /*contiguous=*/true);
      !layout.ok()) {
    return layout;
  }
  const int64_t capacity = pool.state->tensors.empty() ? 0 : pool.state->tensors[0].size(0);
  if (pool.pad_row < 0 || pool.pad_row >= capacity) {
    return absl::InvalidArgumentError(
        absl::StrCat("pad_row ", pool.pad_row, " is outside the pool [0, ", capacity, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GraphedStep>> GraphedStep::Create(const Model& model,
                                                                 GraphedStepOptions options,
                                                                 PoolBinding pool) {
  const std::vector<int64_t>& b = options.buckets;
  if (b.empty()) return absl::InvalidArgumentError("buckets must not be empty");
  for (size_t i = 0; i < b.size(); ++i) {
    if (b[i] < 1 || (i > 0 && b[i] <= b[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("buckets must be ascending, distinct and >= 1; bucket ", i, " is ", b[i]));
    }
  }
  if (options.warmup_runs < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("warmup_runs must be >= 0, got ", options.warmup_runs));
  }
  if (options.masked_rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("masked_rows must be >= 0, got ", options.masked_rows));
  }
  if (options.penalty_width < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("penalty_width must be >= 0, got ", options.penalty_width));
  }
  if (pool.state != nullptr) {
    if (absl::Status bound = CheckBinding(model, pool); !bound.ok()) return bound;
  }
  std::unique_ptr<GraphedStep> step(new GraphedStep(model, std::move(options)));
  step->binding_ = pool;
  const torch::Device device = model.options().device;
  const int64_t largest = step->options_.buckets.back();
  const int64_t width = step->options_.penalty_width;
  try {
    c10::NoGradGuard no_grad;
    const auto int64_on = torch::dtype(torch::kInt64).device(device);
    if (step->in_place()) {
      step->upload_words_per_row_ = 2 + kSampleColumns + width + 1;
      step->host_upload_ = torch::zeros({largest * step->upload_words_per_row_}, torch::kInt64);
      step->host_sampled_ = torch::zeros({largest, 2}, torch::kFloat64);
      if (device.is_cuda()) {
        step->host_upload_ = step->host_upload_.pin_memory();
        step->host_sampled_ = step->host_sampled_.pin_memory();
      }
      step->device_upload_ = torch::zeros({largest * step->upload_words_per_row_}, int64_on);
      const int64_t masked = step->options_.sample_in_step ? step->options_.masked_rows : 0;
      if (masked > 0) {
        const int64_t vocab = model.config().vocab_size;
        step->host_masks_ = torch::ones({masked, vocab}, torch::kUInt8);
        step->host_mask_rows_ = torch::zeros({masked}, torch::kInt64);
        if (device.is_cuda()) {
          step->host_masks_ = step->host_masks_.pin_memory();
          step->host_mask_rows_ = step->host_mask_rows_.pin_memory();
        }
        step->device_masks_ =
            torch::ones({masked, vocab}, torch::dtype(torch::kUInt8).device(device));
        step->device_mask_rows_ = torch::zeros({masked}, int64_on);
      }
    } else {
      step->host_indices_ = torch::zeros({2, largest}, torch::kInt64);
      if (device.is_cuda()) step->host_indices_ = step->host_indices_.pin_memory();
      step->device_indices_ = torch::zeros({2, largest}, int64_on);
    }
    for (int64_t size : step->options_.buckets) {
      auto bucket = std::make_unique<Bucket>();
      bucket->size = size;
      if (step->in_place()) {
        // This bucket's layout of the upload (GraphedStep::host_upload_).
        const torch::Tensor& up = step->device_upload_;
        bucket->tokens = up.narrow(0, 0, size);
        bucket->rows = up.narrow(0, size, size);
        bucket->columns = up.narrow(0, 2 * size, kSampleColumns * size)
                              .view(torch::kFloat64)
                              .view({kSampleColumns, size});
        bucket->penalty_index =
            up.narrow(0, (2 + kSampleColumns) * size, size * width).view({size, width});
        bucket->penalty_factor = up.narrow(0, (2 + kSampleColumns + width) * size, size)
                                     .view(torch::kFloat64)
                                     .view({size, 1});
      } else {
        bucket->tokens = step->device_indices_.select(0, 0).narrow(0, 0, size);
        bucket->rows = step->device_indices_.select(0, 1).narrow(0, 0, size);
        bucket->input = model.InitialState(size);
      }
      step->buckets_.push_back(std::move(bucket));
    }
#ifdef FWSERVE_CUDA_GRAPHS
    if (step->options_.capture && device.is_cuda()) {
      for (auto& bucket : step->buckets_) {
        try {
          if (step->in_place()) {
            // The buckets' layouts share the upload buffer: this one's must hold valid
            // pad rows (ids, rows, greedy parameters) before its warm-up and capture.
            const int64_t words = step->StageUpload({}, {}, {}, bucket->size);
            step->device_upload_.narrow(0, 0, words).copy_(step->host_upload_.narrow(0, 0, words));
          }
          step->Capture(*bucket);
        } catch (const c10::Error& e) {
          return absl::InternalError(absl::StrCat("CUDA Graph capture of bucket ", bucket->size,
                                                  " failed: ", e.what_without_backtrace()));
        }
      }
      step->captured_ = true;
    }
    if (device.is_cuda()) {
      cudaEvent_t start = nullptr, end = nullptr;
      if (cudaEventCreateWithFlags(&start, cudaEventDefault) == 0 &&
          cudaEventCreateWithFlags(&end, cudaEventDefault) == 0) {
        step->start_event_ = start;
        step->end_event_ = end;
        step->timing_ = true;
      }
    }
#endif
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("graphed step buffers: ", e.what_without_backtrace()));
  }
  return step;
}

GraphedStep::Bucket& GraphedStep::BucketForPass(int64_t n) {
  const int64_t size = BucketFor(n);
  Bucket& bucket = **std::find_if(buckets_.begin(), buckets_.end(),
                                  [size](const auto& b) { return b->size == size; });
  padded_rows_ += size - n;
  return bucket;
}

int64_t GraphedStep::BucketFor(int64_t n) const {
  for (int64_t size : options_.buckets) {
    if (size >= n) return size;
  }
  return options_.buckets.back();
}

absl::Status GraphedStep::CheckArguments(absl::Span<const int64_t> tokens,
                                         absl::Span<const int64_t> rows, const State& pool,
                                         const torch::Tensor* row_logits) const {
  if (tokens.empty()) return absl::InvalidArgumentError("a step needs at least one row");
  if (tokens.size() != rows.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens has ", tokens.size(), " entries, rows ", rows.size()));
  }
  if (absl::Status layout = CheckPoolLayout(model_, pool, row_logits, /*contiguous=*/false);
      !layout.ok()) {
    return layout;
  }
  const int64_t capacity = pool.tensors.empty() ? 0 : pool.tensors[0].size(0);
  const int64_t vocab = model_.config().vocab_size;
  std::vector<int64_t> sorted(rows.begin(), rows.end());
  std::sort(sorted.begin(), sorted.end());
  for (size_t b = 0; b < tokens.size(); ++b) {
    if (tokens[b] < 0 || tokens[b] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", tokens[b], " at position ", b, " is outside [0, ", vocab, ")"));
    }
    if (rows[b] < 0 || rows[b] >= capacity) {
      return absl::InvalidArgumentError(absl::StrCat("row ", rows[b], " at position ", b,
                                                     " is outside the pool [0, ", capacity, ")"));
    }
    if (b > 0 && sorted[b] == sorted[b - 1]) {
      return absl::InvalidArgumentError(absl::StrCat("row ", sorted[b], " appears twice"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> GraphedStep::Step(absl::Span<const int64_t> tokens,
                                                absl::Span<const int64_t> rows, State* pool,
                                                torch::Tensor* row_logits) {
  if (in_place()) {
    return absl::FailedPreconditionError("an in-place graphed step steps with StepInPlace");
  }
  if (absl::Status valid = CheckArguments(tokens, rows, *pool, row_logits); !valid.ok()) {
    return valid;
  }
  const absl::Time host_start = absl::Now();
  try {
    c10::NoGradGuard no_grad;
    BeginTiming();
    const size_t largest = static_cast<size_t>(options_.buckets.back());
    if (tokens.size() <= largest) {
      torch::Tensor logits = RunPass(tokens, rows, pool, row_logits);
      EndTiming(host_start);
      return logits;
    }
    // Each pass's logits are the bucket's buffer, overwritten by the next pass: copied.
    std::vector<torch::Tensor> parts;
    for (size_t begin = 0; begin < tokens.size(); begin += largest) {
      const size_t n = std::min(largest, tokens.size() - begin);
      parts.push_back(
          RunPass(tokens.subspan(begin, n), rows.subspan(begin, n), pool, row_logits).clone());
    }
    torch::Tensor logits = torch::cat(parts, 0);
    EndTiming(host_start);
    return logits;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("decode step: ", e.what_without_backtrace()));
  }
}

GraphedStep::SamplingKind GraphedStep::KindOf(absl::Span<const RowDraw> draws) const {
  for (const RowDraw& d : draws) {
    if (d.allowed != nullptr) return SamplingKind::kMasked;
  }
  return !options_.plain_sampling || AnyNeedsFilters(draws, model_.config().vocab_size)
             ? SamplingKind::kFiltered
             : SamplingKind::kPlain;
}

bool GraphedStep::CanSampleInStep(absl::Span<const RowDraw> draws) const {
  if (!in_place() || !options_.sample_in_step) return false;
  // Each pass stages at most masked_rows masks; the draws split into passes of the
  // largest bucket.
  const size_t largest = static_cast<size_t>(options_.buckets.back());
  for (size_t begin = 0; begin < draws.size(); begin += largest) {
    int64_t masked = 0;
    for (size_t i = begin; i < std::min(draws.size(), begin + largest); ++i) {
      if (draws[i].allowed != nullptr) ++masked;
    }
    if (masked > options_.masked_rows) return false;
  }
  for (const RowDraw& d : draws) {
    if (d.params == nullptr) return false;
    // Sampled apart (SampleRows): logit biases.
    if (!d.params->logit_bias.empty()) return false;
    if (d.params->repetition_penalty != 1.0f && d.recent != nullptr &&
        static_cast<int64_t>(d.recent->size()) > options_.penalty_width) {
      return false;
    }
  }
  return true;
}

absl::StatusOr<std::vector<SampledToken>> GraphedStep::StepInPlace(
    absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
    absl::Span<const RowDraw> draws) {
  if (!in_place()) {
    return absl::FailedPreconditionError("StepInPlace needs a graphed step bound to a pool");
  }
  if (absl::Status valid = CheckArguments(tokens, rows, *binding_.state, binding_.logits);
      !valid.ok()) {
    return valid;
  }
  for (size_t b = 0; b < rows.size(); ++b) {
    if (rows[b] == binding_.pad_row) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", rows[b], " at position ", b, " is the pool's pad row"));
    }
  }
  if (!draws.empty()) {
    if (draws.size() != rows.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("draws has ", draws.size(), " entries, rows ", rows.size()));
    }
    if (!CanSampleInStep(draws)) {
      return absl::FailedPreconditionError(
          "these draws cannot be sampled inside the step (sample_in_step off, missing "
          "params, or a repetition-penalty set wider than penalty_width)");
    }
  }
  const absl::Time host_start = absl::Now();
  std::vector<SampledToken> sampled(draws.size());
  try {
    c10::NoGradGuard no_grad;
    BeginTiming();
    const size_t largest = static_cast<size_t>(options_.buckets.back());
    for (size_t begin = 0; begin < tokens.size(); begin += largest) {
      const size_t n = std::min(largest, tokens.size() - begin);
      RunInPlacePass(tokens.subspan(begin, n), rows.subspan(begin, n),
                     draws.empty() ? draws : draws.subspan(begin, n),
                     draws.empty() ? nullptr : sampled.data() + begin);
    }
    EndTiming(host_start);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("decode step: ", e.what_without_backtrace()));
  }
  return sampled;
}

absl::StatusOr<std::vector<std::vector<SampledToken>>> GraphedStep::MultiStepInPlace(
    absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
    absl::Span<const RowDraw> draws, absl::Span<const double> uniforms, int64_t steps,
    absl::Span<const int64_t> limits, absl::Span<const int64_t> stop_tokens) {
  if (!in_place() || !options_.sample_in_step) {
    return absl::FailedPreconditionError(
        "MultiStepInPlace needs a graphed step bound to a pool that samples in its step");
  }
  if (absl::Status valid = CheckArguments(tokens, rows, *binding_.state, binding_.logits);
      !valid.ok()) {
    return valid;
  }
  const size_t n = tokens.size();
  if (steps < 1) return absl::InvalidArgumentError(absl::StrCat("steps must be >= 1, got ", steps));
  if (draws.size() != n || limits.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("draws has ", draws.size(), " entries, limits ", limits.size(), ", rows ", n));
  }
  if (uniforms.size() != n * static_cast<size_t>(steps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("uniforms has ", uniforms.size(),
                     " entries, want rows × steps = ", n * static_cast<size_t>(steps)));
  }
  for (size_t b = 0; b < n; ++b) {
    if (rows[b] == binding_.pad_row) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", rows[b], " at position ", b, " is the pool's pad row"));
    }
    if (limits[b] < 1 || limits[b] > steps) {
      return absl::InvalidArgumentError(
          absl::StrCat("limits[", b, "] must be in [1, ", steps, "], got ", limits[b]));
    }
    if (draws[b].params == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("draws[", b, "] has no params"));
    }
    if (draws[b].params->repetition_penalty != 1.0f) {
      return absl::FailedPreconditionError(
          absl::StrCat("draws[", b, "] has a repetition penalty: step it one token at a time"));
    }
    if (draws[b].params->AdjustsLogits()) {
      return absl::FailedPreconditionError(
          absl::StrCat("draws[", b, "] has a logit bias or penalty: step it one token at a time"));
    }
    if (draws[b].allowed != nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("draws[", b, "] has a constraint mask: step it one token at a time"));
    }
  }
  const int64_t vocab = model_.config().vocab_size;
  for (int64_t token : stop_tokens) {
    if (token < 0 || token >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop token ", token, " is outside the vocabulary [0, ", vocab, ")"));
    }
  }
  const absl::Time host_start = absl::Now();
  std::vector<std::vector<SampledToken>> drawn(n);
  try {
    c10::NoGradGuard no_grad;
    BeginTiming();
    const size_t largest = static_cast<size_t>(options_.buckets.back());
    for (size_t begin = 0; begin < n; begin += largest) {
      const size_t count = std::min(largest, n - begin);
      const size_t s = static_cast<size_t>(steps);
      RunMultiStepPass(tokens.subspan(begin, count), rows.subspan(begin, count),
                       draws.subspan(begin, count), uniforms.subspan(begin * s, count * s), steps,
                       limits.subspan(begin, count), stop_tokens, drawn.data() + begin);
    }
    EndTiming(host_start);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("multi-step decode: ", e.what_without_backtrace()));
  }
  return drawn;
}

void GraphedStep::RunMultiStepPass(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                                   absl::Span<const RowDraw> draws,
                                   absl::Span<const double> uniforms, int64_t steps,
                                   absl::Span<const int64_t> limits,
                                   absl::Span<const int64_t> stop_tokens,
                                   std::vector<SampledToken>* drawn) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  Bucket& bucket = BucketForPass(n);
  const int64_t size = bucket.size;
  // Step 0's parameters in the bucket's layout (the first uniform of each row).
  std::vector<RowDraw> first(draws.begin(), draws.end());
  for (int64_t b = 0; b < n; ++b) first[static_cast<size_t>(b)].uniform = uniforms[b * steps];
  const int64_t words_used = StageUpload(tokens, rows, first, size);
  const SamplingKind kind = KindOf(draws);  // never kMasked: MultiStepInPlace refuses masks
  // The rest: uniforms [steps, size] float64, limits [size] (pads: 1), stop tokens.
  const int64_t stops = static_cast<int64_t>(stop_tokens.size());
  const int64_t multi_words = steps * size + size + stops;
  const torch::Device device = model_.options().device;
  if (!host_multi_.defined() || host_multi_.numel() < multi_words) {
    host_multi_ = torch::zeros({multi_words}, torch::kInt64);
    if (device.is_cuda()) host_multi_ = host_multi_.pin_memory();
    device_multi_ = torch::zeros({multi_words}, torch::dtype(torch::kInt64).device(device));
  }
  int64_t* words = host_multi_.data_ptr<int64_t>();
  double* host_uniforms = reinterpret_cast<double*>(words);
  for (int64_t j = 0; j < steps; ++j) {
    for (int64_t b = 0; b < size; ++b) {
      host_uniforms[j * size + b] = b < n ? uniforms[b * steps + j] : 0.0;
    }
  }
  int64_t* host_limits = words + steps * size;
  for (int64_t b = 0; b < size; ++b) host_limits[b] = b < n ? limits[b] : 1;
  if (stops > 0) std::memcpy(host_limits + size, stop_tokens.data(), sizeof(int64_t) * stops);
  device_upload_.narrow(0, 0, words_used)
      .copy_(host_upload_.narrow(0, 0, words_used), /*non_blocking=*/true);
  device_multi_.narrow(0, 0, multi_words)
      .copy_(host_multi_.narrow(0, 0, multi_words), /*non_blocking=*/true);
  const torch::Tensor device_uniforms =
      device_multi_.narrow(0, 0, steps * size).view(torch::kFloat64).view({steps, size});
  const torch::Tensor device_limits = device_multi_.narrow(0, steps * size, size);
  const torch::Tensor device_stops = device_multi_.narrow(0, steps * size + size, stops);
  // The rows as staged (pads: the pad row); a row that stopped points at the pad row.
  const torch::Tensor staged_rows = bucket.rows.clone();
  const torch::Tensor pad_rows = torch::full_like(staged_rows, binding_.pad_row);
  const torch::Tensor no_token = torch::zeros_like(staged_rows);
  torch::Tensor active = torch::ones({size}, torch::dtype(torch::kBool).device(device));
  torch::Tensor results =
      torch::empty({steps, size, 2}, torch::dtype(torch::kFloat64).device(device));
  for (int64_t j = 0; j < steps; ++j) {
    if (j > 0) {
      const torch::Tensor previous = results[j - 1].select(1, 0).to(torch::kInt64);
      active = active & device_limits.gt(j);
      if (stops > 0) active = active & torch::isin(previous, device_stops).logical_not();
      bucket.tokens.copy_(torch::where(active, previous, no_token));
      bucket.rows.copy_(torch::where(active, staged_rows, pad_rows));
      bucket.columns[fwserve::kSampleUniform].copy_(device_uniforms[j]);
    }
    Compute(bucket, kind);
    results[j].copy_(bucket.Sampled(kind));
  }
  if (!host_drawn_.defined() || host_drawn_.numel() < steps * size * 2) {
    host_drawn_ = torch::zeros({steps * size * 2}, torch::kFloat64);
    if (device.is_cuda()) host_drawn_ = host_drawn_.pin_memory();
  }
  torch::Tensor out = host_drawn_.narrow(0, 0, steps * size * 2).view({steps, size, 2});
  out.copy_(results, /*non_blocking=*/true);
#ifdef FWSERVE_CUDA_GRAPHS
  if (device.is_cuda()) c10::cuda::getCurrentCUDAStream().synchronize();
#endif
  // The same stopping rule as the mask above, on the host.
  const double* values = out.data_ptr<double>();
  for (int64_t b = 0; b < n; ++b) {
    std::vector<SampledToken>& row = drawn[b];
    for (int64_t j = 0; j < limits[b]; ++j) {
      const double* pair = values + (j * size + b) * 2;
      SampledToken t;
      t.token = static_cast<int64_t>(pair[0]);
      t.logprob = static_cast<float>(pair[1]);
      row.push_back(t);
      if (std::find(stop_tokens.begin(), stop_tokens.end(), t.token) != stop_tokens.end()) break;
    }
  }
}

void GraphedStep::RunInPlacePass(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                                 absl::Span<const RowDraw> draws, SampledToken* sampled) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  Bucket& bucket = BucketForPass(n);
  const int64_t size = bucket.size;
  const int64_t words_used = StageUpload(tokens, rows, draws, size);
  // One copy to the device; the staging buffer is rewritten only after this pass's
  // results came back (below), so the copy may run asynchronously.
  device_upload_.narrow(0, 0, words_used)
      .copy_(host_upload_.narrow(0, 0, words_used), /*non_blocking=*/true);
  const SamplingKind kind = KindOf(draws);
  if (kind == SamplingKind::kMasked) StageMasks(draws, size);
  Compute(bucket, kind);
  if (sampled != nullptr) {
    torch::Tensor out = host_sampled_.narrow(0, 0, n);
    out.copy_(bucket.Sampled(kind).narrow(0, 0, n), /*non_blocking=*/true);
#ifdef FWSERVE_CUDA_GRAPHS
    if (model_.options().device.is_cuda()) c10::cuda::getCurrentCUDAStream().synchronize();
#endif
    const double* values = out.data_ptr<double>();
    for (int64_t b = 0; b < n; ++b) {
      sampled[b].token = static_cast<int64_t>(values[2 * b]);
      sampled[b].logprob = static_cast<float>(values[2 * b + 1]);
    }
  } else {
#ifdef FWSERVE_CUDA_GRAPHS
    // The next pass rewrites the staging buffer.
    if (model_.options().device.is_cuda()) c10::cuda::getCurrentCUDAStream().synchronize();
#endif
  }
}

int64_t GraphedStep::StageUpload(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                                 absl::Span<const RowDraw> draws, int64_t size) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t width = options_.penalty_width;
  const int64_t vocab = model_.config().vocab_size;
  // This bucket's layout (host_upload_): pads are the pad row, token 0, greedy.
  int64_t* words = host_upload_.data_ptr<int64_t>();
  int64_t* host_tokens = words;
  int64_t* host_rows = words + size;
  double* columns = reinterpret_cast<double*>(words + 2 * size);
  int64_t* penalty_index = words + (2 + kSampleColumns) * size;
  double* penalty_factor = reinterpret_cast<double*>(words + (2 + kSampleColumns + width) * size);
  if (n > 0) {
    std::memcpy(host_tokens, tokens.data(), sizeof(int64_t) * n);
    std::memcpy(host_rows, rows.data(), sizeof(int64_t) * n);
  }
  std::fill(host_tokens + n, host_tokens + size, int64_t{0});
  std::fill(host_rows + n, host_rows + size, binding_.pad_row);
  std::vector<RowDraw> padded(static_cast<size_t>(size));
  static const SamplingParams kGreedy = [] {
    SamplingParams p;
    p.temperature = 0;
    return p;
  }();
  for (int64_t b = 0; b < size; ++b) {
    RowDraw& d = padded[static_cast<size_t>(b)];
    if (b < static_cast<int64_t>(draws.size())) d = draws[static_cast<size_t>(b)];
    if (d.params == nullptr) d.params = &kGreedy;
    d.row = b;
  }
  fwserve::PackDraws(padded, vocab, width, columns, penalty_index, penalty_factor);
  return size * upload_words_per_row_;
}

void GraphedStep::StageMasks(absl::Span<const RowDraw> draws, int64_t size) {
  const int64_t vocab = model_.config().vocab_size;
  const int64_t capacity = options_.masked_rows;
  uint8_t* masks = host_masks_.data_ptr<uint8_t>();
  int64_t* mask_rows = host_mask_rows_.data_ptr<int64_t>();
  int64_t used = 0;
  for (size_t b = 0; b < draws.size() && used < capacity; ++b) {
    if (draws[b].allowed == nullptr) continue;
    std::memcpy(masks + used * vocab, draws[b].allowed, static_cast<size_t>(vocab));
    mask_rows[used++] = static_cast<int64_t>(b);
  }
  // The unused entries land on the scratch row past the bucket's rows, which no row
  // reads: their masks need neither be written nor copied.
  std::fill(mask_rows + used, mask_rows + capacity, size);
  // The next pass rewrites the staging buffers only after this one synchronised.
  device_masks_.narrow(0, 0, used).copy_(host_masks_.narrow(0, 0, used), /*non_blocking=*/true);
  device_mask_rows_.copy_(host_mask_rows_, /*non_blocking=*/true);
}

void GraphedStep::BucketWork(Bucket& bucket, SamplingKind kind) {
  if (!in_place()) {
    State state = bucket.input;  // the step replaces the tensors; the buffers stay
    bucket.logits = model_.StepUnchecked(bucket.tokens, &state);
    bucket.output = std::move(state);
    return;
  }
  State state = binding_.state->Gather(bucket.rows);
  bucket.logits = model_.StepUnchecked(bucket.tokens, &state);
  // The state's rows and the logits' in one State::Scatter (one launch on CUDA).
  State pool_rows = *binding_.state;
  pool_rows.tensors.push_back(*binding_.logits);
  state.tensors.push_back(bucket.logits.to(torch::kFloat32));
  pool_rows.Scatter(bucket.rows, state);
  if (!options_.sample_in_step) return;
  switch (kind) {
    case SamplingKind::kPlain:
      bucket.sampled_plain =
          fwserve::SampleOnDevice(bucket.logits, bucket.columns, bucket.penalty_index,
                                  bucket.penalty_factor, /*filters=*/false);
      break;
    case SamplingKind::kFiltered:
      bucket.sampled = fwserve::SampleOnDevice(bucket.logits, bucket.columns, bucket.penalty_index,
                                               bucket.penalty_factor, /*filters=*/true);
      break;
    case SamplingKind::kMasked: {
      // Every row allowed everything but the staged ones; one scratch row past the
      // bucket's takes the unused entries (whatever their masks hold).
      torch::Tensor allowed =
          torch::ones({bucket.size + 1, model_.config().vocab_size},
                      torch::dtype(torch::kBool).device(bucket.logits.device()));
      allowed.index_copy_(0, device_mask_rows_, device_masks_.to(torch::kBool));
      bucket.sampled_masked = fwserve::SampleOnDevice(
          bucket.logits, bucket.columns, bucket.penalty_index, bucket.penalty_factor,
          /*filters=*/true, torch::Tensor(), torch::Tensor(), allowed.narrow(0, 0, bucket.size));
      break;
    }
  }
}

void GraphedStep::BeginTiming() {
#ifdef FWSERVE_CUDA_GRAPHS
  if (timing_) {
    cudaEventRecord(static_cast<cudaEvent_t>(start_event_),
                    c10::cuda::getCurrentCUDAStream().stream());
  }
#endif
}

void GraphedStep::EndTiming(absl::Time host_start) {
#ifdef FWSERVE_CUDA_GRAPHS
  if (timing_) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    cudaEventRecord(static_cast<cudaEvent_t>(end_event_), stream);
    float ms = 0;
    if (cudaEventSynchronize(static_cast<cudaEvent_t>(end_event_)) == 0 &&
        cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start_event_),
                             static_cast<cudaEvent_t>(end_event_)) == 0) {
      last_step_time_ = absl::Microseconds(static_cast<int64_t>(ms * 1000));
      return;
    }
  }
#endif
  last_step_time_ = absl::Now() - host_start;
}

torch::Tensor GraphedStep::RunPass(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                                   State* pool, torch::Tensor* row_logits) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  Bucket& bucket = BucketForPass(n);
  const int64_t size = bucket.size;
  // Tokens and rows, padded (token 0 on a copy of the first row), in one copy.
  int64_t* host = host_indices_.data_ptr<int64_t>();
  const int64_t stride = host_indices_.size(1);
  std::memcpy(host, tokens.data(), sizeof(int64_t) * n);
  std::memcpy(host + stride, rows.data(), sizeof(int64_t) * n);
  std::fill(host + n, host + size, int64_t{0});
  std::fill(host + stride + n, host + stride + size, rows[0]);
  // Blocking: the next pass (or step) rewrites the staging buffer.
  device_indices_.narrow(1, 0, size).copy_(host_indices_.narrow(1, 0, size));
  for (size_t i = 0; i < pool->tensors.size(); ++i) {
    torch::index_select_out(bucket.input.tensors[i], pool->tensors[i], 0, bucket.rows);
  }
  Compute(bucket, SamplingKind::kFiltered);
  torch::Tensor written = bucket.rows.narrow(0, 0, n);
  for (size_t i = 0; i < pool->tensors.size(); ++i) {
    pool->tensors[i].index_copy_(0, written, bucket.output.tensors[i].narrow(0, 0, n));
  }
  torch::Tensor logits = bucket.logits.narrow(0, 0, n);
  if (row_logits != nullptr) row_logits->index_copy_(0, written, logits.to(torch::kFloat32));
  return logits;
}

void GraphedStep::Compute(Bucket& bucket, SamplingKind kind) {
#ifdef FWSERVE_CUDA_GRAPHS
  if (kind == SamplingKind::kPlain && bucket.plain_graph != nullptr) {
    bucket.plain_graph->replay();
    return;
  }
  if (kind == SamplingKind::kMasked && bucket.masked_graph != nullptr) {
    bucket.masked_graph->replay();
    return;
  }
  if (bucket.graph != nullptr) {
    bucket.graph->replay();
    return;
  }
#endif
  BucketWork(bucket, kind);
}

void GraphedStep::Capture(Bucket& bucket) {
#ifdef FWSERVE_CUDA_GRAPHS
  const c10::cuda::CUDAGuard device_guard(model_.options().device);
  c10::cuda::getCurrentCUDAStream().synchronize();  // the buffers are initialised
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, model_.options().device.index());
  {
    // Capture needs a stream other than the default one. Warm-up runs there too.
    const c10::cuda::CUDAStreamGuard stream_guard(side);
    // In place, the warm-up runs write only the pad row (every row of the upload is
    // the pad row until the first step).
    // The warm-up runs, then the capture of the bucket's work with sampling `kind`, into
    // `pool` (null: a new one).
    auto capture = [&](SamplingKind kind, at::cuda::CUDAGraph* pool) {
      for (int i = 0; i < options_.warmup_runs; ++i) BucketWork(bucket, kind);
      side.synchronize();
      auto graph = std::make_unique<at::cuda::CUDAGraph>();
      if (pool != nullptr) {
        graph->capture_begin(pool->pool());
      } else {
        graph->capture_begin();
      }
      BucketWork(bucket, kind);
      graph->capture_end();
      return graph;
    };
    std::unique_ptr<at::cuda::CUDAGraph> graph = capture(SamplingKind::kFiltered, nullptr);
    // The other samplings' graphs, in the same pool: each capture's sampled output stays
    // referenced by the bucket (sampled, sampled_plain, sampled_masked), so no graph's
    // replay writes another's; what else a capture freed is scratch within a replay.
    if (in_place() && options_.sample_in_step && options_.plain_sampling) {
      bucket.plain_graph = capture(SamplingKind::kPlain, graph.get());
    }
    if (in_place() && options_.sample_in_step && options_.masked_rows > 0) {
      // Its mask rows point at row 0 (any bucket has one) with everything allowed until a
      // pass stages its own.
      device_mask_rows_.zero_();
      device_masks_.fill_(1);
      bucket.masked_graph = capture(SamplingKind::kMasked, graph.get());
    }
    bucket.graph = std::move(graph);
  }
  side.synchronize();
#else
  (void)bucket;
#endif
}

}  // namespace fwmodel
