// The model side of one engine: its StatePool (the rows), the Stepper (the batched
// decode step and sampling) and the prefill thread. It knows rows and tokens, never
// sessions, streams or tenants: what runs is decided by the Scheduler, and whose rows
// they are by the engine's session keeping.
//
// A decode step and a sampling run on the calling (engine) thread and return their
// result. A prefill chunk runs on the
// prefill thread, beside the decode step; its end is signalled through
// `on_prefill_done`. (Overlapped steps on a step thread were measured on an H200 and
// lost, 0.92x at 1 stream and 0.95x at 64: removed with --overlap-steps, issue 48.)
//
// Thread-safety: everything but the prefill thread's own work runs on the engine
// thread. Rows handed to a prefill chunk are copies (PrefillWork::state).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "models/architectures/model.h"
#include "models/kernels/scoring.h"
#include "server/engine/engine_options.h"
#include "server/engine/state_pool.h"
#include "server/engine/stepper.h"

namespace fwserve {

// --threads on the calling thread: LibTorch's intra-op threads, OpenMP (the native step's
// per-session loops) and OpenBLAS. The counts are per thread, so each thread that runs
// model code applies it. `threads` 0 stands for ResolveComputeThreads(0)
// (server/base/cpu_count.h): OMP_NUM_THREADS if set, else the usable physical cores.
void LimitIntraOpThreads(int32_t threads);

// One batched decode step: pool row rows[i] absorbs tokens[i].
struct StepWork {
  std::vector<int64_t> rows;
  std::vector<int64_t> tokens;
  // Empty, or one per row: what each row's next sampling will ask (Stepper::Step).
  std::vector<Stepper::SampleRequest> draws;
  // Multi-step decode (--decode-steps-per-launch; Stepper::StepAhead): steps > 1 with
  // draws lets each row draw and absorb up to `multi.limits[i]` tokens in the launch.
  Stepper::MultiStep multi;
};

// One sampling: each request draws its row's next token.
struct SampleWork {
  std::vector<Stepper::SampleRequest> requests;
};

// What a launched step or sampling gave.
struct StepResult {
  absl::Status status;
  // SampleWork only: one per request, in order.
  std::vector<SampledToken> sampled;
  // SampleWork only: one per request when any asked for top_logprobs (each the row's
  // most likely tokens and their log-probabilities, empty where not asked), else empty.
  std::vector<std::vector<std::pair<int64_t, float>>> alternatives;
  // StepWork with multi.steps > 1: per row, the tokens it drew and absorbed beyond its
  // first (Stepper::StepAhead); empty entries otherwise.
  std::vector<std::vector<SampledToken>> absorbed_ahead;
  // How long it ran: a step's device time where the kernel measures it (the graph
  // kernel on CUDA), else host time from launch to completion.
  absl::Duration elapsed;
};

// A prefill chunk off the engine thread. The engine fills the inputs; the prefill
// thread the outputs; neither touches the other's fields while it is in flight.
struct PrefillWork {
  // Pool-backed prefill: copies of the rows and their tokens [B, length].
  torch::Tensor rows;
  fwmodel::State state;
  torch::Tensor tokens;
  // Score: the private context and its piece of text (instead of the above).
  fwmodel::ScoringContext* score_context = nullptr;
  std::vector<int64_t> piece;
  // Outputs.
  absl::Status status;
  torch::Tensor last_logits;  // float32 [B, vocab], on the model's device
  std::vector<double> logprobs;
  absl::Duration elapsed;
};

class Runner {
 public:
  // `model` is not owned and outlives this; `budget` as StatePool's. `name` names the
  // model in log lines.
  Runner(const fwmodel::Model& model, const EngineOptions& options, StateMemoryBudget* budget,
         const std::string& name);
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  StatePool& pool() { return pool_; }
  const StatePool& pool() const { return pool_; }
  // "native", "graph" or "libtorch".
  const char* kernel() const { return stepper_.kernel(); }

  // One batched decode step; one sampling.
  StepResult Step(const StepWork& work);
  StepResult Sample(const SampleWork& work);
  // Whether a step uses StepWork::draws (Stepper::draws_ahead).
  bool draws_ahead() const { return stepper_.draws_ahead(); }
  // Whether a step can draw several tokens per row (Stepper::multi_step).
  bool multi_step() const { return stepper_.multi_step(); }
  // Stepper::native_serves_all.
  bool native_serves_all() const { return stepper_.native_serves_all(); }
  // The engine's iteration ended: tokens a step drew for a sampling that did not come
  // are forgotten (Stepper::DiscardDrawsAhead).
  void EndIteration() { stepper_.DiscardDrawsAhead(); }

  // Prefill. Starts the prefill thread; `on_prefill_done` runs on it after each chunk.
  void StartPrefillThread(std::function<void()> on_prefill_done);
  // Hands `work` (not owned; alive until its done signal) to the prefill thread. At most
  // one chunk is in flight.
  void LaunchPrefill(PrefillWork* work);
  // Stops the prefill thread after the chunk in flight (if any). Idempotent.
  void StopPrefillThread();

 private:
  void PrefillThreadLoop();

  const fwmodel::Model& model_;
  const EngineOptions& options_;  // the engine's; outlives this
  StatePool pool_;
  // The decode step (engine thread) and prefill chunks (prefill thread).
  Stepper stepper_;

  std::thread prefill_thread_;
  std::function<void()> on_prefill_done_;
  absl::Mutex prefill_mu_;
  absl::CondVar prefill_cv_;
  PrefillWork* prefill_pending_ ABSL_GUARDED_BY(prefill_mu_) = nullptr;
  bool prefill_stop_ ABSL_GUARDED_BY(prefill_mu_) = false;
};

}  // namespace fwserve
