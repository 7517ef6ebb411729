#include "server/engine/stepper.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "server/base/log.h"

namespace fwserve {
bool Stepper::UsesGraphKernel(const fwmodel::Model& model, const std::string& decode_kernel) {
  return decode_kernel == "graph" ||
         (decode_kernel == "native" && model.options().device.is_cuda());
}

Stepper::Stepper(const fwmodel::Model& model, const std::string& decode_kernel, bool packed_gemm,
                 int32_t step_threads, int32_t prefill_threads, const std::string& name,
                 StatePool* pool, bool sample_in_step, bool sample_without_sort)
    : model_(model), vocab_(model.config().vocab_size) {
  if (decode_kernel == kNullKernel) {
    // Pre-drawn tokens, the same every run: printable ASCII for a byte vocabulary (every
    // token a whole character), else any id but 0 (RWKV's end of text).
    std::mt19937_64 rng(20261128);
    const bool bytes = vocab_ <= 256;
    std::uniform_int_distribution<int64_t> pick(bytes ? 32 : 1, bytes ? 126 : vocab_ - 1);
    null_tokens_.resize(4096);
    for (int64_t& token : null_tokens_) token = pick(rng);
    Log(LogLevel::kWarning,
        absl::StrCat("model ", name, ": --benchmark-null-step: the decode step and prefill do ",
                     "no model work, tokens are pre-drawn (benchmarks only)"));
    return;
  }
  const bool cpu_float32 =
      model_.options().device.is_cpu() && model_.options().dtype == torch::kFloat32;
  if (decode_kernel == "native" && cpu_float32) {
    fwmodel::NativeStepOptions options;
    options.packed_gemm = packed_gemm;
    options.threads = step_threads;
    auto native = fwmodel::NativeStep::Create(model_, options);
    options.threads = prefill_threads;
    // The prefill thread's instance shares the decode instance's weights where the
    // kernel can (RWKV: the copy is most of a real model's size).
    absl::StatusOr<std::unique_ptr<fwmodel::NativeStep>> native_prefill =
        native.ok() ? fwmodel::NativeStep::CreateSharing(**native, options) : native.status();
    if (native.ok() && native_prefill.ok()) {
      native_step_ = std::move(*native);
      native_prefill_ = std::move(*native_prefill);
      Log(LogLevel::kInfo,
          absl::StrCat(
              "model ", name, ": native decode step, GEMMs on ",
              packed_gemm ? fwmodel::PackedLinear::Backend() : "openblas",
              packed_gemm ? " (OpenBLAS for products of >= 16 rows over >= 768 inputs)" : "",
              ", weights kept as ", native_step_->weight_format(), ", ", step_threads,
              " decode and ", prefill_threads, " prefill threads"));
      return;
    }
    Log(LogLevel::kWarning, absl::StrCat("model ", name, ": native decode step unavailable (",
                                         native.status().message(), "); using LibTorch"));
    return;
  }
  // A CUDA model takes the graph kernel unless LibTorch's reference was asked for.
  if (!UsesGraphKernel(model_, decode_kernel)) return;
  fwmodel::GraphedStepOptions graph_options;
  fwmodel::PoolBinding binding;
  if (pool != nullptr && pool->preallocated()) {
    binding = {pool->mutable_state(), pool->mutable_logits(), pool->pad_row()};
    graph_options.sample_in_step = sample_in_step;
    graph_options.plain_sampling = sample_without_sort;
  }
  if (model_.options().device.is_cuda()) {
    // Buckets up to the pool's rows in use at once, at most 4,096.
    const int64_t most = std::min<int64_t>(4096, pool != nullptr ? pool->max_slots() : 256);
    while (graph_options.buckets.back() < most) {
      graph_options.buckets.push_back(graph_options.buckets.back() * 2);
    }
  }
  auto graphed = fwmodel::GraphedStep::Create(model_, graph_options, binding);
  if (!graphed.ok()) {
    Log(LogLevel::kWarning, absl::StrCat("model ", name, ": graph decode step unavailable (",
                                         graphed.status().message(), "); using LibTorch"));
    return;
  }
  graphed_step_ = std::move(*graphed);
  Log(LogLevel::kInfo,
      absl::StrCat("model ", name, ": graph decode step, ", graphed_step_->buckets().size(),
                   " batch buckets up to ", graphed_step_->buckets().back(),
                   graphed_step_->captured() ? ", captured as CUDA Graphs" : ", eager",
                   graphed_step_->in_place()
                       ? (graph_options.sample_in_step ? ", in place, sampling inside the step"
                                                       : ", in place")
                       : ""));
}

absl::Status Stepper::Step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                           StatePool& pool, absl::Span<const SampleRequest> draws) {
  presampled_.clear();
  if (null_step()) {
    last_step_time_ = absl::ZeroDuration();
    return absl::OkStatus();
  }
  const absl::Time start = absl::Now();
  absl::Status stepped = StepOnKernel(rows, tokens, pool, draws);
  last_step_time_ =
      graphed_step_ != nullptr ? graphed_step_->last_step_time() : absl::Now() - start;
  return stepped;
}

absl::Status Stepper::StepAhead(const std::vector<int64_t>& rows,
                                const std::vector<int64_t>& tokens, StatePool& pool,
                                absl::Span<const SampleRequest> draws, const MultiStep& multi,
                                std::vector<std::vector<SampledToken>>* absorbed_ahead) {
  absorbed_ahead->assign(rows.size(), {});
  if (multi.steps <= 1 || !multi_step() || draws.size() != rows.size()) {
    return Step(rows, tokens, pool, draws);
  }
  // No more replays than the most any row may draw: a launch whose rows may all draw
  // one is a plain step.
  int64_t steps = 1;
  for (size_t i = 0; i < rows.size() && i < multi.limits.size(); ++i) {
    steps = std::max(steps, std::min(multi.limits[i], multi.steps));
  }
  if (steps <= 1) return Step(rows, tokens, pool, draws);
  presampled_.clear();
  std::vector<RowDraw> row_draws(draws.size());
  std::vector<double> uniforms(draws.size() * static_cast<size_t>(steps), 0.0);
  std::vector<int64_t> limits(draws.size(), 1);
  for (size_t i = 0; i < draws.size(); ++i) {
    const SampleRequest& r = draws[i];
    row_draws[i].params = r.params;
    // MultiStepInPlace refuses repetition penalties, logit biases and constraint masks:
    // a batch with one steps one token.
    if (r.params->repetition_penalty != 1.0f || r.params->AdjustsLogits() || r.allowed != nullptr) {
      return Step(rows, tokens, pool, draws);
    }
    limits[i] = i < multi.limits.size() ? std::clamp<int64_t>(multi.limits[i], 1, steps) : 1;
    if (r.params->temperature != 0) {
      // A copy: the generator advances as the tokens are taken (the caller, then Sample).
      std::mt19937_64 peek = *r.rng;
      for (int64_t j = 0; j < steps; ++j) {
        uniforms[i * static_cast<size_t>(steps) + static_cast<size_t>(j)] = CanonicalDraw(peek);
      }
    }
  }
  auto drawn = graphed_step_->MultiStepInPlace(tokens, rows, row_draws, uniforms, steps, limits,
                                               multi.stop_tokens);
  last_step_time_ = graphed_step_->last_step_time();
  if (!drawn.ok()) return drawn.status();
  for (size_t i = 0; i < drawn->size(); ++i) {
    std::vector<SampledToken>& row = (*drawn)[i];
    const size_t last = row.size() - 1;
    presampled_[rows[i]] = Presampled{row[last], uniforms[i * static_cast<size_t>(steps) + last],
                                      draws[i].params, draws[i].rng, nullptr};
    row.pop_back();
    (*absorbed_ahead)[i] = std::move(row);
  }
  return absl::OkStatus();
}

absl::Status Stepper::StepOnKernel(const std::vector<int64_t>& rows,
                                   const std::vector<int64_t>& tokens, StatePool& pool,
                                   absl::Span<const SampleRequest> draws) {
  if (graphed_step_ != nullptr && graphed_step_->in_place()) {
    std::vector<RowDraw> row_draws(draws.size());
    std::vector<double> uniforms(draws.size(), 0.0);
    for (size_t i = 0; i < draws.size(); ++i) {
      const SampleRequest& r = draws[i];
      row_draws[i].params = r.params;
      row_draws[i].recent = r.recent;
      row_draws[i].allowed = r.allowed;
      if (r.params->temperature != 0) {
        // A copy: the generator advances when the token is handed out (Sample).
        std::mt19937_64 peek = *r.rng;
        uniforms[i] = row_draws[i].uniform = CanonicalDraw(peek);
      }
    }
    if (draws.size() != rows.size() || !graphed_step_->CanSampleInStep(row_draws)) {
      row_draws.clear();
    }
    auto sampled = graphed_step_->StepInPlace(tokens, rows, row_draws);
    if (!sampled.ok()) return sampled.status();
    for (size_t i = 0; i < sampled->size(); ++i) {
      presampled_[rows[i]] =
          Presampled{(*sampled)[i], uniforms[i], draws[i].params, draws[i].rng, draws[i].allowed};
    }
    return absl::OkStatus();
  }
  if (native_step_ != nullptr) {
    // In place: the pool's rows absorb their tokens; no copies of the state.
    step_logits_.resize(rows.size() * static_cast<size_t>(vocab_));
    absl::Status stepped =
        native_step_->Step(tokens, rows, pool.mutable_state(), step_logits_.data());
    if (stepped.ok()) pool.SetLogits(rows, step_logits_.data());
    return stepped;
  }
  if (graphed_step_ != nullptr) {
    // The rows' states and logits are written on the device; nothing comes back.
    return graphed_step_->Step(tokens, rows, pool.mutable_state(), pool.mutable_logits()).status();
  }
  const torch::Device device = model_.options().device;
  torch::Tensor row_index = torch::tensor(rows, torch::kInt64).to(device);
  fwmodel::State state = pool.Gather(row_index);
  auto logits = model_.Step(torch::tensor(tokens, torch::kInt64).to(device), &state);
  if (!logits.ok()) return logits.status();
  pool.Scatter(row_index, state);
  pool.SetLogits(row_index, *logits);
  return absl::OkStatus();
}

std::vector<SampledToken> Stepper::SampleNull(absl::Span<const SampleRequest> requests) {
  std::vector<SampledToken> out(requests.size());
  for (SampledToken& sampled : out) {
    sampled.token = null_tokens_[null_next_];
    null_next_ = (null_next_ + 1) % null_tokens_.size();
  }
  return out;
}

absl::StatusOr<std::vector<SampledToken>> Stepper::Sample(absl::Span<const SampleRequest> requests,
                                                          const StatePool& pool) {
  if (null_step()) return SampleNull(requests);
  if (!presampled_.empty()) {
    // Drawn inside the last step: hand those out, and sample the rest as usual.
    std::vector<SampledToken> out(requests.size());
    std::vector<SampleRequest> rest;
    std::vector<size_t> rest_positions;
    for (size_t i = 0; i < requests.size(); ++i) {
      const SampleRequest& r = requests[i];
      auto it = presampled_.find(r.slot);
      bool taken = false;
      if (it != presampled_.end() && it->second.params == r.params && it->second.rng == r.rng &&
          it->second.allowed == r.allowed) {
        if (r.params->temperature == 0) {
          taken = true;
        } else {
          // The generator was untouched since the step's copy: the same draw.
          std::mt19937_64 before = *r.rng;
          if (CanonicalDraw(*r.rng) == it->second.uniform) {
            taken = true;
          } else {
            *r.rng = before;
          }
        }
      }
      if (taken) {
        out[i] = it->second.sampled;
        if (!r.logprobs) out[i].logprob = 0;
      } else {
        rest.push_back(r);
        rest_positions.push_back(i);
      }
    }
    presampled_.clear();
    if (!rest.empty()) {
      auto sampled = SampleApart(rest, pool);
      if (!sampled.ok()) return sampled.status();
      for (size_t j = 0; j < rest.size(); ++j) out[rest_positions[j]] = (*sampled)[j];
    }
    return out;
  }
  return SampleApart(requests, pool);
}

absl::StatusOr<std::vector<SampledToken>> Stepper::SampleApart(
    absl::Span<const SampleRequest> requests, const StatePool& pool) {
  if (graphed_step_ != nullptr || !pool.all_logits().device().is_cpu()) {
    // On the logits' device (a CUDA model with any kernel).
    std::vector<RowDraw> draws(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      const SampleRequest& r = requests[i];
      draws[i].row = r.slot;
      draws[i].params = r.params;
      draws[i].recent = r.recent;
      draws[i].allowed = r.allowed;
      // The generator advances as SampleToken's would.
      if (r.params->temperature != 0) draws[i].uniform = CanonicalDraw(*r.rng);
    }
    auto sampled = SampleRows(pool.all_logits(), draws);
    if (!sampled.ok()) return sampled.status();
    for (size_t i = 0; i < requests.size(); ++i) {
      if (!requests[i].logprobs) (*sampled)[i].logprob = 0;
    }
    return sampled;
  }
  std::vector<SampledToken> sampled(requests.size());
  const torch::Tensor& all_logits = pool.all_logits();
  const float* logits_base = all_logits.data_ptr<float>();
  const int64_t row_stride = all_logits.stride(0);
  // Rows are independent (each draws from its own generator), so they split over the
  // intra-op threads; the draws are the same however they split. A task gets at least
  // kLogitsPerSamplingTask logits (two rows of a 65,536-token vocabulary, about 0.2 ms):
  // below that a team's start and join cost more than they save.
  constexpr int64_t kLogitsPerSamplingTask = 131072;
  const int64_t rows_per_task = std::max<int64_t>(1, kLogitsPerSamplingTask / vocab_);
  at::parallel_for(
      0, static_cast<int64_t>(requests.size()), rows_per_task, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const SampleRequest& r = requests[static_cast<size_t>(i)];
          const float* logits = logits_base + r.slot * row_stride;
          SampledToken& out = sampled[static_cast<size_t>(i)];
          out.token = SampleToken(logits, vocab_, *r.params, *r.rng, *r.recent, r.allowed);
          out.logprob =
              r.logprobs ? static_cast<float>(TokenLogProb(logits, vocab_, out.token)) : 0.0f;
        }
      });
  return sampled;
}

absl::Status Stepper::TopAlternatives(
    absl::Span<const SampleRequest> requests, const StatePool& pool,
    std::vector<std::vector<std::pair<int64_t, float>>>* out) const {
  out->clear();
  bool any = false;
  for (const SampleRequest& r : requests) any = any || r.top_logprobs > 0;
  if (!any) return absl::OkStatus();
  out->resize(requests.size());
  if (null_step()) return absl::OkStatus();
  try {
    const torch::Tensor& all_logits = pool.all_logits();
    for (size_t i = 0; i < requests.size(); ++i) {
      const SampleRequest& r = requests[i];
      if (r.top_logprobs <= 0) continue;
      torch::Tensor row = all_logits.select(0, r.slot);
      if (!row.device().is_cpu() || row.scalar_type() != torch::kFloat32 || !row.is_contiguous()) {
        row = row.to(torch::kCPU, torch::kFloat32).contiguous();
      }
      (*out)[i] = TopLogProbs(row.data_ptr<float>(), vocab_, r.top_logprobs);
    }
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat("top_logprobs: ", e.what_without_backtrace()));
  }
  return absl::OkStatus();
}

absl::StatusOr<torch::Tensor> Stepper::Prefill(const torch::Tensor& tokens, fwmodel::State* state) {
  const int64_t batch = tokens.size(0);
  const int64_t length = tokens.size(1);
  if (null_step()) {
    return torch::zeros({batch, vocab_},
                        torch::TensorOptions(torch::kFloat32).device(model_.options().device));
  }
  if (native_prefill_ != nullptr) {
    // The rows are the job's own copy ([B, ...], contiguous): rows 0..B-1.
    torch::Tensor contiguous = tokens.contiguous();
    std::vector<int64_t> rows(static_cast<size_t>(batch));
    std::iota(rows.begin(), rows.end(), int64_t{0});
    torch::Tensor logits = torch::empty({batch, vocab_}, torch::kFloat32);
    absl::Status absorbed = native_prefill_->Absorb(
        absl::MakeConstSpan(contiguous.data_ptr<int64_t>(), static_cast<size_t>(batch * length)),
        length, rows, state, logits.data_ptr<float>());
    if (!absorbed.ok()) return absorbed;
    return logits;
  }
  auto logits = model_.Prefill(tokens, state);
  if (!logits.ok()) return logits.status();
  return logits->to(torch::kFloat32).contiguous();
}

absl::StatusOr<std::vector<double>> Stepper::Score(const std::vector<int64_t>& tokens,
                                                   fwmodel::ScoringContext* context,
                                                   int64_t chunk) {
  return fwmodel::ScoreTokens(model_, tokens, context, chunk, native_prefill_.get());
}

}  // namespace fwserve
