#include "server/engine/engine.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "models/base/blas_check.h"
#include "server/base/log.h"
#include "server/base/retry_delay.h"
#include "server/base/session_id.h"

namespace fwserve {

namespace {

constexpr absl::Duration kHousekeepingInterval = absl::Seconds(1);

// The transport's control of a stream submitted with its engine known.
class StreamHandle : public GenerateControl {
 public:
  // `session_id`: the new session the stream runs on, or empty (a throwaway stream).
  StreamHandle(Engine* engine, uint64_t id, std::string session_id)
      : engine_(engine), id_(id), session_id_(std::move(session_id)) {}
  std::string session_id() const override { return session_id_; }
  void WriteDone(bool ok) override { engine_->PostWriteDone(id_, ok); }
  void Cancel() override { engine_->PostCancel(id_); }

 private:
  Engine* const engine_;  // outlives every stream (Core::Stop runs after the transport)
  const uint64_t id_;
  const std::string session_id_;
};

}  // namespace

// A stream whose engine is known only once its session's lease was taken in a shared
// store (the session names the model). WriteDone cannot come before Bind (no chunk is
// sent before). A Cancel before admission is seen by the engine through the item's
// is_cancelled (polled at admission); the PostCancel from Bind is only a best effort.
class LateStreamHandle : public GenerateControl {
 public:
  explicit LateStreamHandle(std::string session_id) : session_id_(std::move(session_id)) {}
  std::string session_id() const override { return session_id_; }
  void Bind(Engine* engine, uint64_t id) {
    bool cancel;
    {
      absl::MutexLock lock(&mu_);
      engine_ = engine;
      id_ = id;
      cancel = cancelled_;
    }
    if (cancel) engine->PostCancel(id);
  }
  void WriteDone(bool ok) override {
    if (auto [engine, id] = Bound(); engine != nullptr) engine->PostWriteDone(id, ok);
  }
  void Cancel() override {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    if (auto [engine, id] = Bound(); engine != nullptr) engine->PostCancel(id);
  }

 private:
  std::pair<Engine*, uint64_t> Bound() {
    absl::MutexLock lock(&mu_);
    return {engine_, id_};
  }

  const std::string session_id_;
  absl::Mutex mu_;
  Engine* engine_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t id_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

void OpenStreamBeforeClaim(WorkItem& item) {
  GenerateWork& g = std::get<GenerateWork>(item.work);
  g.control = std::make_shared<LateStreamHandle>(g.fork_id.empty() ? item.session_id : g.fork_id);
  g.observer->OnStart(g.control);
}

Engine::Engine(std::string name, fwmodel::LoadedModel loaded, const EngineOptions& options,
               EngineContext context)
    : name_(std::move(name)),
      model_(std::move(loaded.model)),
      fingerprint_(std::move(loaded.fingerprint)),
      tokenizer_(std::move(context.tokenizer)),
      options_(options),
      metrics_(context.metrics),
      admission_{name_,
                 options.max_queued_requests,
                 options.max_queue_wait,
                 options.scheduler.max_active_streams,
                 options.codel_target,
                 options.codel_interval},
      queue_(admission_, [](const WorkItem& item) { return item.IsStream(); }),
      runner_(model_, options_, context.budget, name_),
      pool_(runner_.pool()),
      keeper_(KeeperContext{
          name_, &model_, fingerprint_, &options_, context.directory, context.budget,
          context.clock != nullptr ? context.clock : Clock::Real(), metrics_, &pool_, this}),
      driver_(StreamDriverContext{name_, &model_, &tokenizer_, &options_, metrics_, &runner_,
                                  &keeper_, &drain_, this}) {
  // An RWKV or DeltaNet model's native kernels keep their own copy of its weights and
  // serve every path: the model's matrices would only take memory (half of it, for a
  // float32 file).
  if (model_.config().has_whole_blocks() && runner_.native_serves_all()) {
    model_.ReleaseMatrices();
    Log(LogLevel::kInfo, absl::StrCat("model ", name_,
                                      ": the native kernel serves every path; the model's "
                                      "own copy of its matrices was released"));
  }
}

Engine::~Engine() { Stop(); }

void Engine::Start() {
  runner_.StartPrefillThread([this] {
    absl::MutexLock lock(&mu_);
    prefill_done_ = true;
    wake_.Signal();
  });
  // Named for profilers and top -H (Linux limits names to 15 characters).
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "fwserve-engine");
    Loop();
  });
}

namespace {

// The retry hint when no drain rate has been measured yet.
constexpr absl::Duration kUnmeasuredRetryDelay = absl::Seconds(1);
constexpr absl::Duration kMinRetryDelay = absl::Milliseconds(10);
constexpr absl::Duration kMaxRetryDelay = absl::Seconds(30);

}  // namespace

absl::Duration Engine::ExpectedQueueWait() const {
  const int64_t ahead = published_queued_.load(std::memory_order_relaxed) + 1 -
                        published_free_slots_.load(std::memory_order_relaxed);
  // Unmeasured: no claim (a deadline is never refused on a guess).
  return DrainEstimate::WaitFor(ahead, published_drain_rate_.load(std::memory_order_relaxed),
                                absl::ZeroDuration());
}

absl::Duration Engine::RetryDelay() const {
  const int64_t ahead =
      std::max<int64_t>(1, published_queued_.load(std::memory_order_relaxed) -
                               published_free_slots_.load(std::memory_order_relaxed));
  const absl::Duration wait = DrainEstimate::WaitFor(
      ahead, published_drain_rate_.load(std::memory_order_relaxed), kUnmeasuredRetryDelay);
  return std::clamp(wait, kMinRetryDelay, kMaxRetryDelay);
}

absl::Status Engine::DeadlineRefusal(absl::Time deadline) const {
  if (deadline == absl::InfiniteFuture()) return absl::OkStatus();
  const absl::Duration wait = ExpectedQueueWait();
  if (absl::Now() + wait <= deadline) return absl::OkStatus();
  return WithRetryDelay(
      WithRefusalReason(absl::DeadlineExceededError(absl::StrCat(
                            "model '", name_,
                            "' cannot start this request before its deadline: the queue's "
                            "expected wait is ",
                            absl::FormatDuration(absl::Trunc(wait, absl::Milliseconds(1))))),
                        RefusalReason::kDeadline),
      std::clamp(wait, kMinRetryDelay, kMaxRetryDelay));
}

int64_t Engine::QueueCapacity() const {
  const int64_t limit = options_.max_queued_requests;
  const double rate = published_drain_rate_.load(std::memory_order_relaxed);
  if (options_.max_queue_wait <= absl::ZeroDuration() || rate <= 0) return limit;
  const double drains = std::ceil(rate * absl::ToDoubleSeconds(options_.max_queue_wait));
  // At least 2, but never above the flag (which may be 1).
  return std::min(limit,
                  std::max<int64_t>(2, static_cast<int64_t>(std::min<double>(drains, limit))));
}

absl::Status Engine::CheckAdmission(absl::Time deadline) const {
  const int64_t queued = published_queued_.load(std::memory_order_relaxed);
  const int64_t capacity = QueueCapacity();
  if (queued >= capacity) return WithRetryDelay(QueueFullError(admission_, capacity), RetryDelay());
  return DeadlineRefusal(deadline);
}

absl::Status Engine::Submit(std::unique_ptr<WorkItem>& item) {
  GenerateWork* generate = item->As<GenerateWork>();
  if (generate != nullptr && !generate->params.sampling.logit_bias.empty()) {
    // Ids ascending (SamplingParams::Validate): the last is the largest.
    const int64_t largest = generate->params.sampling.logit_bias.back().first;
    const int64_t vocab = model_.config().vocab_size;
    if (largest >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(
          "logit_bias: token id ", largest, " is outside the model's vocabulary [0, ", vocab, ")"));
    }
  }
  if (generate != nullptr) {
    generate->stream_id = NewStreamId();
    if (generate->control != nullptr) {
      generate->control->Bind(this, generate->stream_id);
    } else {
      generate->observer->OnStart(
          std::make_shared<StreamHandle>(this, generate->stream_id, generate->fork_id));
    }
  }
  if (!item->text.empty()) {
    item->tokens = tokenizer_.Encode(item->text);
    if (item->fresh_prompt && tokenizer_.begin_of_text() >= 0) {
      item->tokens.insert(item->tokens.begin(), tokenizer_.begin_of_text());
    }
    std::string().swap(item->text);  // the tokens are what the engine uses
  } else if (item->fresh_prompt && item->Is<CreateWork>() && tokenizer_.begin_of_text() >= 0) {
    // A new session with an empty prefix still starts as the model was trained: its state
    // absorbs BOS, and its first text is then a continuation, as after any prefix.
    item->tokens = {tokenizer_.begin_of_text()};
  }
  if (generate != nullptr) {
    if (absl::Status late = DeadlineRefusal(generate->params.deadline); !late.ok()) return late;
  }
  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("the server is shutting down");
  absl::Status queued = queue_.Push(item, QueueCapacity(), absl::Now());
  if (!queued.ok()) return WithRetryDelay(std::move(queued), RetryDelay());
  published_queued_.store(queue_.size(), std::memory_order_relaxed);
  wake_.Signal();
  return queued;
}

absl::Status Engine::SubmitClaimed(std::unique_ptr<WorkItem>& item,
                                   std::optional<std::string> stored_state) {
  WorkItem& w = *item;
  if (stored_state.has_value() && !w.Is<DeleteWork>()) {
    c10::NoGradGuard no_grad;
    auto decoded = fwmodel::DecodeStateRow(model_, fingerprint_, std::move(*stored_state));
    if (!decoded.ok()) {
      Log(LogLevel::kError, absl::StrCat("session ", w.session_id, ": stored state unreadable: ",
                                         decoded.status().message()));
      FailItem(std::move(item),
               absl::DataLossError(absl::StrCat("session_id '", w.session_id,
                                                "': its saved state could not be restored")));
      return absl::OkStatus();
    }
    w.loaded = std::make_shared<fwmodel::DecodedState>(std::move(*decoded));
  }
  return Submit(item);
}

void Engine::StoreJobStarted() {
  absl::MutexLock lock(&mu_);
  ++store_jobs_;
}

void Engine::StoreJobDone(std::function<void()> then) {
  absl::MutexLock lock(&mu_);
  if (then) continuations_.push_back(std::move(then));
  --store_jobs_;
  wake_.Signal();
}

void Engine::Housekeeping() {
  keeper_.Housekeeping(driver_.ending());
  PublishGauges();
}

void Engine::PublishGauges() {
  int64_t queued;
  {
    absl::MutexLock lock(&mu_);
    queued = queue_.size();
  }
  metrics_->SetQueuedRequests(queued);
  metrics_->SetExpectedQueueWait(absl::ToDoubleSeconds(ExpectedQueueWait()));
  metrics_->SetActiveStreams(driver_.tasks());
}

void Engine::PostWriteDone(uint64_t stream_id, bool ok) {
  absl::MutexLock lock(&mu_);
  events_.push_back({stream_id, ok ? Event::kWriteOk : Event::kWriteFailed});
  wake_.Signal();
}

void Engine::PostCancel(uint64_t stream_id) {
  absl::MutexLock lock(&mu_);
  events_.push_back({stream_id, Event::kCancel});
  wake_.Signal();
}

void Engine::BeginDrain() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool Engine::IdleLocked() const {
  return queue_.empty() && active_tasks_ == 0 && store_jobs_ == 0 && continuations_.empty();
}

bool Engine::WaitIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  while (!IdleLocked()) {
    if (idle_changed_.WaitWithDeadline(&mu_, deadline) && absl::Now() >= deadline) {
      return IdleLocked();
    }
  }
  return true;
}

void Engine::EndAllWork() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  end_all_ = true;
  wake_.Signal();
}

void Engine::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_ && !thread_.joinable()) return;
    draining_ = true;
    end_all_ = true;
    stop_ = true;
    wake_.Signal();
  }
  if (thread_.joinable()) thread_.join();
}

// ---------------------------------------------------------------------------------
// The loop.

bool Engine::HasImmediateWorkLocked() {
  if (!events_.empty() || !continuations_.empty() || prefill_done_) return true;
  if (end_all_ && !end_all_applied_) return true;
  if (stop_ && active_tasks_ == 0 && store_jobs_ == 0) return true;
  if (immediate_work_) return true;
  return queue_.HasAdmissible(active_tasks_);
}

void Engine::Loop() {
  c10::NoGradGuard no_grad;
  LimitIntraOpThreads(options_.intra_op_threads);
  while (true) {
    IterationWork work = WaitForWork();
    driver_.set_ending(work.end_all);
    // Tensor code outside Model::Forward/Step (gather, scatter, copies) can still throw
    // c10::Error (e.g. out of memory); it must not take the process down. The requests in
    // flight fail with INTERNAL; sessions keep their last committed state.
    // The prefill thread's report, taken from the lock, until CompletePrefill takes the job.
    bool prefill_report_taken = work.prefill_done;
    try {
      for (auto& continuation : work.continuations) continuation();
      if (work.prefill_done) {
        prefill_report_taken = false;  // CompletePrefill takes the job first thing
        driver_.CompletePrefill();
      }
      driver_.Tick();
      for (const Event& event : work.events) ApplyEvent(event);
      ShedAll(work.shed);
      AdmitAll(work.admitted, work.end_all);
      if (work.end_all) driver_.EndAll();
      driver_.RunIteration();  // prefill chunk out, one decode step, sample and emit
    } catch (const std::exception& e) {
      Log(LogLevel::kError, absl::StrCat("model ", name_, ": engine iteration failed: ", e.what()));
      try {
        driver_.FailAll(absl::InternalError("the engine failed"), prefill_report_taken);
      } catch (const std::exception& again) {
        Log(LogLevel::kError, absl::StrCat("model ", name_, ": recovery failed: ", again.what()));
      }
    }
    runner_.EndIteration();
    const absl::Time now = absl::Now();
    if (now >= next_housekeeping_) {
      Housekeeping();
      next_housekeeping_ = now + kHousekeepingInterval;
    }
    if (!PublishReadiness(work.stop)) break;
  }

  runner_.StopPrefillThread();
  keeper_.StoreUnstoredAtExit();
}

Engine::IterationWork Engine::WaitForWork() {
  IterationWork work;
  Scheduler& scheduler = driver_.scheduler();
  const absl::Time wait_until = std::min(scheduler.batch_deadline(), next_housekeeping_);
  absl::MutexLock lock(&mu_);
  while (!HasImmediateWorkLocked() && absl::Now() < wait_until) {
    wake_.WaitWithDeadline(&mu_, wait_until);
  }
  work.events.swap(events_);
  work.continuations.swap(continuations_);
  // Streams running: the tasks less the parked ones. Parked streams resume first, then
  // the queue is admitted; then, if a tenant below its fair share still waits behind
  // full slots, one stream of a tenant above its share is parked for it
  // (--preempt-for-fair-share, docs/serving.md).
  // (At shutdown EndAllTasks cancels every task, which ends its parking: Parked().)
  int64_t active = scheduler.ResumeParked(scheduler.Running());
  const absl::Time now = absl::Now();
  // CoDel (--queue-codel-target): what waited past the target under a standing queue is
  // refused before the free slots are given out, so what starts has waited at most it.
  if (!end_all_)
    queue_.TakeShed(
        now, [&scheduler] { return scheduler.RunningByTenant(); }, work.shed);
  queue_.TakeAdmissible(
      active, end_all_, [&scheduler] { return scheduler.RunningByTenant(); }, work.admitted, now);
  if (options_.preempt_for_fair_share && !end_all_ &&
      scheduler.PreemptForFairShare(active, queue_.WaitingStreamTenants())) {
    metrics_->CountPreempted();
    --active;
    queue_.TakeAdmissible(
        active, false, [&scheduler] { return scheduler.RunningByTenant(); }, work.admitted, now);
  }
  // WaitIdle must not see admitted (or parked) work as idle.
  active_tasks_ = driver_.tasks() + static_cast<int64_t>(work.admitted.size());
  drain_.Tick(absl::Now(), active >= options_.scheduler.max_active_streams);
  published_queued_.store(queue_.size(), std::memory_order_relaxed);
  published_free_slots_.store(std::max<int64_t>(0, options_.scheduler.max_active_streams - active),
                              std::memory_order_relaxed);
  published_drain_rate_.store(drain_.rate(), std::memory_order_relaxed);
  work.end_all = end_all_;
  if (end_all_) end_all_applied_ = true;
  work.stop = stop_;
  work.prefill_done = prefill_done_;
  prefill_done_ = false;
  return work;
}

void Engine::ShedAll(std::vector<std::unique_ptr<WorkItem>>& shed) {
  if (shed.empty()) return;
  const absl::Time now = absl::Now();
  const absl::Duration retry = RetryDelay();
  for (auto& item : shed) {
    metrics_->CountShed();
    const absl::Duration waited = absl::Trunc(now - item->arrival, absl::Milliseconds(1));
    FailItem(std::move(item),
             WithRetryDelay(WithRefusalReason(
                                absl::ResourceExhaustedError(absl::StrCat(
                                    "model '", name_, "' is overloaded: this request waited ",
                                    absl::FormatDuration(waited),
                                    " in a standing queue, past --queue-codel-target=",
                                    absl::FormatDuration(options_.codel_target), "; retry later")),
                                RefusalReason::kShed),
                            retry));
  }
}

void Engine::AdmitAll(std::vector<std::unique_ptr<WorkItem>>& admitted, bool end_all) {
  for (auto& item : admitted) {
    if (end_all) {
      // Accepted before the shutdown began but never started: refuse cleanly.
      FailItem(std::move(item), absl::UnavailableError("the server is shutting down"));
      continue;
    }
    driver_.Admit(std::move(item));
  }
}

bool Engine::PublishReadiness(bool stop) {
  const Readiness readiness =
      driver_.scheduler().ReadinessAfterIteration(driver_.prefill_in_flight());
  absl::MutexLock lock(&mu_);
  active_tasks_ = driver_.tasks();
  immediate_work_ = readiness.immediate;
  idle_changed_.SignalAll();
  return !(stop && driver_.tasks() == 0 && queue_.empty() && store_jobs_ == 0 &&
           continuations_.empty());
}

void Engine::ApplyEvent(const Event& event) {
  switch (event.kind) {
    case Event::kWriteOk:
      return driver_.OnWriteDone(event.stream_id, true);
    case Event::kWriteFailed:
      return driver_.OnWriteDone(event.stream_id, false);
    case Event::kCancel:
      return driver_.OnCancel(event.stream_id);
  }
}

void Engine::AwaitPrefillDone() {
  absl::MutexLock lock(&mu_);
  while (!prefill_done_) wake_.Wait(&mu_);
  prefill_done_ = false;
}

bool Engine::EndAllAsked() {
  absl::MutexLock lock(&mu_);
  return end_all_;
}

}  // namespace fwserve
