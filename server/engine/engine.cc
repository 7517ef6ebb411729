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

// A Generate, Score or CreateSession being served. Engine thread only.
struct Engine::Task {
  // kReadyToAbsorb: `pending_token` was sampled and goes into the next decode step.
  // kBlocked: absorbed, but decode_lookahead tokens are unconfirmed: waits for a write.
  // kDraining: done sampling (stop, length or cancelled); waits for the last write.
  enum class Phase { kPrefill, kReadyToSample, kReadyToAbsorb, kBlocked, kDraining };
  // The slot and token count as they were before some token was absorbed (the
  // decoder's point is the StreamTask's).
  struct RollbackPoint {
    StatePool::RowCopy row;
    int64_t tokens = 0;
  };

  std::unique_ptr<WorkItem> item;
  Phase phase = Phase::kPrefill;
  std::string session_id;  // empty for a throwaway (Generate/Score without a session)
  int slot = -1;           // pool row being advanced; -1 for Score (private context)
  size_t prefilled = 0;    // prompt tokens absorbed so far
  int64_t tokens_before = 0;
  int64_t tokens = 0;  // tokens the slot's state has absorbed
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
  // Generate: sampled, sent and confirmed tokens, stop strings, max tokens. A failed
  // write or a cancellation puts the slot back to the rollback point of the first
  // unconfirmed token, so the session holds exactly the tokens the client was sent.
  StreamTask stream{StreamLimits{}};
  RollbackPoint before_inflight;  // valid while stream.write_in_flight()
  RollbackPoint before_unsent;    // valid while stream.has_unsent()
  bool cancelled = false;
  bool shutdown = false;
  // Preempted for another tenant's fair share (WaitForWork): keeps its slot, state and
  // stream, but is not stepped or sampled, and does not count as running, until a slot
  // frees. A cancelled task is never held parked (it must be able to end).
  bool parked = false;
  // Its rows are on the prefill thread: it must not finish until the job returns.
  bool in_prefill_job = false;
  absl::Time first_token_at = absl::InfinitePast();
  absl::Time last_emit_at;
};

namespace {

constexpr absl::Duration kHousekeepingInterval = absl::Seconds(1);

// Generate, Score and CreateSession become tasks that count against
// --max-active-streams; the other session operations run at admission.
bool IsStreamKind(WorkItem::Kind kind) {
  return kind == WorkItem::Kind::kGenerate || kind == WorkItem::Kind::kScore ||
         kind == WorkItem::Kind::kCreate;
}

double Seconds(absl::Time from, absl::Time to) { return absl::ToDoubleSeconds(to - from); }

}  // namespace

Engine::Engine(std::string name, fwmodel::LoadedModel loaded, const EngineOptions& options,
               EngineContext context)
    : name_(std::move(name)),
      model_(std::move(loaded.model)),
      fingerprint_(std::move(loaded.fingerprint)),
      options_(options),
      registry_(&context.directory->registry()),
      directory_(context.directory),
      policy_(context.directory->policy()),
      executor_(&context.directory->executor()),
      budget_(context.budget),
      clock_(context.clock != nullptr ? context.clock : Clock::Real()),
      metrics_(context.metrics),
      state_bytes_(model_.state_bytes_per_session()),
      vocab_(model_.config().vocab_size),
      admission_{name_,
                 options.max_queued_requests,
                 options.max_queue_wait,
                 options.max_active_streams,
                 options.codel_target,
                 options.codel_interval},
      queue_(admission_, [](const WorkItem& item) { return IsStreamKind(item.kind); }),
      pool_(model_, options.max_state_memory_bytes / std::max<int64_t>(1, state_bytes_),
            context.budget),
      stepper_(model_, options.decode_kernel, options.packed_gemm, options.intra_op_threads,
               options.prefill_threads, name_) {}

Engine::~Engine() { Stop(); }

// A prefill chunk computed off the engine thread. The engine thread fills the inputs
// (copies of the rows), the prefill thread the outputs; neither touches the other's
// fields while the job is in flight.
struct Engine::PrefillJob {
  std::vector<Task*> tasks;
  size_t length = 0;
  // Generate / CreateSession: rows of the pool (copied) and their tokens [B, length].
  torch::Tensor rows;
  fwmodel::State state;
  torch::Tensor tokens;
  // Score: the task's private context and the piece of text.
  fwmodel::ScoringContext* score_context = nullptr;
  std::vector<int64_t> piece;
  // Outputs.
  absl::Status status;
  torch::Tensor last_logits;  // float32 [B, vocab], on the model's device
  std::vector<double> logprobs;
  absl::Duration elapsed;
};

void LimitIntraOpThreads(int32_t threads) {
  if (threads > 0) {
    at::set_num_threads(threads);
    fwmodel::SetOpenBlasThreads(threads);
  }
}

void Engine::Start() {
  // Named for profilers and top -H (Linux limits names to 15 characters).
  prefill_thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "fwserve-prefill");
    PrefillThreadLoop();
  });
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "fwserve-engine");
    Loop();
  });
}

void Engine::PrefillThreadLoop() {
  torch::NoGradGuard no_grad;
  LimitIntraOpThreads(options_.intra_op_threads);
  while (true) {
    PrefillJob* job = nullptr;
    {
      absl::MutexLock lock(&prefill_mu_);
      while (prefill_pending_ == nullptr && !prefill_stop_) prefill_cv_.Wait(&prefill_mu_);
      if (prefill_pending_ == nullptr) return;
      job = prefill_pending_;
      prefill_pending_ = nullptr;
    }
    const absl::Time start = absl::Now();
    try {
      if (job->score_context != nullptr) {
        auto logprobs = fwmodel::ScoreTokens(model_, job->piece, job->score_context,
                                             options_.prefill_chunk_tokens);
        if (logprobs.ok()) {
          job->logprobs = std::move(*logprobs);
        } else {
          job->status = logprobs.status();
        }
      } else {
        auto logits = stepper_.Prefill(job->tokens, &job->state);
        if (logits.ok()) {
          job->last_logits = std::move(*logits);
        } else {
          job->status = logits.status();
        }
      }
    } catch (const std::exception& e) {
      job->status = absl::InternalError(e.what());
    }
    job->elapsed = absl::Now() - start;
    absl::MutexLock lock(&mu_);
    prefill_done_ = true;
    wake_.Signal();
  }
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
  return WithRetryDelay(absl::DeadlineExceededError(absl::StrCat(
                            "model '", name_,
                            "' cannot start this request before its deadline: the queue's "
                            "expected wait is ",
                            absl::FormatDuration(absl::Trunc(wait, absl::Milliseconds(1))))),
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
  if (item->kind == WorkItem::Kind::kGenerate) {
    if (absl::Status late = DeadlineRefusal(item->generate.deadline); !late.ok()) return late;
  }
  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("the server is shutting down");
  absl::Status queued = queue_.Push(item, QueueCapacity(), absl::Now());
  if (!queued.ok()) return WithRetryDelay(std::move(queued), RetryDelay());
  published_queued_.store(queue_.size(), std::memory_order_relaxed);
  wake_.Signal();
  return queued;
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

bool Engine::Parked(const Task& t) { return t.parked && !t.cancelled; }

absl::flat_hash_map<std::string, int64_t> Engine::RunningByTenant() const {
  absl::flat_hash_map<std::string, int64_t> running;
  for (const auto& task : tasks_) {
    if (task->item != nullptr && !Parked(*task)) ++running[task->item->tenant];
  }
  return running;
}

int64_t Engine::ResumeParked(int64_t running) {
  for (auto& task : tasks_) {
    if (running >= options_.max_active_streams) break;
    if (!Parked(*task)) continue;
    task->parked = false;
    ++running;
  }
  return running;
}

bool Engine::PreemptForFairShare(int64_t running) {
  if (running < options_.max_active_streams) return false;
  const std::vector<std::string> waiting = queue_.WaitingStreamTenants();
  if (waiting.empty()) return false;
  // What each tenant holds: its streams running and parked (a tenant is not short of
  // its share because of its own parked streams, so two tenants never take turns).
  absl::flat_hash_map<std::string, int64_t> held;
  for (const auto& task : tasks_) {
    if (task->item != nullptr) ++held[task->item->tenant];
  }
  absl::flat_hash_set<std::string> tenants(waiting.begin(), waiting.end());
  for (const auto& [tenant, count] : held) tenants.insert(tenant);
  // The share is max_active_streams / tenants, compared without rounding.
  const int64_t n = static_cast<int64_t>(tenants.size());
  const int64_t slots = options_.max_active_streams;
  // The oldest waiting stream of a tenant below its share, against the newest running
  // stream of the tenant furthest above it. Only a Generate between tokens is parked
  // (not one in its prompt's prefill).
  const std::string* under = nullptr;
  for (const std::string& tenant : waiting) {
    if (held[tenant] * n < slots) {
      under = &tenant;
      break;
    }
  }
  if (under == nullptr) return false;
  Task* victim = nullptr;
  int64_t victim_held = 0;
  for (auto& task : tasks_) {
    Task& t = *task;
    if (Parked(t) || t.cancelled || t.in_prefill_job || t.item == nullptr ||
        t.item->kind != WorkItem::Kind::kGenerate || t.phase == Task::Phase::kPrefill ||
        t.phase == Task::Phase::kDraining) {
      continue;
    }
    const int64_t count = held[t.item->tenant];
    if (count * n <= slots) continue;  // not above its share
    if (victim == nullptr || count > victim_held ||
        (count == victim_held && t.item->tenant == victim->item->tenant)) {
      victim = &t;  // later tasks of the same tenant replace it: the newest is parked
      victim_held = count;
    }
  }
  if (victim == nullptr) return false;
  victim->parked = true;
  metrics_->CountPreempted();
  return true;
}

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
      StartPrefill();   // prefill: the next chunk to the prefill thread
      RunDecodeStep();  // step: one batched step for every stream ready to absorb
      SampleAndEmit();  // sample, and emit what may go out
    } catch (const std::exception& e) {
      Log(LogLevel::kError, absl::StrCat("model ", name_, ": engine iteration failed: ", e.what()));
      try {
        AbandonPrefillJob();
        while (!tasks_.empty()) FailTask(*tasks_.front(), absl::InternalError("the engine failed"));
      } catch (const std::exception& again) {
        Log(LogLevel::kError, absl::StrCat("model ", name_, ": recovery failed: ", again.what()));
      }
    }
    const absl::Time now = absl::Now();
    if (now >= next_housekeeping_) {
      Housekeeping();
      next_housekeeping_ = now + kHousekeepingInterval;
    }
    if (!PublishReadiness(work.stop)) break;
  }

  {
    absl::MutexLock lock(&prefill_mu_);
    prefill_stop_ = true;
    prefill_cv_.Signal();
  }
  prefill_thread_.join();
  StoreUnstoredAtExit();
}

Engine::IterationWork Engine::WaitForWork() {
  IterationWork work;
  const absl::Time wait_until = std::min(batch_deadline_, next_housekeeping_);
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
  int64_t parked = 0;
  for (const auto& task : tasks_) parked += Parked(*task) ? 1 : 0;
  const int64_t running = static_cast<int64_t>(tasks_.size()) - parked;
  int64_t active = parked > 0 ? ResumeParked(running) : running;
  const absl::Time now = absl::Now();
  // CoDel (--queue-codel-target): what waited past the target under a standing queue is
  // refused before the free slots are given out, so what starts has waited at most it.
  if (!end_all_)
    queue_.TakeShed(
        now, [this] { return RunningByTenant(); }, work.shed);
  queue_.TakeAdmissible(
      active, end_all_, [this] { return RunningByTenant(); }, work.admitted, now);
  if (options_.preempt_for_fair_share && !end_all_ && PreemptForFairShare(active)) {
    --active;
    queue_.TakeAdmissible(
        active, false, [this] { return RunningByTenant(); }, work.admitted, now);
  }
  // WaitIdle must not see admitted (or parked) work as idle.
  active_tasks_ = static_cast<int64_t>(tasks_.size()) + static_cast<int64_t>(work.admitted.size());
  drain_.Tick(absl::Now(), active >= options_.max_active_streams);
  published_queued_.store(queue_.size(), std::memory_order_relaxed);
  published_free_slots_.store(std::max<int64_t>(0, options_.max_active_streams - active),
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
             WithRetryDelay(absl::ResourceExhaustedError(absl::StrCat(
                                "model '", name_, "' is overloaded: this request waited ",
                                absl::FormatDuration(waited),
                                " in a standing queue, past --queue-codel-target=",
                                absl::FormatDuration(options_.codel_target), "; retry later")),
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

void Engine::EndAllTasks() {
  for (auto& task : tasks_) {
    if (!task->cancelled) {
      task->cancelled = true;
      task->shutdown = true;
    }
  }
  // Streams not waiting on a write end now; the others when their write returns.
  // An unfinished CreateSession or Score fails (its result would be partial).
  std::vector<Task*> ending;
  for (auto& task : tasks_) {
    if (!task->stream.write_in_flight() && task->phase != Task::Phase::kReadyToAbsorb &&
        !task->in_prefill_job) {
      ending.push_back(task.get());
    }
  }
  for (Task* task : ending) {
    if (task->item->kind == WorkItem::Kind::kGenerate) {
      FinishTask(*task, FinishReason::kShutdown);
    } else {
      FailTask(*task, absl::UnavailableError("the server is shutting down"));
    }
  }
}

bool Engine::PublishReadiness(bool stop) {
  bool awaiting = false;
  bool ready_to_absorb = false;
  bool immediate = false;
  int64_t running = 0;
  bool parked = false;
  for (const auto& task : tasks_) {
    if (Parked(*task)) {
      parked = true;
      continue;
    }
    ++running;
    switch (task->phase) {
      case Task::Phase::kBlocked:
        // Joins the next step once a write returns; a draining stream never does.
        awaiting = true;
        break;
      case Task::Phase::kDraining:
        break;  // waits for its last write; nothing to do here until then
      case Task::Phase::kReadyToAbsorb:
        ready_to_absorb = true;
        break;
      case Task::Phase::kPrefill:
        // Waiting for the prefill thread is not work for this one.
        if (prefill_job_ == nullptr) immediate = true;
        break;
      default:
        immediate = true;
    }
  }
  if (parked && running < options_.max_active_streams) immediate = true;  // one resumes
  // Absorb at once if nothing else can join the batch; else wait (at most until
  // batch_deadline_) for the streams still writing.
  if (ready_to_absorb && !awaiting) immediate = true;
  if (!ready_to_absorb) batch_deadline_ = absl::InfiniteFuture();
  absl::MutexLock lock(&mu_);
  active_tasks_ = static_cast<int64_t>(tasks_.size());
  immediate_work_ = immediate;
  idle_changed_.SignalAll();
  return !(stop && tasks_.empty() && queue_.empty() && store_jobs_ == 0 && continuations_.empty());
}

void Engine::ApplyEvent(const Event& event) {
  auto it = tasks_by_stream_.find(event.stream_id);
  if (it == tasks_by_stream_.end()) return;  // already finished
  Task& task = *it->second;
  const FinishReason ended = task.shutdown ? FinishReason::kShutdown : FinishReason::kCancelled;
  switch (event.kind) {
    case Event::kWriteOk:
      if (!task.stream.write_in_flight()) break;
      task.stream.ConfirmWrite();
      if (task.cancelled) {
        // The chunk arrived; what was sampled after it was never sent. A pending token
        // with nothing unsent was delivered: RunDecodeStep absorbs it, then ends.
        if (!task.stream.has_unsent() && task.phase == Task::Phase::kReadyToAbsorb) break;
        FinishTask(task, ended);  // drops the unsent tokens
        break;
      }
      if (task.stream.has_unsent() && task.stream.ShouldFlush(absl::Now())) Flush(task);
      if (task.phase == Task::Phase::kDraining && !task.stream.write_in_flight()) {
        FinishTask(task, task.stream.stop_hit() ? FinishReason::kStop : FinishReason::kLength);
      } else if (task.phase == Task::Phase::kBlocked && task.stream.CanSample()) {
        task.phase = Task::Phase::kReadyToSample;
      }
      break;
    case Event::kWriteFailed:
      // The client never got the chunk: it and everything after it are undone.
      task.cancelled = true;
      if (task.stream.write_in_flight()) FinishTask(task, ended);
      break;
    case Event::kCancel:
      task.cancelled = true;
      if ((task.phase == Task::Phase::kPrefill && !task.in_prefill_job) ||
          (task.phase == Task::Phase::kReadyToSample && !task.stream.write_in_flight())) {
        FinishTask(task, FinishReason::kCancelled);
      }
      // A write in flight: decided when it returns. Ready to absorb with nothing in
      // flight: the token was delivered, so it is absorbed first (RunDecodeStep).
      break;
  }
}

void Engine::Flush(Task& t) {
  std::swap(t.before_inflight, t.before_unsent);  // reuses the buffers
  GenerateChunk chunk = t.stream.TakeChunkForWrite();
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
  t.item->observer->OnChunk(std::move(chunk));
}

void Engine::DropUnconfirmed(Task& t) {
  Task::RollbackPoint* point = nullptr;
  switch (t.stream.DropUnconfirmed()) {
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
  Task* admitted = nullptr;
  try {
    const WorkItem::Kind kind = item->kind;
    const bool needs_state = !item->session_id.empty() && kind != WorkItem::Kind::kDelete &&
                             kind != WorkItem::Kind::kCreate;
    if (needs_state && item->ticket != nullptr) DropStaleCopy(*item);
    if ((needs_state && !resident_.contains(item->session_id) && !item->loaded) ||
        (kind == WorkItem::Kind::kImport && !item->loaded)) {
      return StartLoad(std::move(item));
    }
    if (IsStreamKind(kind)) {
      metrics_->ObserveQueueWait(absl::ToDoubleSeconds(absl::Now() - item->arrival));
      auto task = std::make_unique<Task>();
      admitted = task.get();
      task->item = std::move(item);
      tasks_.push_back(std::move(task));
      AdmitStream(*admitted);
    } else {
      RunSessionOperation(item);
    }
  } catch (const std::exception& e) {
    Log(LogLevel::kError, absl::StrCat("model ", name_, ": admission failed: ", e.what()));
    const absl::Status failed = absl::InternalError("the engine failed");
    if (item != nullptr) {
      FailItem(std::move(item), failed);
    } else if (admitted != nullptr) {
      for (auto& task : tasks_) {
        if (task.get() == admitted) {
          FailTask(*admitted, failed);
          break;
        }
      }
    }
  }
}

void Engine::AdmitStream(Task& t) {
  WorkItem& w = *t.item;
  t.session_id = w.session_id;
  const absl::Time now = clock_->Now();

  if (w.kind == WorkItem::Kind::kCreate) {
    auto slot = AllocateSlot();
    if (!slot.ok()) return FailTask(t, slot.status());
    t.slot = *slot;
    pool_.Reset(t.slot);
    SessionRecord record;
    record.id = NewSessionId();
    record.model = name_;
    record.state_bytes = state_bytes_;
    record.created = record.last_used = now;
    record.tenant = w.tenant;
    auto lease = registry_->InsertLeased(record);
    if (!lease.ok()) return FailTask(t, lease.status());  // frees the slot
    w.lease = std::move(*lease);
    t.session_id = record.id;
    resident_[t.session_id] = ResidentSession{t.slot, 0, now, now, /*in_use=*/true};
    resident_[t.session_id].tenant = w.tenant;
    metrics_->CountSessionOperation("created");
  } else if (!t.session_id.empty()) {
    auto slot = EnsureResident(w);
    if (!slot.ok()) return FailTask(t, slot.status());
    ResidentSession& r = resident_[t.session_id];
    r.in_use = true;
    t.slot = *slot;
    t.tokens_before = t.tokens = r.tokens;
  } else if (w.kind == WorkItem::Kind::kGenerate) {
    auto slot = AllocateSlot();
    if (!slot.ok()) return FailTask(t, slot.status());
    t.slot = *slot;
    pool_.Reset(t.slot);
  }

  if (w.kind == WorkItem::Kind::kScore) {
    // A private copy: the session (if any) is not changed.
    if (t.slot >= 0) {
      t.score_context.state = pool_.CopyRow(t.slot);
      if (t.tokens > 0) t.score_context.next_logits = pool_.CopyLogits(t.slot);
      resident_[t.session_id].in_use = false;
      t.slot = -1;
    } else {
      t.score_context.state = pool_.fresh_row().Clone();
    }
  }

  if (w.is_cancelled && w.is_cancelled()) {
    return FailTask(t, absl::CancelledError("cancelled by the client"));
  }
  if (w.kind == WorkItem::Kind::kGenerate) {
    if (w.tokens.empty() && t.tokens == 0) {
      return FailTask(t, absl::InvalidArgumentError(
                             "prompt: must not be empty when the session holds no tokens"));
    }
    if (!t.session_id.empty()) {
      t.snapshot = pool_.CopyRow(t.slot);
      t.snapshot_logits = pool_.CopyLogits(t.slot);
      t.has_snapshot = true;
    }
    const GenerateParams& g = w.generate;
    // The request's message grouping, else the server's.
    const absl::Duration flush_interval =
        g.max_message_delay > absl::ZeroDuration() ? g.max_message_delay
        : g.min_tokens_per_message > 0             ? absl::InfiniteDuration()
                                                   : options_.stream_flush_interval;
    t.stream = StreamTask(StreamLimits{g.max_tokens, g.stop, g.logprobs, options_.decode_lookahead,
                                       flush_interval, g.min_tokens_per_message});
    t.rng.seed(g.sampling.seed);
    t.recent.assign(w.tokens.end() - std::min<size_t>(w.tokens.size(), g.repetition_window),
                    w.tokens.end());
    metrics_->AddPromptTokensSaved(t.tokens_before);
    tasks_by_stream_[w.stream_id] = &t;
  }
  t.phase = w.tokens.empty() ? Task::Phase::kReadyToSample : Task::Phase::kPrefill;
  if (t.phase == Task::Phase::kReadyToSample && w.generate.max_tokens == 0) {
    FinishTask(t, FinishReason::kLength);
  }
}

// ---------------------------------------------------------------------------------
// Prefill, decode, sampling.

void Engine::StartPrefill() {
  if (prefill_job_ != nullptr) return;
  std::vector<Task*> prefilling, abandoned;
  for (auto& task : tasks_) {
    if (task->phase != Task::Phase::kPrefill) continue;
    const auto& is_cancelled = task->item->is_cancelled;
    (is_cancelled && is_cancelled() ? abandoned : prefilling).push_back(task.get());
  }
  for (Task* t : abandoned) FailTask(*t, absl::CancelledError("cancelled by the client"));
  if (prefilling.empty()) return;
  const size_t chunk = static_cast<size_t>(options_.prefill_chunk_tokens);
  auto next_length = [chunk](const Task* t) {
    return std::min(chunk, t->item->tokens.size() - t->prefilled);
  };
  // The lead task goes round robin. Other pool-backed prefills whose next chunk has the
  // same length join it in one batched Forward (no padding: equal lengths only), up to
  // `chunk` tokens in all, so one job's work stays bounded.
  Task* lead = prefilling[prefill_turn_++ % prefilling.size()];
  auto job = std::make_unique<PrefillJob>();
  job->length = next_length(lead);
  job->tasks = {lead};
  if (lead->item->kind == WorkItem::Kind::kScore) {
    job->score_context = &lead->score_context;
    job->piece.assign(lead->item->tokens.begin() + lead->prefilled,
                      lead->item->tokens.begin() + lead->prefilled + job->length);
  } else {
    for (Task* other : prefilling) {
      if ((job->tasks.size() + 1) * job->length > chunk) break;
      if (other != lead && other->item->kind != WorkItem::Kind::kScore &&
          next_length(other) == job->length) {
        job->tasks.push_back(other);
      }
    }
    std::vector<int64_t> rows, pieces;
    for (Task* t : job->tasks) {
      rows.push_back(t->slot);
      pieces.insert(pieces.end(), t->item->tokens.begin() + t->prefilled,
                    t->item->tokens.begin() + t->prefilled + job->length);
    }
    const torch::Device device = model_.options().device;
    job->rows = torch::tensor(rows, torch::kInt64).to(device);
    job->state = pool_.Gather(job->rows);
    job->tokens =
        torch::tensor(pieces, torch::kInt64)
            .view({static_cast<int64_t>(job->tasks.size()), static_cast<int64_t>(job->length)})
            .to(device);
  }
  for (Task* t : job->tasks) t->in_prefill_job = true;
  prefill_job_ = std::move(job);
  absl::MutexLock lock(&prefill_mu_);
  prefill_pending_ = prefill_job_.get();
  prefill_cv_.Signal();
}

void Engine::CompletePrefill() {
  std::unique_ptr<PrefillJob> job = std::move(prefill_job_);
  if (job == nullptr) return;
  for (Task* t : job->tasks) t->in_prefill_job = false;
  if (!job->status.ok()) {
    Log(LogLevel::kError,
        absl::StrCat("model ", name_, ": prefill failed: ", job->status.message()));
    for (Task* t : job->tasks) FailTask(*t, absl::InternalError("prefill failed"));
    return;
  }
  const int64_t tokens = static_cast<int64_t>(job->tasks.size() * job->length);
  const bool score = job->score_context != nullptr;
  if (score) {
    Task& t = *job->tasks.front();
    t.score_logprobs.insert(t.score_logprobs.end(), job->logprobs.begin(), job->logprobs.end());
  } else {
    pool_.Scatter(job->rows, job->state);
    pool_.SetLogits(job->rows, job->last_logits);
    for (Task* t : job->tasks) t->tokens += static_cast<int64_t>(job->length);
  }
  metrics_->ObservePrefillChunk(tokens, absl::ToDoubleSeconds(job->elapsed));
  if (score) {
    metrics_->AddScoredTokens(tokens);
  } else {
    metrics_->AddPromptTokens(tokens);
  }
  for (Task* t : job->tasks) {
    t->prefilled += job->length;
    const bool generate = t->item->kind == WorkItem::Kind::kGenerate;
    if (t->cancelled) {
      // Cancelled or shut down while the chunk ran: a Generate rolls back (nothing was
      // streamed); a Score or CreateSession fails.
      if (generate) {
        FinishTask(*t, t->shutdown ? FinishReason::kShutdown : FinishReason::kCancelled);
      } else {
        FailTask(*t, absl::UnavailableError("the server is shutting down"));
      }
    } else if (t->prefilled < t->item->tokens.size()) {
      continue;
    } else if (generate && t->item->generate.max_tokens > 0) {
      t->phase = Task::Phase::kReadyToSample;
    } else {
      FinishTask(*t, FinishReason::kLength);
    }
  }
}

void Engine::AbandonPrefillJob() {
  if (prefill_job_ == nullptr) return;
  {
    absl::MutexLock lock(&mu_);
    while (!prefill_done_) wake_.Wait(&mu_);
    prefill_done_ = false;
  }
  for (Task* t : prefill_job_->tasks) t->in_prefill_job = false;
  prefill_job_.reset();
}

void Engine::RunDecodeStep() {
  std::vector<Task*> batch;
  for (auto& task : tasks_) {
    if (task->phase == Task::Phase::kReadyToAbsorb && !Parked(*task)) batch.push_back(task.get());
  }
  if (batch.empty()) return;
  // Give streams whose write is still in flight `batch_wait` to join this step.
  bool awaiting = false;
  for (auto& task : tasks_) awaiting |= task->phase == Task::Phase::kBlocked && !Parked(*task);
  if (awaiting) {
    const absl::Time now = absl::Now();
    if (batch_deadline_ == absl::InfiniteFuture()) {
      batch_deadline_ = now + options_.batch_wait;
      return;
    }
    if (now < batch_deadline_) return;
  }
  batch_deadline_ = absl::InfiniteFuture();
  if (options_.before_decode_step_for_testing) {
    options_.before_decode_step_for_testing([this] {
      absl::MutexLock lock(&mu_);
      return end_all_;
    });
  }
  const absl::Time start = absl::Now();
  std::vector<int64_t> rows_vec, tokens_vec;
  for (Task* t : batch) {
    rows_vec.push_back(t->slot);
    tokens_vec.push_back(t->pending_token);
  }
  const absl::Status stepped = stepper_.Step(rows_vec, tokens_vec, pool_);
  if (!stepped.ok()) {
    Log(LogLevel::kError,
        absl::StrCat("model ", name_, ": decode step failed: ", stepped.message()));
    for (Task* t : batch) FailTask(*t, absl::InternalError("decode step failed"));
    return;
  }
  metrics_->ObserveDecodeStep(static_cast<int64_t>(batch.size()), Seconds(start, absl::Now()));
  for (Task* t : batch) {
    ++t->tokens;
    t->recent.push_back(t->pending_token);
    const size_t window = static_cast<size_t>(t->item->generate.repetition_window);
    if (t->recent.size() > window) t->recent.erase(t->recent.begin());
    t->pending_token = -1;
    const bool done = t->stream.done_sampling() || t->cancelled;
    if (done && t->stream.write_in_flight()) {
      t->phase = Task::Phase::kDraining;  // ends when the write returns (ApplyEvent)
    } else if (done) {
      FinishTask(*t, t->cancelled
                         ? (t->shutdown ? FinishReason::kShutdown : FinishReason::kCancelled)
                         : (t->stream.stop_hit() ? FinishReason::kStop : FinishReason::kLength));
    } else {
      t->phase = t->stream.CanSample() ? Task::Phase::kReadyToSample : Task::Phase::kBlocked;
    }
  }
}

void Engine::SampleAndEmit() {
  std::vector<Task*> ready;
  for (auto& task : tasks_) {
    if (task->phase == Task::Phase::kReadyToSample && !Parked(*task)) ready.push_back(task.get());
  }
  // The streams that draw a token now: all at once (one batch on the graph kernel).
  std::vector<Task*> sampling;
  for (Task* t : ready) {
    if (t->item->ticket != nullptr && t->item->ticket->lost.load()) {
      // The lease expired and may be another request's now: this request's write
      // would be refused, so it stops here (FinishTask answers ABORTED).
      FinishTask(*t, FinishReason::kCancelled);
      continue;
    }
    if (t->cancelled) {
      // Cancelled while a write is in flight: nothing more is sampled.
      if (t->stream.write_in_flight()) {
        t->phase = Task::Phase::kDraining;
      } else {
        FinishTask(*t, t->shutdown ? FinishReason::kShutdown : FinishReason::kCancelled);
      }
      continue;
    }
    if (t->stream.starts_chunk()) {
      // Only a session's state outlives the stream: a throwaway stream's rollback point
      // is its token count alone (copying the state row for every message was a quarter
      // of the engine thread's time on fast_weight at 64 streams; docs/benchmarks.md).
      if (!t->session_id.empty()) pool_.SaveRow(t->slot, &t->before_unsent.row);
      t->before_unsent.tokens = t->tokens;
    }
    sampling.push_back(t);
  }
  if (sampling.empty()) return;
  std::vector<Stepper::SampleRequest> requests(sampling.size());
  for (size_t i = 0; i < sampling.size(); ++i) {
    Task* t = sampling[i];
    requests[i] = {t->slot, &t->item->generate.sampling, &t->rng, &t->recent,
                   t->item->generate.logprobs};
  }
  auto sampled = stepper_.Sample(requests, pool_);
  if (!sampled.ok()) {
    Log(LogLevel::kError,
        absl::StrCat("model ", name_, ": sampling failed: ", sampled.status().message()));
    for (Task* t : sampling) FailTask(*t, absl::InternalError("sampling failed"));
    return;
  }
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < sampling.size(); ++i) {
    Task* t = sampling[i];
    t->stream.AddSampled((*sampled)[i].token, (*sampled)[i].logprob, now);
    t->pending_token = (*sampled)[i].token;
    t->phase = Task::Phase::kReadyToAbsorb;
    if (!t->stream.write_in_flight() && t->stream.ShouldFlush(now)) Flush(*t);
  }
}

std::unique_ptr<WorkItem> Engine::TakeTask(Task& t) {
  std::unique_ptr<WorkItem> item = std::move(t.item);
  drain_.StreamEnded();
  if (item->kind == WorkItem::Kind::kGenerate) tasks_by_stream_.erase(item->stream_id);
  tasks_.remove_if([&t](const std::unique_ptr<Task>& p) { return p.get() == &t; });
  return item;
}

void Engine::FinishTask(Task& t, FinishReason reason) {
  if (t.item->kind == WorkItem::Kind::kCreate && t.item->is_cancelled && t.item->is_cancelled()) {
    // Nobody will learn the new id: remove the session rather than leave an orphan.
    return FailTask(t, absl::CancelledError("cancelled by the client"));
  }
  if (reason == FinishReason::kCancelled || reason == FinishReason::kShutdown) {
    DropUnconfirmed(t);
  }
  const absl::Time now = clock_->Now();
  const bool rollback = t.has_snapshot && t.stream.confirmed() == 0 &&
                        (reason == FinishReason::kCancelled || reason == FinishReason::kShutdown);
  if (rollback) RestoreSnapshot(t);
  const std::string id = t.session_id;
  const int slot = t.slot;
  const int64_t tokens = t.tokens;
  GenerateSummary summary;
  summary.reason = reason;
  summary.trailing_text = t.stream.FinishText();
  // What the client received; the session keeps it if this request commits.
  LastOutput output = t.stream.output();
  summary.prompt_tokens = rollback ? 0 : static_cast<int64_t>(t.prefilled);
  summary.generated_tokens = t.stream.confirmed();
  summary.session_tokens = tokens;
  std::vector<double> logprobs = std::move(t.score_logprobs);
  std::shared_ptr<WorkItem> item(TakeTask(t));  // `t` is gone

  const auto answer = [this, item, summary, logprobs](absl::Status status) {
    WorkItem& w = *item;
    const absl::Time end = absl::Now();
    switch (w.kind) {
      case WorkItem::Kind::kGenerate:
        metrics_->AddGeneratedTokens(summary.generated_tokens);
        metrics_->ObserveGenerationDuration(Seconds(w.arrival, end));
        w.observer->OnFinish(status, summary);
        break;
      case WorkItem::Kind::kScore:
        if (!status.ok()) {
          w.on_score(status);
        } else if (summary.reason == FinishReason::kShutdown) {
          w.on_score(absl::UnavailableError("the server is shutting down"));
        } else {
          w.on_score(ScoreResult{std::move(w.tokens), logprobs});
        }
        break;
      case WorkItem::Kind::kCreate:
        if (status.ok()) {
          w.on_session(registry_->Get(w.session_id));
        } else {
          w.on_session(status);
        }
        break;
      default:
        break;
    }
  };

  if (id.empty() || item->kind == WorkItem::Kind::kScore) {
    // A throwaway stream or a Score: nothing of a session changes.
    if (id.empty() && slot >= 0) FreeSlot(slot);
    item->lease.Release();
    return answer(absl::OkStatus());
  }
  ResidentSession& r = resident_[id];
  r.in_use = false;
  r.tokens = tokens;
  if (rollback) {
    item->lease.Release();
    if (item->ticket != nullptr && item->ticket->lost.load()) {
      return answer(WriteFailure(id, absl::AbortedError("lease lost"), ""));
    }
    return answer(absl::OkStatus());
  }
  r.last_used = now;
  if (item->kind == WorkItem::Kind::kGenerate) r.last_output = std::move(output);
  item->session_id = id;
  // Write-through: the caller hears of the change only once the store holds it.
  WriteThrough(id, slot, tokens, r.created, now, item->ticket,
               [this, item, id, tokens, now, answer](absl::Status written) mutable {
                 if (written.ok()) {
                   item->lease.Commit(tokens, now, policy_.durable);
                   return answer(absl::OkStatus());
                 }
                 if (item->kind == WorkItem::Kind::kCreate) {
                   RemoveSession(id);
                   registry_->Erase(id);
                   item->lease.Forget();
                   return answer(directory_->ClientError(StoreCall::kCreate, id, written,
                                                         "the new session could not be saved"));
                 }
                 // dir: the session keeps what was streamed, in memory, and the write is
                 // retried. Shared store: the session keeps its last committed state.
                 EndLeaseAfterWrite(item->lease, id, tokens, now, written);
                 answer(WriteFailure(id, written,
                                     "the generated tokens are kept in memory but could not "
                                     "be saved yet (the server retries)"));
               });
}

void Engine::FailTask(Task& t, absl::Status status) {
  // Tokens already streamed stay committed (the state holds exactly what the client
  // got); a request that streamed nothing is undone. A chunk whose write is still in
  // flight counts as not delivered.
  DropUnconfirmed(t);
  const bool keep_streamed = t.stream.confirmed() > 0;
  if (t.has_snapshot && !keep_streamed) RestoreSnapshot(t);
  const std::string id = t.session_id;
  const int slot = t.slot;
  const int64_t tokens = t.tokens;
  LastOutput output = t.stream.output();         // the streamed chunks' text
  std::unique_ptr<WorkItem> item = TakeTask(t);  // `t` is gone
  if (item->kind == WorkItem::Kind::kCreate) {
    if (!id.empty()) {
      RemoveSession(id);
      registry_->Erase(id);
      item->lease.Forget();
    } else if (slot >= 0) {
      FreeSlot(slot);
    }
    return FailItem(std::move(item), status);
  }
  if (id.empty()) {
    if (slot >= 0) FreeSlot(slot);
    return FailItem(std::move(item), status);
  }
  auto it = resident_.find(id);
  if (it != resident_.end()) it->second.in_use = false;
  if (!keep_streamed || it == resident_.end()) return FailItem(std::move(item), status);
  const absl::Time now = clock_->Now();
  it->second.tokens = tokens;
  it->second.last_used = now;
  it->second.last_output = std::move(output);
  std::shared_ptr<WorkItem> shared(std::move(item));
  WriteThrough(id, it->second.slot, tokens, it->second.created, now, shared->ticket,
               [this, shared, id, tokens, now, status](absl::Status written) {
                 EndLeaseAfterWrite(shared->lease, id, tokens, now, written);
                 AnswerFailure(*shared, written.ok() || policy_.keeps_unstored
                                            ? status
                                            : WriteFailure(id, written, ""));
               });
}

void Engine::RestoreSnapshot(Task& t) {
  pool_.SetRow(t.slot, t.snapshot, t.snapshot_logits);
  t.tokens = t.tokens_before;
}

}  // namespace fwserve
