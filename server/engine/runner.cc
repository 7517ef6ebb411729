#include "server/engine/runner.h"

#include <pthread.h>

#include <ATen/Parallel.h>
#include <algorithm>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "models/base/blas_check.h"
#include "server/base/cpu_count.h"

namespace fwserve {

void LimitIntraOpThreads(int32_t threads) {
  threads = ResolveComputeThreads(threads);
  at::set_num_threads(threads);
  fwmodel::SetOpenBlasThreads(threads);
}

Runner::Runner(const fwmodel::Model& model, const EngineOptions& options, StateMemoryBudget* budget,
               const std::string& name)
    : model_(model),
      options_(options),
      pool_(model,
            Stepper::UsesGraphKernel(model, options.decode_kernel)
                ? std::min(options.max_sessions,
                           options.max_state_memory_bytes /
                               std::max<int64_t>(1, model.state_bytes_per_session()))
                : options.max_state_memory_bytes /
                      std::max<int64_t>(1, model.state_bytes_per_session()),
            budget, /*preallocate=*/Stepper::UsesGraphKernel(model, options.decode_kernel)),
      stepper_(model, options.null_step ? Stepper::kNullKernel : options.decode_kernel,
               options.native_gemm == "libxsmm", ResolveComputeThreads(options.intra_op_threads),
               options.prefill_threads > 0 ? options.prefill_threads : UsableCores(), name, &pool_,
               options.sample_in_step, options.sample_without_sort) {}

Runner::~Runner() { StopPrefillThread(); }

StepResult Runner::Step(const StepWork& work) {
  StepResult result;
  try {
    result.status = work.multi.steps > 1
                        ? stepper_.StepAhead(work.rows, work.tokens, pool_, work.draws, work.multi,
                                             &result.absorbed_ahead)
                        : stepper_.Step(work.rows, work.tokens, pool_, work.draws);
  } catch (const std::exception& e) {
    result.status = absl::InternalError(absl::StrCat("decode step: ", e.what()));
  }
  result.elapsed = stepper_.last_step_time();
  return result;
}

StepResult Runner::Sample(const SampleWork& work) {
  const absl::Time start = absl::Now();
  StepResult result;
  auto sampled = stepper_.Sample(work.requests, pool_);
  if (sampled.ok()) {
    result.sampled = std::move(*sampled);
    result.status = stepper_.TopAlternatives(work.requests, pool_, &result.alternatives);
  } else {
    result.status = sampled.status();
  }
  result.elapsed = absl::Now() - start;
  return result;
}

void Runner::StartPrefillThread(std::function<void()> on_prefill_done) {
  on_prefill_done_ = std::move(on_prefill_done);
  // Named for profilers and top -H (Linux limits names to 15 characters).
  prefill_thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "fwserve-prefill");
    PrefillThreadLoop();
  });
}

void Runner::LaunchPrefill(PrefillWork* work) {
  absl::MutexLock lock(&prefill_mu_);
  prefill_pending_ = work;
  prefill_cv_.Signal();
}

void Runner::StopPrefillThread() {
  {
    absl::MutexLock lock(&prefill_mu_);
    prefill_stop_ = true;
    prefill_cv_.Signal();
  }
  if (prefill_thread_.joinable()) prefill_thread_.join();
}

void Runner::PrefillThreadLoop() {
  c10::NoGradGuard no_grad;
  LimitIntraOpThreads(options_.intra_op_threads);
  while (true) {
    PrefillWork* work = nullptr;
    {
      absl::MutexLock lock(&prefill_mu_);
      while (prefill_pending_ == nullptr && !prefill_stop_) prefill_cv_.Wait(&prefill_mu_);
      if (prefill_pending_ == nullptr) return;
      work = prefill_pending_;
      prefill_pending_ = nullptr;
    }
    const absl::Time start = absl::Now();
    try {
      if (work->score_context != nullptr) {
        auto logprobs = stepper_.Score(work->piece, work->score_context,
                                       options_.scheduler.prefill_chunk_tokens);
        if (logprobs.ok()) {
          work->logprobs = std::move(*logprobs);
        } else {
          work->status = logprobs.status();
        }
      } else {
        auto logits = stepper_.Prefill(work->tokens, &work->state);
        if (logits.ok()) {
          work->last_logits = std::move(*logits);
        } else {
          work->status = logits.status();
        }
      }
    } catch (const std::exception& e) {
      work->status = absl::InternalError(e.what());
    }
    work->elapsed = absl::Now() - start;
    on_prefill_done_();
  }
}

}  // namespace fwserve
