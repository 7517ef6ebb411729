// The model's compute, as the engine uses it: one batched decode step over pool rows,
// sampling of the next tokens, and prefill chunks on private rows. The kernel is picked
// once, at construction:
//   - native: the float32 CPU kernels (models/kernels/native_step.h: fused sgemm projections,
//     the pool's rows updated in place), where the model allows it and "native" was
//     asked for;
//   - graph: fwmodel::GraphedStep, the batched step on per-bucket buffers, replayed as
//     CUDA Graphs on a CUDA model, with sampling on the device. On a preallocated pool
//     (StatePool::preallocated) it is in place: each replay reads and writes the pool's
//     rows and samples the next tokens of the rows the engine will sample, so a token
//     costs one copy each way and one synchronisation. It is the default for a CUDA
//     model, and can be asked for on the CPU (eager there, same code);
//   - libtorch: Model::Step / Model::Forward on gathered rows. It is the reference, and
//     the fallback for anything else (float64, a failed graph setup).
// Prefill uses the native kernel with `native`, else Model::Forward.
//
// Thread-safety: Step, StepAhead and Sample run on the engine thread, Prefill on the
// prefill thread only. Each has kernels and scratch of its own, so the two may run at
// once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "models/architectures/model.h"
#include "models/kernels/graphed_step.h"
#include "models/kernels/native_step.h"
#include "models/kernels/scoring.h"
#include "models/sampling/batch_sampler.h"
#include "models/sampling/sampler.h"
#include "server/engine/state_pool.h"

namespace fwserve {

class Stepper {
 public:
  // `decode_kernel`: "native", "graph" or "libtorch" (EngineOptions::decode_kernel);
  // `packed_gemm`: the native kernel's GEMMs on libxsmm (EngineOptions::native_gemm == "libxsmm").
  // `model` is not owned and outlives this. `name` names the model in log lines.
  // step_threads, prefill_threads (> 0): EngineOptions::intra_op_threads and
  // prefill_threads, resolved (server/base/cpu_count.h).
  // `pool` (not owned, outlives this): the graph kernel binds it when it is preallocated.
  // `sample_in_step`: the in-place graph step samples too; `sample_without_sort`: and
  // passes that need no ranked filter skip the sort (EngineOptions).
  Stepper(const fwmodel::Model& model, const std::string& decode_kernel, bool packed_gemm,
          int32_t step_threads, int32_t prefill_threads, const std::string& name,
          StatePool* pool = nullptr, bool sample_in_step = true, bool sample_without_sort = true);

  // The benchmark-only kernel (EngineOptions::null_step): Step and Prefill do no model
  // work, Sample hands out pre-drawn tokens.
  static constexpr char kNullKernel[] = "null";

  // Whether `decode_kernel` gives the graph kernel for `model` (the pool is then
  // preallocated, so the step can bind it).
  static bool UsesGraphKernel(const fwmodel::Model& model, const std::string& decode_kernel);

  // "native", "graph" or "libtorch": the kernel in use.
  const char* kernel() const {
    return null_step()                ? kNullKernel
           : native_step_ != nullptr  ? "native"
           : graphed_step_ != nullptr ? "graph"
                                      : "libtorch";
  }

  // One stream's next token, drawn from its pool row's logits.
  struct SampleRequest {
    int slot = 0;
    const SamplingParams* params = nullptr;        // not owned
    std::mt19937_64* rng = nullptr;                // the stream's generator, advanced
    const std::vector<int64_t>* recent = nullptr;  // for the repetition penalty
    bool logprobs = false;                         // logprob wanted (else 0)
    // A constraint's mask over the vocabulary (0 = never drawn) or null; not owned,
    // valid through the Sample call. In a Step's `draws`: the mask the row's next Sample
    // will bring, with the same contents at the same address (the in-place graph step
    // then draws under it); a Sample request takes a token drawn inside the step only if
    // that draw saw the same mask pointer.
    const uint8_t* allowed = nullptr;
    // OpenAI's top_logprobs: the most likely tokens wanted with their log-probabilities
    // (0 = none; at most 20), from the raw logits (TopLogProbs).
    int32_t top_logprobs = 0;
  };
  // Engine thread: the rows `rows` of `pool` absorb `tokens` (one each, in the same
  // order) in one batched step, and get their next-token logits. `draws` (empty, or one
  // per row): what each row's next Sample will ask. The in-place graph step draws those
  // tokens inside the step, from a copy of each generator (nothing is consumed here);
  // the next Sample hands them out and advances the generators then. Other kernels
  // ignore `draws`.
  absl::Status Step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                    StatePool& pool, absl::Span<const SampleRequest> draws = {});

  // Multi-step decode (fwmodel::GraphedStep::MultiStepInPlace): up to `steps` tokens
  // per row in one launch. Row i may draw limits[i] tokens (1 <= limits[i] <= steps)
  // and stops after one in `stop_tokens`.
  struct MultiStep {
    int64_t steps = 1;
    std::vector<int64_t> limits;
    std::vector<int64_t> stop_tokens;
  };
  // Engine thread: Step with draws (one per row), where each row goes on drawing and
  // absorbing as `multi` allows. (*absorbed_ahead)[i] gets the tokens row i drew *and*
  // absorbed, in order: the caller samples them now, one CanonicalDraw of the row's
  // generator each when its temperature is not 0, and counts them absorbed. The row's
  // last drawn token is handed out by the next Sample, as after Step. Falls back to Step
  // (every entry empty) where multi-step does not apply: steps <= 1, another kernel, or
  // a row with a repetition penalty in the batch (its window would move on the device).
  absl::Status StepAhead(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                         StatePool& pool, absl::Span<const SampleRequest> draws,
                         const MultiStep& multi,
                         std::vector<std::vector<SampledToken>>* absorbed_ahead);
  // Whether StepAhead can draw more than one token per row (the in-place graph step
  // with sample_in_step).
  bool multi_step() const { return draws_ahead(); }
  // Whether the native kernel serves decode, prefill and Score (so LibTorch's forms, and
  // the model's matrices, are never used).
  bool native_serves_all() const { return native_step_ != nullptr && native_prefill_ != nullptr; }
  // Whether Step draws the next tokens of the rows it is given draws for (the in-place
  // graph step with sample_in_step); other kernels ignore the draws.
  bool draws_ahead() const {
    return graphed_step_ != nullptr && graphed_step_->CanSampleInStep({});
  }
  // Forgets the tokens the last Step drew (the engine's iteration ended: what was not
  // sampled in it may be stale by the next, its row freed and reused, its state rolled
  // back).
  void DiscardDrawsAhead() { presampled_.clear(); }
  // The last Step's time: device time (CUDA events) for the graph kernel on CUDA, else
  // host time of the kernel call.
  absl::Duration last_step_time() const { return last_step_time_; }

  // Engine thread: samples every request, in order. Rows the last Step drew for get
  // those tokens. Otherwise the graph kernel, and any kernel on a CUDA model, samples
  // them all at once on the logits' device (SampleRows: one copy of the parameters
  // there, one of the results back); the CPU kernels call SampleToken per row on the
  // host. The tokens are the same for the same seeds.
  absl::StatusOr<std::vector<SampledToken>> Sample(absl::Span<const SampleRequest> requests,
                                                   const StatePool& pool);
  // Engine thread, after Sample and before the rows step again: for each request with
  // top_logprobs > 0, its row's most likely tokens (TopLogProbs of the pool's logits;
  // a CUDA row is copied to the host alone); an empty entry for the others. `out` gets
  // one entry per request, or none at all when no request asks.
  absl::Status TopAlternatives(absl::Span<const SampleRequest> requests, const StatePool& pool,
                               std::vector<std::vector<std::pair<int64_t, float>>>* out) const;

  // Prefill thread: `tokens` [B, L] are absorbed into `state` (B private rows, in
  // place). Returns the logits after each row's last token, float32 [B, vocab] on the
  // model's device.
  absl::StatusOr<torch::Tensor> Prefill(const torch::Tensor& tokens, fwmodel::State* state);
  // Prefill thread: fwmodel::ScoreTokens over `tokens` from `context`, in chunks of
  // `chunk` tokens, on the native kernel's prefill instance when there is one.
  absl::StatusOr<std::vector<double>> Score(const std::vector<int64_t>& tokens,
                                            fwmodel::ScoringContext* context, int64_t chunk);

 private:
  absl::Status StepOnKernel(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                            StatePool& pool, absl::Span<const SampleRequest> draws);
  // Sample without the in-place step's draws.
  absl::StatusOr<std::vector<SampledToken>> SampleApart(absl::Span<const SampleRequest> requests,
                                                        const StatePool& pool);

  // Sample on the null kernel: the next of null_tokens_, in turn.
  std::vector<SampledToken> SampleNull(absl::Span<const SampleRequest> requests);
  bool null_step() const { return !null_tokens_.empty(); }

  const fwmodel::Model& model_;
  const int64_t vocab_;
  // The null kernel (kNullKernel): its pre-drawn tokens (empty for every other kernel)
  // and the next one handed out.
  std::vector<int64_t> null_tokens_;
  size_t null_next_ = 0;
  // At most one of native_step_ and graphed_step_; neither: LibTorch.
  std::unique_ptr<fwmodel::NativeStep> native_step_;     // engine thread
  std::unique_ptr<fwmodel::NativeStep> native_prefill_;  // prefill thread
  std::unique_ptr<fwmodel::GraphedStep> graphed_step_;   // engine thread
  // Tokens the in-place step drew for the next Sample, by pool row, with the uniform it
  // used (checked against the generator when handed out) and the request it was drawn
  // for (its params and generator must be the same objects). Cleared by every Step,
  // Sample and DiscardDrawsAhead.
  struct Presampled {
    SampledToken sampled;
    double uniform = 0;
    const SamplingParams* params = nullptr;
    const std::mt19937_64* rng = nullptr;
    // The constraint mask the draw saw (null: none); a request with another mask (or
    // none where this had one) is sampled apart.
    const uint8_t* allowed = nullptr;
  };
  absl::flat_hash_map<int64_t, Presampled> presampled_;
  absl::Duration last_step_time_;
  std::vector<float> step_logits_;  // [batch, vocab] scratch of the native step
};

}  // namespace fwserve
