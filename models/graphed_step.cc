#include "models/graphed_step.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

#ifdef FWSERVE_CUDA_GRAPHS
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace fwmodel {

struct GraphedStep::Bucket {
  int64_t size = 0;
  // Views of device_indices_ (fixed addresses, so a graph can read them).
  torch::Tensor tokens, rows;
  State input;           // [size, ...]: the gathered rows
  State output;          // the rows after the step
  torch::Tensor logits;  // [size, vocab]
#ifdef FWSERVE_CUDA_GRAPHS
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
};

GraphedStep::GraphedStep(const Model& model, GraphedStepOptions options)
    : model_(model), options_(std::move(options)) {}

GraphedStep::~GraphedStep() = default;

absl::StatusOr<std::unique_ptr<GraphedStep>> GraphedStep::Create(const Model& model,
                                                                 GraphedStepOptions options) {
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
  std::unique_ptr<GraphedStep> step(new GraphedStep(model, std::move(options)));
  const torch::Device device = model.options().device;
  const int64_t largest = step->options_.buckets.back();
  try {
    torch::NoGradGuard no_grad;
    step->host_indices_ = torch::zeros({2, largest}, torch::kInt64);
    if (device.is_cuda()) step->host_indices_ = step->host_indices_.pin_memory();
    step->device_indices_ = torch::zeros({2, largest}, torch::dtype(torch::kInt64).device(device));
    for (int64_t size : step->options_.buckets) {
      auto bucket = std::make_unique<Bucket>();
      bucket->size = size;
      bucket->tokens = step->device_indices_.select(0, 0).narrow(0, 0, size);
      bucket->rows = step->device_indices_.select(0, 1).narrow(0, 0, size);
      bucket->input = model.InitialState(size);
      step->buckets_.push_back(std::move(bucket));
    }
#ifdef FWSERVE_CUDA_GRAPHS
    if (step->options_.capture && device.is_cuda()) {
      for (auto& bucket : step->buckets_) {
        try {
          step->Capture(*bucket);
        } catch (const c10::Error& e) {
          return absl::InternalError(absl::StrCat("CUDA Graph capture of bucket ", bucket->size,
                                                  " failed: ", e.what_without_backtrace()));
        }
      }
      step->captured_ = true;
    }
#endif
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("graphed step buffers: ", e.what_without_backtrace()));
  }
  return step;
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
  const std::vector<StateTensorSpec>& spec = model_.state_spec();
  if (pool.tensors.size() != spec.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool has ", pool.tensors.size(), " state tensors, expected ", spec.size()));
  }
  const int64_t capacity = pool.tensors.empty() ? 0 : pool.tensors[0].size(0);
  for (size_t i = 0; i < spec.size(); ++i) {
    const torch::Tensor& t = pool.tensors[i];
    std::vector<int64_t> shape = {capacity};
    shape.insert(shape.end(), spec[i].shape.begin(), spec[i].shape.end());
    if (!t.defined() || t.sizes().vec() != shape || t.device() != model_.options().device ||
        t.scalar_type() != model_.options().dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat("pool tensor '", spec[i].name,
                       "' does not match the model's state (shape, device or dtype)"));
    }
  }
  const int64_t vocab = model_.config().vocab_size;
  if (row_logits != nullptr &&
      (!row_logits->defined() ||
       row_logits->sizes().vec() != std::vector<int64_t>{capacity, vocab} ||
       row_logits->device() != model_.options().device ||
       row_logits->scalar_type() != torch::kFloat32)) {
    return absl::InvalidArgumentError(
        "row_logits must be [pool capacity, vocab] float32 on the model's device");
  }
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
  if (absl::Status valid = CheckArguments(tokens, rows, *pool, row_logits); !valid.ok()) {
    return valid;
  }
  try {
    torch::NoGradGuard no_grad;
    const size_t largest = static_cast<size_t>(options_.buckets.back());
    if (tokens.size() <= largest) return RunPass(tokens, rows, pool, row_logits);
    // Each pass's logits are the bucket's buffer, overwritten by the next pass: copied.
    std::vector<torch::Tensor> parts;
    for (size_t begin = 0; begin < tokens.size(); begin += largest) {
      const size_t n = std::min(largest, tokens.size() - begin);
      parts.push_back(
          RunPass(tokens.subspan(begin, n), rows.subspan(begin, n), pool, row_logits).clone());
    }
    return torch::cat(parts, 0);
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("decode step: ", e.what_without_backtrace()));
  }
}

torch::Tensor GraphedStep::RunPass(absl::Span<const int64_t> tokens, absl::Span<const int64_t> rows,
                                   State* pool, torch::Tensor* row_logits) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t size = BucketFor(n);
  Bucket& bucket = **std::find_if(buckets_.begin(), buckets_.end(),
                                  [size](const auto& b) { return b->size == size; });
  padded_rows_ += size - n;
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
  Compute(bucket);
  torch::Tensor written = bucket.rows.narrow(0, 0, n);
  for (size_t i = 0; i < pool->tensors.size(); ++i) {
    pool->tensors[i].index_copy_(0, written, bucket.output.tensors[i].narrow(0, 0, n));
  }
  torch::Tensor logits = bucket.logits.narrow(0, 0, n);
  if (row_logits != nullptr) row_logits->index_copy_(0, written, logits.to(torch::kFloat32));
  return logits;
}

void GraphedStep::Compute(Bucket& bucket) {
#ifdef FWSERVE_CUDA_GRAPHS
  if (bucket.graph != nullptr) {
    bucket.graph->replay();
    return;
  }
#endif
  State state = bucket.input;  // the step replaces the tensors; the buffers stay
  bucket.logits = model_.StepUnchecked(bucket.tokens, &state);
  bucket.output = std::move(state);
}

void GraphedStep::Capture(Bucket& bucket) {
#ifdef FWSERVE_CUDA_GRAPHS
  const c10::cuda::CUDAGuard device_guard(model_.options().device);
  c10::cuda::getCurrentCUDAStream().synchronize();  // the buffers are initialised
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, model_.options().device.index());
  {
    // Capture needs a stream other than the default one. Warm-up runs there too.
    const c10::cuda::CUDAStreamGuard stream_guard(side);
    for (int i = 0; i < options_.warmup_runs; ++i) {
      State warm = bucket.input;
      (void)model_.StepUnchecked(bucket.tokens, &warm);
    }
    side.synchronize();
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    graph->capture_begin();
    State state = bucket.input;
    bucket.logits = model_.StepUnchecked(bucket.tokens, &state);
    bucket.output = std::move(state);
    graph->capture_end();
    bucket.graph = std::move(graph);
  }
  side.synchronize();
#else
  (void)bucket;
#endif
}

}  // namespace fwmodel
