#include "server/engine/engine.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "models/blas_check.h"
#include "server/base/log.h"
#include "server/base/retry_delay.h"
#include "server/base/session_id.h"

namespace fwserve {

// A Generate, Score or CreateSession being served: the runner's and the caller's side
// of it (rows, rollback copies, sampling state, the work item). Its phase, stream and
// flags are the scheduler's (`s`). Engine thread only.
struct Engine::Task {
  // The slot and token count as they were before some token was absorbed (the
  // decoder's point is the StreamTask's).
  struct RollbackPoint {
    StatePool::RowCopy row;
    int64_t tokens = 0;
  };

  ScheduledTask* s =
      nullptr;  // the scheduler's record (its id is the task's); valid until TakeTask
  std::unique_ptr<WorkItem> item;
  GenerateParams* generate = nullptr;  // a Generate's (its item's); null otherwise
  std::string session_id;              // empty for a throwaway (Generate/Score without a session)
  int slot = -1;                       // pool row being advanced; -1 for Score (private context)
  int64_t tokens_before = 0;
  int64_t tokens = 0;  // tokens the slot's state has absorbed
  // Runs on a session it forked (GenerateParams::fork_from): the session is new, so a
  // request that keeps nothing (store false, or cut before a token) removes it.
  bool forked = false;
  // Generate on an existing session: the slot as it was, to undo a request that
  // streamed nothing.
  bool has_snapshot = false;
  fwmodel::State snapshot;
  torch::Tensor snapshot_logits;
  // Score.
  fwmodel::ScoringContext score_context;
  std::vector<double> score_logprobs;
  // Decode.
  std::mt19937_64 rng;
  int64_t pending_token = -1;
  std::vector<int64_t> recent;  // prompt + generated, for the repetition penalty
  // A failed write or a cancellation puts the slot back to the rollback point of the
  // first unconfirmed token (StreamTask names it), so the session holds exactly the
  // tokens the client was sent.
  RollbackPoint before_inflight;  // valid while the stream has a write in flight
  RollbackPoint before_unsent;    // valid while the stream has unsent tokens
  absl::Time first_token_at = absl::InfinitePast();
  absl::Time last_emit_at;
};

namespace {

constexpr absl::Duration kHousekeepingInterval = absl::Seconds(1);

// The scheduler's kind of a stream's work (WorkItem::IsStream).
TaskKind TaskKindOf(const WorkItem& item) {
  if (item.Is<ScoreWork>()) return TaskKind::kScore;
  if (item.Is<CreateWork>()) return TaskKind::kCreate;
  return TaskKind::kGenerate;
}

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

double Seconds(absl::Time from, absl::Time to) { return absl::ToDoubleSeconds(to - from); }

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
      scheduler_(options.scheduler) {}

Engine::~Engine() { Stop(); }

// A prefill chunk in flight: the scheduler's plan, its tasks and the runner's work.
struct Engine::PrefillJob {
  PrefillChunk chunk;        // the scheduler's plan
  std::vector<Task*> tasks;  // chunk.tasks' runner side
  PrefillWork work;
};

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
    std::string().swap(item->text);  // the tokens are what the engine uses
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
    torch::NoGradGuard no_grad;
    auto decoded = fwmodel::DecodeStateRow(model_, fingerprint_, std::move(*stored_state));
    if (!decoded.ok()) {
      Log(LogLevel::kError, absl::StrCat("session ", w.session_id, ": stored state unreadable: ",
                                         decoded.status().message()));
      FailItem(std::move(item),
               absl::DataLossError(absl::StrCat("session_id '", w.session_id,
                                                "': its saved state could not be restored")));
      return absl::OkStatus();
    }
    w.loaded = std::move(*decoded);
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
  keeper_.Housekeeping(ending_);
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
  metrics_->SetActiveStreams(static_cast<int64_t>(tasks_.size()));
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
  torch::NoGradGuard no_grad;
  LimitIntraOpThreads(options_.intra_op_threads);
  while (true) {
    IterationWork work = WaitForWork();
    ending_ = work.end_all;
    // Tensor code outside Model::Forward/Step (gather, scatter, copies) can still throw
    // c10::Error (e.g. out of memory); it must not take the process down. The requests in
    // flight fail with INTERNAL; sessions keep their last committed state.
    try {
      for (auto& continuation : work.continuations) continuation();
      if (work.prefill_done) CompletePrefill();
      for (const Event& event : work.events) ApplyEvent(event);
      ShedAll(work.shed);
      AdmitAll(work.admitted, work.end_all);
      if (work.end_all) EndAllTasks();
      if (runner_.overlaps_steps()) {
        // --overlap-steps: the step runs on the runner's thread while the next prefill
        // chunk is planned here (it touches only rows in prefill, and no allocation).
        std::optional<InFlightStep> step = LaunchDecodeStep();
        StartPrefill();
        if (step) FinishDecodeStep(std::move(*step));
      } else {
        StartPrefill();   // prefill: the next chunk to the prefill thread
        RunDecodeStep();  // step: one batched step for every stream ready to absorb
      }
      SampleAndEmit();  // sample, and emit what may go out
    } catch (const std::exception& e) {
      Log(LogLevel::kError, absl::StrCat("model ", name_, ": engine iteration failed: ", e.what()));
      try {
        runner_.AbandonStep();
        AbandonPrefillJob();
        while (!tasks_.empty()) {
          FailTask(*tasks_.begin()->second, absl::InternalError("the engine failed"));
        }
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
  const absl::Time wait_until = std::min(scheduler_.batch_deadline(), next_housekeeping_);
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
  int64_t active = scheduler_.ResumeParked(scheduler_.Running());
  const absl::Time now = absl::Now();
  // CoDel (--queue-codel-target): what waited past the target under a standing queue is
  // refused before the free slots are given out, so what starts has waited at most it.
  if (!end_all_)
    queue_.TakeShed(
        now, [this] { return scheduler_.RunningByTenant(); }, work.shed);
  queue_.TakeAdmissible(
      active, end_all_, [this] { return scheduler_.RunningByTenant(); }, work.admitted, now);
  if (options_.preempt_for_fair_share && !end_all_ &&
      scheduler_.PreemptForFairShare(active, queue_.WaitingStreamTenants())) {
    metrics_->CountPreempted();
    --active;
    queue_.TakeAdmissible(
        active, false, [this] { return scheduler_.RunningByTenant(); }, work.admitted, now);
  }
  // WaitIdle must not see admitted (or parked) work as idle.
  active_tasks_ = static_cast<int64_t>(tasks_.size()) + static_cast<int64_t>(work.admitted.size());
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
    Admit(std::move(item));
  }
}

void Engine::EndAllTasks() { Apply(scheduler_.CancelAll()); }

void Engine::Apply(std::vector<Action> actions) {
  for (Action& action : actions) {
    auto it = tasks_.find(action.id);
    if (it == tasks_.end()) continue;  // ended by an earlier action
    Task& task = *it->second;
    switch (action.kind) {
      case Action::Kind::kEmit:
        Deliver(task, std::move(action.chunk));
        break;
      case Action::Kind::kFinish:
        FinishTask(task, action.reason);
        break;
      case Action::Kind::kFail:
        FailTask(task, action.status);
        break;
    }
  }
}

bool Engine::PublishReadiness(bool stop) {
  const Readiness readiness = scheduler_.ReadinessAfterIteration(prefill_job_ != nullptr);
  absl::MutexLock lock(&mu_);
  active_tasks_ = static_cast<int64_t>(tasks_.size());
  immediate_work_ = readiness.immediate;
  idle_changed_.SignalAll();
  return !(stop && tasks_.empty() && queue_.empty() && store_jobs_ == 0 && continuations_.empty());
}

void Engine::ApplyEvent(const Event& event) {
  auto it = tasks_by_stream_.find(event.stream_id);
  if (it == tasks_by_stream_.end()) return;  // already finished
  const TaskId id = it->second;
  switch (event.kind) {
    case Event::kWriteOk:
      return Apply(scheduler_.OnWriteDone(id, true, absl::Now()));
    case Event::kWriteFailed:
      return Apply(scheduler_.OnWriteDone(id, false, absl::Now()));
    case Event::kCancel:
      return Apply(scheduler_.OnCancel(id));
  }
}

void Engine::Deliver(Task& t, GenerateChunk chunk) {
  std::swap(t.before_inflight, t.before_unsent);  // reuses the buffers
  const int64_t count = static_cast<int64_t>(chunk.token_ids.size());
  const absl::Time now = absl::Now();
  if (t.first_token_at == absl::InfinitePast()) {
    metrics_->ObserveTimeToFirstToken(Seconds(t.item->arrival, now));
  } else {
    // A chunk of n tokens: each is counted as arriving n-th of the wait.
    for (int64_t i = 0; i < count; ++i) {
      metrics_->ObserveInterTokenLatency(Seconds(t.last_emit_at, now) / count);
    }
  }
  if (t.first_token_at == absl::InfinitePast()) t.first_token_at = now;
  t.last_emit_at = now;
  t.item->As<GenerateWork>()->observer->OnChunk(std::move(chunk));
}

void Engine::DropUnconfirmed(Task& t) {
  Task::RollbackPoint* point = nullptr;
  switch (t.s->stream.DropUnconfirmed()) {
    case StreamTask::RollbackPoint::kBeforeInflight:
      point = &t.before_inflight;
      break;
    case StreamTask::RollbackPoint::kBeforeUnsent:
      point = &t.before_unsent;
      break;
    case StreamTask::RollbackPoint::kNone:
      break;
  }
  if (point != nullptr && t.slot >= 0) {
    if (!t.session_id.empty()) pool_.RestoreRow(t.slot, point->row);  // see SampleAndEmit
    t.tokens = point->tokens;
  }
  t.pending_token = -1;
}

// ---------------------------------------------------------------------------------
// Admission and session operations.

void Engine::Admit(std::unique_ptr<WorkItem> item) {
  if (ending_) {
    return FailItem(std::move(item), absl::UnavailableError("the server is shutting down"));
  }
  // A tensor exception (e.g. out of memory) while admitting fails this item alone, with
  // its lease released and its caller answered; nothing is dropped silently.
  std::optional<TaskId> admitted;  // the stream task made for `item`, if any
  try {
    if (keeper_.NeedsLoad(*item)) return keeper_.StartLoad(std::move(item));
    if (item->IsStream()) {
      metrics_->ObserveQueueWait(absl::ToDoubleSeconds(absl::Now() - item->arrival));
      if (options_.stream_admitted_for_testing) options_.stream_admitted_for_testing(item->tenant);
      auto task = std::make_unique<Task>();
      Task& t = *task;
      admitted = next_task_id_++;
      t.s = &scheduler_.Add(*admitted, TaskKindOf(*item), item->tenant);
      t.generate = item->Is<GenerateWork>() ? &item->As<GenerateWork>()->params : nullptr;
      t.item = std::move(item);
      tasks_[*admitted] = std::move(task);
      AdmitStream(t);
    } else {
      keeper_.RunSessionOperation(item);
    }
  } catch (const std::exception& e) {
    Log(LogLevel::kError, absl::StrCat("model ", name_, ": admission failed: ", e.what()));
    const absl::Status failed = absl::InternalError("the engine failed");
    if (item != nullptr) {
      FailItem(std::move(item), failed);
    } else if (admitted.has_value()) {
      // The task may have ended (and been destroyed) before the exception.
      auto it = tasks_.find(*admitted);
      if (it != tasks_.end()) FailTask(*it->second, failed);
    }
  }
}

void Engine::AdmitStream(Task& t) {
  WorkItem& w = *t.item;
  t.session_id = w.session_id;
  auto session = keeper_.OpenStream(w);
  if (!session.ok()) return FailTask(t, session.status());
  t.session_id = session->id;
  t.slot = session->slot;
  t.tokens_before = t.tokens = session->tokens;
  t.forked = session->forked;

  if (w.Is<ScoreWork>()) {
    // A private copy: the session (if any) is not changed.
    if (t.slot >= 0) {
      t.score_context.state = pool_.CopyRow(t.slot);
      if (t.tokens > 0) t.score_context.next_logits = pool_.CopyLogits(t.slot);
      t.slot = -1;
    } else {
      t.score_context.state = pool_.fresh_row().Clone();
    }
  }

  if (w.is_cancelled && w.is_cancelled()) {
    return FailTask(t, absl::CancelledError("cancelled by the client"));
  }
  StreamLimits limits;  // a Score or CreateSession samples nothing
  if (GenerateWork* generate = w.As<GenerateWork>()) {
    if (w.tokens.empty() && t.tokens == 0) {
      return FailTask(t, absl::InvalidArgumentError(
                             "prompt: must not be empty when the session holds no tokens"));
    }
    if (!t.session_id.empty() && !t.forked) {
      t.snapshot = pool_.CopyRow(t.slot);
      t.snapshot_logits = pool_.CopyLogits(t.slot);
      t.has_snapshot = true;
    }
    const GenerateParams& g = generate->params;
    // The request's message grouping, else the server's.
    const absl::Duration flush_interval =
        g.max_message_delay > absl::ZeroDuration() ? g.max_message_delay
        : g.min_tokens_per_message > 0             ? absl::InfiniteDuration()
                                                   : options_.stream_flush_interval;
    limits = StreamLimits{g.max_tokens,   g.stop,
                          g.logprobs,     options_.decode_lookahead,
                          flush_interval, g.min_tokens_per_message,
                          &tokenizer_};
    t.rng.seed(g.sampling.seed);
    t.recent.assign(w.tokens.end() - std::min<size_t>(w.tokens.size(), g.repetition_window),
                    w.tokens.end());
    metrics_->AddPromptTokensSaved(t.tokens_before);
    tasks_by_stream_[generate->stream_id] = t.s->id;
  }
  Apply(scheduler_.Start(t.s->id, w.tokens.size(), std::move(limits)));
}

// ---------------------------------------------------------------------------------
// Prefill, decode, sampling.

void Engine::StartPrefill() {
  if (prefill_job_ != nullptr) return;
  // A Score or CreateSession whose caller went away stops before its next chunk.
  std::vector<Task*> abandoned;
  for (const ScheduledTask& s : scheduler_.tasks()) {
    if (s.phase != ScheduledTask::Phase::kPrefill) continue;
    Task& t = *tasks_.at(s.id);
    const auto& is_cancelled = t.item->is_cancelled;
    if (is_cancelled && is_cancelled()) abandoned.push_back(&t);
  }
  for (Task* t : abandoned) FailTask(*t, absl::CancelledError("cancelled by the client"));
  std::optional<PrefillChunk> chunk = scheduler_.PlanPrefill();
  if (!chunk) return;
  auto job = std::make_unique<PrefillJob>();
  const size_t length = chunk->length;
  for (TaskId id : chunk->tasks) job->tasks.push_back(tasks_.at(id).get());
  Task* lead = job->tasks.front();
  const size_t from = lead->s->prefilled;
  PrefillWork& work = job->work;
  if (chunk->score) {
    work.score_context = &lead->score_context;
    work.piece.assign(lead->item->tokens.begin() + from,
                      lead->item->tokens.begin() + from + length);
  } else {
    std::vector<int64_t> rows, pieces;
    for (Task* t : job->tasks) {
      const size_t at = t->s->prefilled;
      rows.push_back(t->slot);
      pieces.insert(pieces.end(), t->item->tokens.begin() + at,
                    t->item->tokens.begin() + at + length);
    }
    const torch::Device device = model_.options().device;
    work.rows = torch::tensor(rows, torch::kInt64).to(device);
    work.state = pool_.Gather(work.rows);
    work.tokens = torch::tensor(pieces, torch::kInt64)
                      .view({static_cast<int64_t>(job->tasks.size()), static_cast<int64_t>(length)})
                      .to(device);
  }
  job->chunk = std::move(*chunk);
  prefill_job_ = std::move(job);
  runner_.LaunchPrefill(&prefill_job_->work);
}

void Engine::CompletePrefill() {
  std::unique_ptr<PrefillJob> job = std::move(prefill_job_);
  if (job == nullptr) return;
  PrefillWork& work = job->work;
  if (!work.status.ok()) {
    Log(LogLevel::kError,
        absl::StrCat("model ", name_, ": prefill failed: ", work.status.message()));
    return Apply(scheduler_.AfterPrefill(job->chunk, /*ok=*/false));
  }
  const int64_t length = static_cast<int64_t>(job->chunk.length);
  const int64_t tokens = static_cast<int64_t>(job->tasks.size()) * length;
  const bool score = work.score_context != nullptr;
  if (score) {
    Task& t = *job->tasks.front();
    t.score_logprobs.insert(t.score_logprobs.end(), work.logprobs.begin(), work.logprobs.end());
  } else {
    pool_.Scatter(work.rows, work.state);
    pool_.SetLogits(work.rows, work.last_logits);
    for (Task* t : job->tasks) t->tokens += length;
  }
  metrics_->ObservePrefillChunk(tokens, absl::ToDoubleSeconds(work.elapsed));
  if (score) {
    metrics_->AddScoredTokens(tokens);
  } else {
    metrics_->AddPromptTokens(tokens);
  }
  Apply(scheduler_.AfterPrefill(job->chunk, /*ok=*/true));
}

void Engine::AbandonPrefillJob() {
  if (prefill_job_ == nullptr) return;
  {
    absl::MutexLock lock(&mu_);
    while (!prefill_done_) wake_.Wait(&mu_);
    prefill_done_ = false;
  }
  for (Task* t : prefill_job_->tasks) t->s->in_prefill_job = false;
  prefill_job_.reset();
}

void Engine::RunDecodeStep() {
  if (std::optional<InFlightStep> step = LaunchDecodeStep()) FinishDecodeStep(std::move(*step));
}

std::optional<Engine::InFlightStep> Engine::LaunchDecodeStep() {
  const std::vector<TaskId> batch_ids = scheduler_.PlanStep(absl::Now());
  if (batch_ids.empty()) return std::nullopt;
  if (options_.before_decode_step_for_testing) {
    options_.before_decode_step_for_testing([this] {
      absl::MutexLock lock(&mu_);
      return end_all_;
    });
  }
  std::vector<Task*> batch;
  StepWork work;
  const bool draws_ahead = runner_.draws_ahead();
  const int64_t steps = options_.decode_steps_per_launch;
  if (draws_ahead && steps > 1 && runner_.multi_step()) {
    work.multi.steps = steps;
    if (tokenizer_.end_of_text() >= 0) work.multi.stop_tokens.push_back(tokenizer_.end_of_text());
  }
  for (TaskId id : batch_ids) {
    Task* t = tasks_.at(id).get();
    batch.push_back(t);
    work.rows.push_back(t->slot);
    work.tokens.push_back(t->pending_token);
    // The repetition window as the next sampling sees it: with the absorbed token.
    t->recent.push_back(t->pending_token);
    const size_t window = static_cast<size_t>(t->generate->repetition_window);
    if (t->recent.size() > window) t->recent.erase(t->recent.begin());
    // What the row's next sampling will ask, for a kernel that samples inside the step
    // (Stepper::Step; a row that does not sample next leaves its draw unused).
    if (draws_ahead) {
      work.draws.push_back(
          {t->slot, &t->generate->sampling, &t->rng, &t->recent, t->generate->logprobs});
    }
    if (work.multi.steps > 1) work.multi.limits.push_back(TokensPerLaunch(*t, steps));
  }
  InFlightStep step;
  step.handle = runner_.Launch(work);
  step.ids = batch_ids;
  step.batch = std::move(batch);
  return step;
}

void Engine::FinishDecodeStep(InFlightStep step) {
  const std::vector<TaskId>& batch_ids = step.ids;
  const std::vector<Task*>& batch = step.batch;
  const StepResult stepped = runner_.Wait(step.handle);
  if (!stepped.status.ok()) {
    Log(LogLevel::kError,
        absl::StrCat("model ", name_, ": decode step failed: ", stepped.status.message()));
    for (Task* t : batch) FailTask(*t, absl::InternalError("decode step failed"));
    return;
  }
  metrics_->ObserveDecodeStep(static_cast<int64_t>(batch.size()),
                              absl::ToDoubleSeconds(stepped.elapsed));
  for (Task* t : batch) {
    ++t->tokens;
    t->pending_token = -1;
  }
  Apply(scheduler_.AfterStep(batch_ids));
  if (!stepped.absorbed_ahead.empty()) {
    for (size_t i = 0; i < batch_ids.size(); ++i) {
      TakeTokensAhead(batch_ids[i], stepped.absorbed_ahead[i]);
    }
  }
}

int64_t Engine::TokensPerLaunch(const Task& t, int64_t steps) const {
  const ScheduledTask& s = *t.s;
  // Only a throwaway stream may absorb tokens it will not keep (past a stop string);
  // a session's state must hold exactly the tokens sent. The penalty window is the
  // host's.
  if (!t.session_id.empty() || s.cancelled || t.generate->sampling.repetition_penalty != 1.0f) {
    return 1;
  }
  const StreamTask& stream = s.stream;
  // What the stream may still sample after this step: its lookahead room (nothing is
  // confirmed during the launch) and its max tokens.
  const int64_t room =
      std::min(stream.limits().lookahead - stream.inflight_tokens() - stream.unsent_tokens(),
               stream.limits().max_tokens - stream.sampled());
  return std::clamp<int64_t>(room, 1, steps);
}

void Engine::TakeTokensAhead(TaskId id, const std::vector<SampledToken>& ahead) {
  const absl::Time now = absl::Now();
  for (const SampledToken& drawn : ahead) {
    // Sample: the token the launch drew next.
    auto it = tasks_.find(id);
    if (it == tasks_.end()) return;
    Task* t = it->second.get();
    if (t->s->phase != ScheduledTask::Phase::kReadyToSample || t->s->Parked()) return;
    if (t->generate->sampling.temperature != 0) CanonicalDraw(t->rng);  // as Sample would
    if (t->s->stream.starts_chunk()) t->before_unsent.tokens = t->tokens;
    t->pending_token = drawn.token;
    Apply(scheduler_.AfterSample({id}, {drawn.token},
                                 {t->generate->logprobs ? drawn.logprob : 0.0f}, now));
    // Absorb: the launch absorbed it already.
    it = tasks_.find(id);
    if (it == tasks_.end()) return;
    t = it->second.get();
    // Stopped (a stop string, cancelled): the rest is dropped with this throwaway state.
    if (t->s->phase != ScheduledTask::Phase::kReadyToAbsorb) return;
    t->recent.push_back(t->pending_token);
    const size_t window = static_cast<size_t>(t->generate->repetition_window);
    if (t->recent.size() > window) t->recent.erase(t->recent.begin());
    ++t->tokens;
    t->pending_token = -1;
    Apply(scheduler_.AfterStep({id}));
  }
}

void Engine::SampleAndEmit() {
  // A stream whose lease expired may be another request's now: its write would be
  // refused, so it stops here (FinishTask answers ABORTED).
  std::vector<Task*> lost;
  for (const ScheduledTask& s : scheduler_.tasks()) {
    if (s.phase != ScheduledTask::Phase::kReadyToSample || s.Parked()) continue;
    Task& t = *tasks_.at(s.id);
    if (t.item->ticket != nullptr && t.item->ticket->lost.load()) lost.push_back(&t);
  }
  for (Task* t : lost) FinishTask(*t, FinishReason::kCancelled);
  std::vector<Action> ended;
  const std::vector<TaskId> sampling_ids = scheduler_.PlanSample(&ended);
  Apply(std::move(ended));
  if (sampling_ids.empty()) return;
  std::vector<Task*> sampling;
  for (TaskId id : sampling_ids) {
    Task* t = tasks_.at(id).get();
    sampling.push_back(t);
    if (t->s->stream.starts_chunk()) {
      // Only a session's state outlives the stream: a throwaway stream's rollback point
      // is its token count alone (copying the state row for every message was a quarter
      // of the engine thread's time on fast_weight at 64 streams; docs/benchmarks.md).
      if (!t->session_id.empty()) pool_.SaveRow(t->slot, &t->before_unsent.row);
      t->before_unsent.tokens = t->tokens;
    }
  }
  SampleWork work;
  work.requests.resize(sampling.size());
  for (size_t i = 0; i < sampling.size(); ++i) {
    Task* t = sampling[i];
    work.requests[i] = {t->slot, &t->generate->sampling, &t->rng, &t->recent,
                        t->generate->logprobs};
  }
  const StepResult sampled = runner_.Wait(runner_.Launch(work));
  if (!sampled.status.ok()) {
    Log(LogLevel::kError,
        absl::StrCat("model ", name_, ": sampling failed: ", sampled.status.message()));
    for (Task* t : sampling) FailTask(*t, absl::InternalError("sampling failed"));
    return;
  }
  std::vector<int64_t> tokens(sampling.size());
  std::vector<float> logprobs(sampling.size());
  for (size_t i = 0; i < sampling.size(); ++i) {
    tokens[i] = sampled.sampled[i].token;
    logprobs[i] = sampled.sampled[i].logprob;
    sampling[i]->pending_token = tokens[i];
  }
  Apply(scheduler_.AfterSample(sampling_ids, tokens, logprobs, absl::Now()));
}

std::unique_ptr<WorkItem> Engine::TakeTask(Task& t) {
  std::unique_ptr<WorkItem> item = std::move(t.item);
  drain_.StreamEnded();
  if (const GenerateWork* generate = item->As<GenerateWork>()) {
    tasks_by_stream_.erase(generate->stream_id);
  }
  const TaskId id = t.s->id;
  scheduler_.Remove(id);
  tasks_.erase(id);  // `t` is gone
  return item;
}

void Engine::FinishTask(Task& t, FinishReason reason) {
  if (t.item->Is<CreateWork>() && t.item->is_cancelled && t.item->is_cancelled()) {
    // Nobody will learn the new id: remove the session rather than leave an orphan.
    return FailTask(t, absl::CancelledError("cancelled by the client"));
  }
  const bool cut = reason == FinishReason::kCancelled || reason == FinishReason::kShutdown;
  if (cut) DropUnconfirmed(t);
  const StreamTask& stream = t.s->stream;
  const bool rollback = t.has_snapshot && stream.confirmed() == 0 && cut;
  if (rollback) RestoreSnapshot(t);
  StreamEnd end;
  end.id = t.session_id;
  end.slot = t.slot;
  end.tokens = t.tokens;
  end.forked = t.forked;
  end.delivered = stream.confirmed();
  end.cut = cut;
  end.rolled_back = rollback;
  // What the client received; the session keeps it if this request commits.
  end.output = stream.output();
  GenerateSummary summary;
  summary.reason = reason;
  summary.trailing_text = t.s->stream.FinishText();
  summary.prompt_tokens = rollback ? 0 : static_cast<int64_t>(t.s->prefilled);
  summary.generated_tokens = stream.confirmed();
  summary.session_tokens = t.tokens;
  std::vector<double> logprobs = std::move(t.score_logprobs);
  std::shared_ptr<WorkItem> item(TakeTask(t));  // `t` is gone

  auto answer = [this, item, summary, logprobs](absl::Status status) {
    WorkItem& w = *item;
    const absl::Time end = absl::Now();
    std::visit(Overloaded{
                   [&](GenerateWork& g) {
                     metrics_->AddGeneratedTokens(summary.generated_tokens);
                     metrics_->ObserveGenerationDuration(Seconds(w.arrival, end));
                     g.observer->OnFinish(status, summary);
                   },
                   [&](ScoreWork& s) {
                     if (!status.ok()) {
                       s.done(status);
                     } else if (summary.reason == FinishReason::kShutdown) {
                       s.done(absl::UnavailableError("the server is shutting down"));
                     } else {
                       s.done(ScoreResult{std::move(w.tokens), logprobs});
                     }
                   },
                   [&](CreateWork& c) {
                     if (status.ok()) {
                       c.done(keeper_.Record(w.session_id));
                     } else {
                       c.done(status);
                     }
                   },
                   [](auto&) {},  // not a stream
               },
               w.work);
  };
  keeper_.CommitStream(std::move(item), std::move(end), std::move(answer));
}

void Engine::FailTask(Task& t, absl::Status status) {
  // Tokens already streamed stay committed (the state holds exactly what the client
  // got); a request that streamed nothing is undone. A chunk whose write is still in
  // flight counts as not delivered.
  DropUnconfirmed(t);
  const bool keep_streamed = t.s->stream.confirmed() > 0;
  if (t.has_snapshot && !keep_streamed) RestoreSnapshot(t);
  StreamEnd end;
  end.id = t.session_id;
  end.slot = t.slot;
  end.tokens = t.tokens;
  end.forked = t.forked;
  end.delivered = t.s->stream.confirmed();
  end.rolled_back = t.has_snapshot && !keep_streamed;
  end.output = t.s->stream.output();             // the streamed chunks' text
  std::unique_ptr<WorkItem> item = TakeTask(t);  // `t` is gone
  keeper_.FailStream(std::move(item), std::move(end), std::move(status));
}

void Engine::RestoreSnapshot(Task& t) {
  pool_.SetRow(t.slot, t.snapshot, t.snapshot_logits);
  t.tokens = t.tokens_before;
}

}  // namespace fwserve
