#include "server/core/engine.h"

#include <pthread.h>

#include <algorithm>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "models/file_util.h"
#include "models/state_codec.h"
#include "server/core/log.h"

namespace fwserve {

bool StateMemoryBudget::TryReserve(int64_t bytes) {
  int64_t used = used_.load();
  do {
    if (used + bytes > limit_) return false;
  } while (!used_.compare_exchange_weak(used, used + bytes));
  return true;
}

void StateMemoryBudget::Release(int64_t bytes) { used_.fetch_sub(bytes); }

void StateMemoryBudget::RequestReclaim(int64_t bytes) {
  int64_t wanted = reclaim_.load();
  while (wanted < bytes && !reclaim_.compare_exchange_weak(wanted, bytes)) {
  }
}

void StateMemoryBudget::Reclaimed(int64_t bytes) {
  int64_t wanted = reclaim_.load();
  while (wanted > 0 &&
         !reclaim_.compare_exchange_weak(wanted, std::max<int64_t>(0, wanted - bytes))) {
  }
}

// A Generate, Score or CreateSession being served. Engine thread only.
struct Engine::Task {
  enum class Phase { kPrefill, kReadyToSample, kAwaitingWrite, kReadyToAbsorb };

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
  std::string generated_bytes;
  fwmodel::Utf8StreamDecoder decoder;
  int64_t generated = 0;  // tokens streamed and absorbed
  bool stop_hit = false;
  bool cancelled = false;
  bool shutdown = false;
  // Its rows are on the prefill thread: it must not finish until the job returns.
  bool in_prefill_job = false;
  absl::Time first_token_at = absl::InfinitePast();
  absl::Time last_emit_at;
};

namespace {

constexpr absl::Duration kHousekeepingInterval = absl::Seconds(1);
constexpr char kSpillSuffix[] = ".fwstate";

// Generate, Score and CreateSession become tasks that count against
// --max-active-streams; the other session operations run at admission.
bool IsStreamKind(WorkItem::Kind kind) {
  return kind == WorkItem::Kind::kGenerate || kind == WorkItem::Kind::kScore ||
         kind == WorkItem::Kind::kCreate;
}

double Seconds(absl::Time from, absl::Time to) { return absl::ToDoubleSeconds(to - from); }

}  // namespace

Engine::Engine(std::string name, fwmodel::LoadedModel loaded, const CoreOptions& options,
               SessionStore* store, StateMemoryBudget* budget, ModelMetrics* metrics)
    : name_(std::move(name)),
      model_(std::move(loaded.model)),
      fingerprint_(std::move(loaded.fingerprint)),
      options_(options),
      store_(store),
      budget_(budget),
      metrics_(metrics),
      state_bytes_(model_.state_bytes_per_session()),
      vocab_(model_.config().vocab_size),
      max_slots_(std::max<int64_t>(1, options.max_state_memory_bytes /
                                          std::max<int64_t>(1, model_.state_bytes_per_session()))) {
  torch::NoGradGuard no_grad;
  fresh_row_ = model_.InitialState(1);
  pool_ = model_.InitialState(0);
  next_logits_ = torch::zeros({0, vocab_}, torch::kFloat32);
}

Engine::~Engine() { StopAndPersist(); }

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
  torch::Tensor last_logits;  // float32 CPU [B, vocab]
  std::vector<double> logprobs;
  absl::Duration elapsed;
};

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
        auto logits = model_.Forward(job->tokens, &job->state);
        if (logits.ok()) {
          job->last_logits = logits->select(1, static_cast<int64_t>(job->length) - 1)
                                 .to(torch::kCPU, torch::kFloat32)
                                 .contiguous();
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

absl::Status Engine::Submit(std::unique_ptr<WorkItem>& item) {
  absl::MutexLock lock(&mu_);
  if (draining_) return absl::UnavailableError("the server is shutting down");
  if (static_cast<int64_t>(queue_.size()) >= options_.max_queued_requests) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the queue of model '", name_,
        "' is full (--max-queued-requests=", options_.max_queued_requests, "); retry later"));
  }
  queue_.push_back(std::move(item));
  wake_.Signal();
  return absl::OkStatus();
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

bool Engine::WaitIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queue_.empty() && active_tasks_ == 0;
  };
  while (!idle()) {
    if (idle_changed_.WaitWithDeadline(&mu_, deadline) && absl::Now() >= deadline) return idle();
  }
  return true;
}

void Engine::EndAllWork() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
  end_all_ = true;
  wake_.Signal();
}

void Engine::StopAndPersist() {
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
  if (!events_.empty() || prefill_done_) return true;
  if (end_all_ && !end_all_applied_) return true;
  if (stop_ && active_tasks_ == 0) return true;
  if (immediate_work_) return true;
  for (const auto& item : queue_) {
    if (!IsStreamKind(item->kind) || active_tasks_ < options_.max_active_streams) return true;
  }
  return false;
}

void Engine::Loop() {
  torch::NoGradGuard no_grad;
  while (true) {
    std::vector<Event> events;
    std::vector<std::unique_ptr<WorkItem>> admitted;
    bool end_all = false;
    bool stop = false;
    bool prefill_done = false;
    const absl::Time wait_until = std::min(batch_deadline_, next_housekeeping_);
    {
      absl::MutexLock lock(&mu_);
      while (!HasImmediateWorkLocked() && absl::Now() < wait_until) {
        wake_.WaitWithDeadline(&mu_, wait_until);
      }
      events.swap(events_);
      int64_t active = static_cast<int64_t>(tasks_.size());
      for (auto it = queue_.begin(); it != queue_.end();) {
        const bool stream = IsStreamKind((*it)->kind);
        if (end_all_ || !stream || active < options_.max_active_streams) {
          if (stream) ++active;
          admitted.push_back(std::move(*it));
          it = queue_.erase(it);
        } else {
          ++it;
        }
      }
      active_tasks_ = active;  // WaitIdle must not see admitted work as idle
      end_all = end_all_;
      if (end_all_) end_all_applied_ = true;
      stop = stop_;
      prefill_done = prefill_done_;
      prefill_done_ = false;
    }

    // Tensor code outside Model::Forward/Step (gather, scatter, copies) can still throw
    // c10::Error (e.g. out of memory); it must not take the process down. The requests in
    // flight fail with INTERNAL; sessions keep their last committed state.
    try {
      if (prefill_done) CompletePrefill();
      for (const Event& event : events) ApplyEvent(event);
      for (auto& item : admitted) {
        if (end_all) {
          // Accepted before the shutdown began but never started: refuse cleanly.
          Task refused;
          refused.item = std::move(item);
          refused.session_id = refused.item->session_id;
          FailTask(refused, absl::UnavailableError("the server is shutting down"));
          continue;
        }
        Admit(std::move(item));
      }
      if (end_all) {
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
          if (task->phase != Task::Phase::kAwaitingWrite &&
              task->phase != Task::Phase::kReadyToAbsorb && !task->in_prefill_job) {
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

      StartPrefill();
      RunDecodeStep();
      SampleAndEmit();
    } catch (const std::exception& e) {
      Log(LogLevel::kError, absl::StrCat("model ", name_, ": engine iteration failed: ", e.what()));
      AbandonPrefillJob();
      while (!tasks_.empty()) FailTask(*tasks_.front(), absl::InternalError("the engine failed"));
    }

    const absl::Time now = absl::Now();
    if (now >= next_housekeeping_) {
      Housekeeping();
      next_housekeeping_ = now + kHousekeepingInterval;
    }

    bool awaiting = false;
    bool ready_to_absorb = false;
    bool immediate = false;
    for (const auto& task : tasks_) {
      switch (task->phase) {
        case Task::Phase::kAwaitingWrite:
          awaiting = true;
          break;
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
    // Absorb at once if nothing else can join the batch; else wait (at most until
    // batch_deadline_) for the streams still writing.
    if (ready_to_absorb && !awaiting) immediate = true;
    if (!ready_to_absorb) batch_deadline_ = absl::InfiniteFuture();
    {
      absl::MutexLock lock(&mu_);
      active_tasks_ = static_cast<int64_t>(tasks_.size());
      immediate_work_ = immediate;
      idle_changed_.SignalAll();
      if (stop && tasks_.empty() && queue_.empty()) break;
    }
  }

  {
    absl::MutexLock lock(&prefill_mu_);
    prefill_stop_ = true;
    prefill_cv_.Signal();
  }
  prefill_thread_.join();

  // Persist every resident session; nothing else runs now.
  if (!options_.session_dir.empty()) {
    std::vector<std::string> ids;
    for (const auto& [id, resident] : resident_) ids.push_back(id);
    int64_t persisted = 0;
    for (const std::string& id : ids) {
      if (Spill(id).ok()) ++persisted;
    }
    Log(LogLevel::kInfo, absl::StrCat("model ", name_, ": persisted ", persisted,
                                      " resident sessions to the session directory"));
  }
}

void Engine::ApplyEvent(const Event& event) {
  auto it = tasks_by_stream_.find(event.stream_id);
  if (it == tasks_by_stream_.end()) return;  // already finished
  Task& task = *it->second;
  switch (event.kind) {
    case Event::kWriteOk:
      if (task.phase == Task::Phase::kAwaitingWrite) task.phase = Task::Phase::kReadyToAbsorb;
      break;
    case Event::kWriteFailed:
      // The client never got the pending token: it is not absorbed.
      task.cancelled = true;
      if (task.phase == Task::Phase::kAwaitingWrite) {
        task.pending_token = -1;
        FinishTask(task, task.shutdown ? FinishReason::kShutdown : FinishReason::kCancelled);
      }
      break;
    case Event::kCancel:
      task.cancelled = true;
      if ((task.phase == Task::Phase::kPrefill && !task.in_prefill_job) ||
          task.phase == Task::Phase::kReadyToSample) {
        FinishTask(task, FinishReason::kCancelled);
      }
      // Awaiting a write: ends when the write returns. Ready to absorb: the token was
      // delivered, so it is absorbed first (RunDecodeStep), then the task ends.
      break;
  }
}

// ---------------------------------------------------------------------------------
// Admission and session operations.

void Engine::Admit(std::unique_ptr<WorkItem> item) {
  // A tensor exception (e.g. out of memory) while admitting fails this item alone, with
  // its lease released and its caller answered; nothing is dropped silently.
  auto task = std::make_unique<Task>();
  Task* raw = task.get();
  task->item = std::move(item);
  task->session_id = task->item->session_id;
  try {
    switch (task->item->kind) {
      case WorkItem::Kind::kGenerate:
      case WorkItem::Kind::kScore:
      case WorkItem::Kind::kCreate:
        AdmitStream(std::move(task));
        return;
      default:
        RunSessionOperation(*task->item);
    }
  } catch (const std::exception& e) {
    Log(LogLevel::kError, absl::StrCat("model ", name_, ": admission failed: ", e.what()));
    // `raw` is either still owned by `task` or already in tasks_ (FailTask removes it).
    FailTask(*raw, absl::InternalError("the engine failed"));
  }
}

void Engine::AdmitStream(std::unique_ptr<Task> task) {
  Task& t = *task;
  WorkItem& w = *t.item;
  t.session_id = w.session_id;
  const absl::Time now = absl::Now();

  if (w.kind == WorkItem::Kind::kCreate) {
    t.session_id = SessionStore::NewSessionId();
    auto slot = AllocateSlot();
    if (!slot.ok()) return FailTask(t, slot.status());
    t.slot = *slot;
    ResetSlot(t.slot);
    SessionRecord record{t.session_id, name_, 0, state_bytes_, now, now, /*busy=*/true, true};
    if (absl::Status inserted = store_->Insert(record); !inserted.ok()) {
      FreeSlot(t.slot);
      t.slot = -1;
      t.session_id.clear();
      return FailTask(t, inserted);
    }
    resident_[t.session_id] = ResidentSession{t.slot, 0, now, now, /*in_use=*/true};
    if (metrics_ != nullptr) metrics_->CountSessionOperation("created");
  } else if (!t.session_id.empty()) {
    auto slot = EnsureResident(t.session_id);
    if (!slot.ok()) return FailTask(t, slot.status());
    ResidentSession& r = resident_[t.session_id];
    r.in_use = true;
    t.slot = *slot;
    t.tokens_before = t.tokens = r.tokens;
  } else if (w.kind == WorkItem::Kind::kGenerate) {
    auto slot = AllocateSlot();
    if (!slot.ok()) return FailTask(t, slot.status());
    t.slot = *slot;
    ResetSlot(t.slot);
  }

  if (w.kind == WorkItem::Kind::kScore) {
    // A private copy: the session (if any) is not changed.
    if (t.slot >= 0) {
      torch::Tensor rows = SlotIndex(t.slot);
      t.score_context.state = pool_.Gather(rows);
      if (t.tokens > 0) t.score_context.next_logits = next_logits_[t.slot].clone();
      resident_[t.session_id].in_use = false;
      t.slot = -1;
    } else {
      t.score_context.state = fresh_row_.Clone();
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
      torch::Tensor rows = SlotIndex(t.slot);
      t.snapshot = pool_.Gather(rows);
      t.snapshot_logits = next_logits_[t.slot].clone();
      t.has_snapshot = true;
    }
    const GenerateParams& g = w.generate;
    t.rng.seed(g.sampling.seed);
    t.recent.assign(w.tokens.end() - std::min<size_t>(w.tokens.size(), g.repetition_window),
                    w.tokens.end());
    if (metrics_ != nullptr) metrics_->AddPromptTokensSaved(t.tokens_before);
  }
  t.phase = w.tokens.empty() ? Task::Phase::kReadyToSample : Task::Phase::kPrefill;
  if (w.kind == WorkItem::Kind::kGenerate) tasks_by_stream_[w.stream_id] = &t;
  tasks_.push_back(std::move(task));
  if (t.phase == Task::Phase::kReadyToSample && w.generate.max_tokens == 0) {
    FinishTask(t, FinishReason::kLength);
  }
}

void Engine::RunSessionOperation(WorkItem& w) {
  const absl::Time now = absl::Now();
  const std::string& id = w.session_id;
  switch (w.kind) {
    case WorkItem::Kind::kFork: {
      auto source = EnsureResident(id);
      if (!source.ok()) {
        store_->ReleaseUnchanged(id);
        return w.on_session(source.status());
      }
      if (absl::Status room = store_->CheckCapacity(); !room.ok()) {
        store_->ReleaseUnchanged(id);
        return w.on_session(room);
      }
      resident_[id].in_use = true;  // keep the source out of eviction
      auto slot = AllocateSlot();
      resident_[id].in_use = false;
      if (!slot.ok()) {
        store_->ReleaseUnchanged(id);
        return w.on_session(slot.status());
      }
      const ResidentSession& src = resident_[id];
      torch::Tensor from = SlotIndex(src.slot);
      torch::Tensor to = SlotIndex(*slot);
      pool_.Scatter(to, pool_.Gather(from));
      next_logits_[*slot].copy_(next_logits_[src.slot]);
      SessionRecord record{
          SessionStore::NewSessionId(), name_, src.tokens, state_bytes_, now, now, false, true};
      if (absl::Status inserted = store_->Insert(record); !inserted.ok()) {
        FreeSlot(*slot);
        store_->ReleaseUnchanged(id);
        return w.on_session(inserted);
      }
      const int64_t source_tokens = src.tokens;  // `src` dangles once resident_ grows
      resident_[record.id] = ResidentSession{*slot, source_tokens, now, now, false};
      resident_[id].last_used = now;  // a use: restarts the idle clock
      store_->Release(id, source_tokens, now);
      if (metrics_ != nullptr) metrics_->CountSessionOperation("forked");
      return w.on_session(record);
    }
    case WorkItem::Kind::kExport: {
      auto slot = EnsureResident(id);
      if (!slot.ok()) {
        store_->ReleaseUnchanged(id);
        return w.on_export(slot.status());
      }
      ResidentSession& r = resident_[id];
      const int64_t tokens = r.tokens;
      auto blob = EncodeSlot(*slot, tokens, {{"x-model", name_}});
      r.last_used = now;  // a use: restarts the idle clock
      store_->Release(id, tokens, now);
      if (!blob.ok()) return w.on_export(blob.status());
      if (metrics_ != nullptr) metrics_->CountSessionOperation("exported");
      return w.on_export(ExportResult{std::move(*blob), name_, tokens});
    }
    case WorkItem::Kind::kImport: {
      auto decoded = fwmodel::DecodeStateRow(model_, fingerprint_, std::move(w.blob));
      if (!decoded.ok()) {
        // A blob for another model is a bad argument to this call, like a corrupt one.
        return w.on_session(
            absl::InvalidArgumentError(absl::StrCat("blob: ", decoded.status().message())));
      }
      if (absl::Status room = store_->CheckCapacity(); !room.ok()) return w.on_session(room);
      auto slot = AllocateSlot();
      if (!slot.ok()) return w.on_session(slot.status());
      torch::Tensor to = SlotIndex(*slot);
      pool_.Scatter(to, decoded->state);
      if (decoded->tokens > 0) next_logits_[*slot].copy_(decoded->next_logits);
      SessionRecord record{SessionStore::NewSessionId(),
                           name_,
                           decoded->tokens,
                           state_bytes_,
                           now,
                           now,
                           false,
                           true};
      if (absl::Status inserted = store_->Insert(record); !inserted.ok()) {
        FreeSlot(*slot);
        return w.on_session(inserted);
      }
      resident_[record.id] = ResidentSession{*slot, decoded->tokens, now, now, false};
      if (metrics_ != nullptr) metrics_->CountSessionOperation("imported");
      return w.on_session(record);
    }
    case WorkItem::Kind::kDelete: {
      RemoveSession(id);
      store_->Erase(id);
      if (metrics_ != nullptr) metrics_->CountSessionOperation("deleted");
      return w.on_delete(true);
    }
    default:
      return;
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
    next_logits_.index_copy_(0, job->rows.cpu(), job->last_logits);
    for (Task* t : job->tasks) t->tokens += static_cast<int64_t>(job->length);
  }
  if (metrics_ != nullptr) {
    metrics_->ObservePrefillChunk(tokens, absl::ToDoubleSeconds(job->elapsed));
    if (score) {
      metrics_->AddScoredTokens(tokens);
    } else {
      metrics_->AddPromptTokens(tokens);
    }
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
    if (task->phase == Task::Phase::kReadyToAbsorb) batch.push_back(task.get());
  }
  if (batch.empty()) return;
  // Give streams whose write is still in flight `batch_wait` to join this step.
  bool awaiting = false;
  for (auto& task : tasks_) awaiting |= task->phase == Task::Phase::kAwaitingWrite;
  if (awaiting) {
    const absl::Time now = absl::Now();
    if (batch_deadline_ == absl::InfiniteFuture()) {
      batch_deadline_ = now + options_.batch_wait;
      return;
    }
    if (now < batch_deadline_) return;
  }
  batch_deadline_ = absl::InfiniteFuture();
  const absl::Time start = absl::Now();
  std::vector<int64_t> rows_vec, tokens_vec;
  for (Task* t : batch) {
    rows_vec.push_back(t->slot);
    tokens_vec.push_back(t->pending_token);
  }
  const torch::Device device = model_.options().device;
  torch::Tensor rows = torch::tensor(rows_vec, torch::kInt64).to(device);
  fwmodel::State state = pool_.Gather(rows);
  auto logits = model_.Step(torch::tensor(tokens_vec, torch::kInt64).to(device), &state);
  if (!logits.ok()) {
    Log(LogLevel::kError,
        absl::StrCat("model ", name_, ": decode step failed: ", logits.status().message()));
    for (Task* t : batch) FailTask(*t, absl::InternalError("decode step failed"));
    return;
  }
  pool_.Scatter(rows, state);
  next_logits_.index_copy_(0, rows.cpu(), logits->to(torch::kCPU, torch::kFloat32));
  if (metrics_ != nullptr) {
    metrics_->ObserveDecodeStep(static_cast<int64_t>(batch.size()), Seconds(start, absl::Now()));
  }
  for (Task* t : batch) {
    ++t->tokens;
    ++t->generated;
    t->recent.push_back(t->pending_token);
    const size_t window = static_cast<size_t>(t->item->generate.repetition_window);
    if (t->recent.size() > window) t->recent.erase(t->recent.begin());
    t->pending_token = -1;
    if (t->stop_hit) {
      FinishTask(*t, FinishReason::kStop);
    } else if (t->generated >= t->item->generate.max_tokens) {
      FinishTask(*t, FinishReason::kLength);
    } else if (t->cancelled) {
      FinishTask(*t, t->shutdown ? FinishReason::kShutdown : FinishReason::kCancelled);
    } else {
      t->phase = Task::Phase::kReadyToSample;
    }
  }
}

void Engine::SampleAndEmit() {
  std::vector<Task*> ready;
  for (auto& task : tasks_) {
    if (task->phase == Task::Phase::kReadyToSample) ready.push_back(task.get());
  }
  for (Task* t : ready) {
    const GenerateParams& g = t->item->generate;
    const float* logits = next_logits_[t->slot].data_ptr<float>();
    const int64_t token = SampleToken(logits, vocab_, g.sampling, t->rng, t->recent);
    GenerateChunk chunk;
    chunk.token_ids.push_back(token);
    if (g.logprobs)
      chunk.logprobs.push_back(static_cast<float>(TokenLogProb(logits, vocab_, token)));
    chunk.text = t->decoder.Push(token);
    if (token < 256) t->generated_bytes.push_back(static_cast<char>(token));
    for (const std::string& stop : g.stop) {
      if (t->generated_bytes.size() >= stop.size() &&
          t->generated_bytes.compare(t->generated_bytes.size() - stop.size(), stop.size(), stop) ==
              0) {
        t->stop_hit = true;
      }
    }
    t->pending_token = token;
    t->phase = Task::Phase::kAwaitingWrite;
    const absl::Time now = absl::Now();
    if (metrics_ != nullptr) {
      if (t->first_token_at == absl::InfinitePast()) {
        metrics_->ObserveTimeToFirstToken(Seconds(t->item->arrival, now));
      } else {
        metrics_->ObserveInterTokenLatency(Seconds(t->last_emit_at, now));
      }
    }
    if (t->first_token_at == absl::InfinitePast()) t->first_token_at = now;
    t->last_emit_at = now;
    t->item->observer->OnChunk(std::move(chunk));
  }
}

void Engine::FinishTask(Task& t, FinishReason reason) {
  WorkItem& w = *t.item;
  if (w.kind == WorkItem::Kind::kCreate && w.is_cancelled && w.is_cancelled()) {
    // Nobody will learn the new id: remove the session rather than leave an orphan.
    return FailTask(t, absl::CancelledError("cancelled by the client"));
  }
  const absl::Time now = absl::Now();
  const bool rollback = t.has_snapshot && t.generated == 0 &&
                        (reason == FinishReason::kCancelled || reason == FinishReason::kShutdown);
  if (rollback) RestoreSnapshot(t);
  if (!t.session_id.empty()) {
    auto it = resident_.find(t.session_id);
    if (it != resident_.end()) {
      it->second.in_use = false;
      it->second.tokens = t.tokens;
      if (!rollback) it->second.last_used = now;
    }
    if (rollback) {
      store_->ReleaseUnchanged(t.session_id);
    } else {
      store_->Release(t.session_id, t.tokens, now);
    }
  } else if (t.slot >= 0) {
    FreeSlot(t.slot);
  }

  switch (w.kind) {
    case WorkItem::Kind::kGenerate: {
      GenerateSummary summary;
      summary.reason = reason;
      summary.trailing_text = t.decoder.Finish();
      summary.prompt_tokens = rollback ? 0 : static_cast<int64_t>(t.prefilled);
      summary.generated_tokens = t.generated;
      summary.session_tokens = t.tokens;
      if (metrics_ != nullptr) {
        metrics_->AddGeneratedTokens(t.generated);
        metrics_->ObserveGenerationDuration(Seconds(w.arrival, now));
      }
      tasks_by_stream_.erase(w.stream_id);
      w.observer->OnFinish(absl::OkStatus(), std::move(summary));
      break;
    }
    case WorkItem::Kind::kScore:
      if (reason == FinishReason::kShutdown) {
        w.on_score(absl::UnavailableError("the server is shutting down"));
      } else {
        w.on_score(ScoreResult{std::move(w.tokens), std::move(t.score_logprobs)});
      }
      break;
    case WorkItem::Kind::kCreate: {
      auto record = store_->Get(t.session_id);
      w.on_session(record);
      break;
    }
    default:
      break;
  }
  tasks_.remove_if([&t](const std::unique_ptr<Task>& p) { return p.get() == &t; });
}

void Engine::FailTask(Task& t, absl::Status status) {
  WorkItem& w = *t.item;
  const bool owned_session = !t.session_id.empty() && w.kind != WorkItem::Kind::kCreate;
  // Tokens already streamed stay committed (the state holds exactly what the client
  // got); a request that streamed nothing is undone.
  const bool keep_streamed = t.generated > 0;
  if (t.has_snapshot && !keep_streamed) RestoreSnapshot(t);
  if (owned_session) {
    auto it = resident_.find(t.session_id);
    if (it != resident_.end()) {
      it->second.in_use = false;
      if (keep_streamed) it->second.tokens = t.tokens;
    }
    if (keep_streamed) {
      store_->Release(t.session_id, t.tokens, absl::Now());
    } else {
      store_->ReleaseUnchanged(t.session_id);
    }
  } else if (w.kind == WorkItem::Kind::kCreate && !t.session_id.empty()) {
    RemoveSession(t.session_id);
    store_->Erase(t.session_id);
  } else if (t.slot >= 0) {
    FreeSlot(t.slot);
  }
  switch (w.kind) {
    case WorkItem::Kind::kGenerate:
      tasks_by_stream_.erase(w.stream_id);
      w.observer->OnFinish(status, GenerateSummary{});
      break;
    case WorkItem::Kind::kScore:
      w.on_score(status);
      break;
    case WorkItem::Kind::kCreate:
    case WorkItem::Kind::kFork:
    case WorkItem::Kind::kImport:
      w.on_session(status);
      break;
    case WorkItem::Kind::kExport:
      w.on_export(status);
      break;
    case WorkItem::Kind::kDelete:
      w.on_delete(status);
      break;
  }
  tasks_.remove_if([&t](const std::unique_ptr<Task>& p) { return p.get() == &t; });
}

// ---------------------------------------------------------------------------------
// Slots, spill and restore.

torch::Tensor Engine::SlotIndex(int64_t slot) const {
  return torch::tensor({slot}, torch::kInt64).to(model_.options().device);
}

void Engine::RestoreSnapshot(Task& t) {
  pool_.Scatter(SlotIndex(t.slot), t.snapshot);
  next_logits_[t.slot].copy_(t.snapshot_logits);
  t.tokens = t.tokens_before;
}

void Engine::ResetSlot(int slot) {
  torch::Tensor rows = SlotIndex(slot);
  pool_.Scatter(rows, fresh_row_);
  next_logits_[slot].zero_();
}

bool Engine::Grow() {
  if (capacity_ >= max_slots_) return false;
  const int64_t grown = std::min<int64_t>(max_slots_, std::max<int64_t>(16, capacity_ * 2));
  fwmodel::State extra = model_.InitialState(grown - capacity_);
  for (size_t i = 0; i < pool_.tensors.size(); ++i) {
    pool_.tensors[i] = torch::cat({pool_.tensors[i], extra.tensors[i]}, 0);
  }
  next_logits_ = torch::cat({next_logits_, torch::zeros({grown - capacity_, vocab_})}, 0);
  for (int64_t s = grown - 1; s >= capacity_; --s) free_slots_.push_back(static_cast<int>(s));
  capacity_ = grown;
  return true;
}

absl::StatusOr<int> Engine::AllocateSlot() {
  const auto exhausted = [this] {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no room for another session state of model '", name_, "' within --max-state-memory-bytes=",
        options_.max_state_memory_bytes, " (every resident session is in use)"));
  };
  while (free_slots_.empty() && !Grow()) {
    if (!SpillOrEvictOne()) return exhausted();
  }
  while (!budget_->TryReserve(state_bytes_)) {
    if (!SpillOrEvictOne()) {
      // The budget is held by other models' sessions: ask them to give up idle ones.
      budget_->RequestReclaim(state_bytes_);
      return absl::ResourceExhaustedError(
          absl::StrCat("no room for another session state of model '", name_,
                       "' within --max-state-memory-bytes=", options_.max_state_memory_bytes,
                       "; idle sessions of other models are being released, retry shortly"));
    }
  }
  const int slot = free_slots_.back();
  free_slots_.pop_back();
  ++slots_in_use_;
  return slot;
}

void Engine::FreeSlot(int slot) {
  free_slots_.push_back(slot);
  --slots_in_use_;
  budget_->Release(state_bytes_);
}

bool Engine::SpillOrEvictOne() {
  // The least recently used resident session that no request holds.
  std::string victim;
  absl::Time oldest = absl::InfiniteFuture();
  for (const auto& [id, r] : resident_) {
    if (r.in_use || r.last_used >= oldest) continue;
    auto record = store_->Get(id);
    if (!record.ok() || record->busy) continue;
    victim = id;
    oldest = r.last_used;
  }
  if (victim.empty()) return false;
  if (!options_.session_dir.empty()) {
    if (absl::Status spilled = Spill(victim); spilled.ok()) return true;
    Log(LogLevel::kWarning, absl::StrCat("model ", name_, ": could not spill a session; evicting"));
  }
  if (!store_->EraseIfIdle(victim)) return true;  // leased meanwhile: try again
  RemoveSession(victim);
  if (metrics_ != nullptr) metrics_->CountSessionRemoval("evicted");
  Log(LogLevel::kInfo, absl::StrCat("model ", name_, ": evicted session ", victim,
                                    " (state memory budget; no --session-dir)"));
  return true;
}

std::string Engine::SpillPath(const std::string& id) const {
  return (std::filesystem::path(options_.session_dir) / (id + kSpillSuffix)).string();
}

absl::StatusOr<std::string> Engine::EncodeSlot(int slot, int64_t tokens,
                                               const std::map<std::string, std::string>& labels) {
  return fwmodel::EncodeStateRow(model_, fingerprint_, pool_, slot, tokens,
                                 tokens > 0 ? next_logits_[slot] : torch::Tensor(), labels);
}

absl::Status Engine::Spill(const std::string& id) {
  auto it = resident_.find(id);
  if (it == resident_.end()) return absl::OkStatus();
  const ResidentSession& r = it->second;
  auto blob = EncodeSlot(r.slot, r.tokens,
                         {{"x-session-id", id},
                          {"x-model", name_},
                          {"x-created-ms", absl::StrCat(absl::ToUnixMillis(r.created))},
                          {"x-last-used-ms", absl::StrCat(absl::ToUnixMillis(r.last_used))}});
  if (!blob.ok()) return blob.status();
  if (absl::Status written = fwmodel::WriteFileAtomic(SpillPath(id), *blob); !written.ok()) {
    Log(LogLevel::kError, absl::StrCat("spill of session ", id, " failed: ", written.message()));
    return written;
  }
  FreeSlot(r.slot);
  resident_.erase(it);
  store_->SetResident(id, false);
  if (metrics_ != nullptr) metrics_->CountSessionOperation("spilled");
  return absl::OkStatus();
}

absl::StatusOr<int> Engine::EnsureResident(const std::string& id) {
  if (auto it = resident_.find(id); it != resident_.end()) return it->second.slot;
  auto record = store_->Get(id);
  if (!record.ok()) return record.status();
  if (options_.session_dir.empty()) {
    return absl::InternalError(absl::StrCat("session_id '", id, "' has no resident state"));
  }
  auto bytes = fwmodel::ReadFile(SpillPath(id));
  absl::StatusOr<fwmodel::DecodedState> decoded =
      bytes.ok() ? fwmodel::DecodeStateRow(model_, fingerprint_, std::move(*bytes))
                 : absl::StatusOr<fwmodel::DecodedState>(bytes.status());
  if (!decoded.ok()) {
    Log(LogLevel::kError,
        absl::StrCat("session ", id, ": spilled state unreadable: ", decoded.status().message()));
    return absl::DataLossError(
        absl::StrCat("session_id '", id, "': its saved state could not be restored"));
  }
  auto slot = AllocateSlot();
  if (!slot.ok()) return slot.status();
  torch::Tensor rows = SlotIndex(*slot);
  pool_.Scatter(rows, decoded->state);
  if (decoded->tokens > 0) {
    next_logits_[*slot].copy_(decoded->next_logits);
  } else {
    next_logits_[*slot].zero_();
  }
  resident_[id] =
      ResidentSession{*slot, decoded->tokens, record->created, record->last_used, false};
  std::error_code ignored;
  std::filesystem::remove(SpillPath(id), ignored);
  store_->SetResident(id, true);
  if (metrics_ != nullptr) metrics_->CountSessionOperation("restored");
  return *slot;
}

void Engine::RemoveSession(const std::string& id) {
  if (auto it = resident_.find(id); it != resident_.end()) {
    FreeSlot(it->second.slot);
    resident_.erase(it);
    return;
  }
  if (!options_.session_dir.empty()) {
    std::error_code ignored;
    std::filesystem::remove(SpillPath(id), ignored);
  }
}

void Engine::Housekeeping() {
  while (budget_->reclaim_wanted() > 0 && SpillOrEvictOne()) budget_->Reclaimed(state_bytes_);
  for (const std::string& id : store_->TakeExpired(name_, absl::Now() - options_.session_ttl)) {
    RemoveSession(id);
    if (metrics_ != nullptr) metrics_->CountSessionRemoval("expired");
  }
  PublishGauges();
}

void Engine::PublishGauges() {
  if (metrics_ == nullptr) return;
  int64_t queued;
  {
    absl::MutexLock lock(&mu_);
    queued = static_cast<int64_t>(queue_.size());
  }
  metrics_->SetQueuedRequests(queued);
  metrics_->SetActiveStreams(static_cast<int64_t>(tasks_.size()));
  metrics_->SetSessions(static_cast<int64_t>(resident_.size()), store_->CountSpilled(name_),
                        slots_in_use_ * state_bytes_);
}

}  // namespace fwserve
