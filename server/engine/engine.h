// One model's engine: a thread that runs continuous batching (admit -> prefill one
// chunk -> one batched step -> sample -> emit). What runs is the Scheduler's plan
// (scheduler.h, plain data); the Runner (runner.h) owns the rows (StatePool), the
// kernels and the prefill thread; session-store work goes to the shared StoreExecutor. Internal to
// the core (includes LibTorch): the transports see server/core/core.h only.
//
// Files: engine.cc holds the loop, admission, prefill, decode and sampling;
// engine_sessions.cc the session operations (create/fork/export/import/delete, reading
// the last output), residency (load, release, evict), write-through and housekeeping.
//
// Durability (docs/sessions.md): a request that changes a session answers its caller
// only after the session store holds the new state; the session's lease is held until
// then. Store I/O runs on store threads; its results come back to the engine thread as
// continuations, so every session-state change happens on the engine thread.
//
// Thread-safety: Submit, PostWriteDone, PostCancel, BeginDrain, WaitIdle, EndAllWork,
// Stop and the accessors are thread-safe. Everything else runs on the engine thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "models/checkpoint.h"
#include "models/model.h"
#include "models/native_step.h"
#include "models/state_codec.h"
#include "models/text_tokenizer.h"
#include "models/tokenizer.h"
#include "server/api/requests.h"
#include "server/base/clock.h"
#include "server/engine/admission_queue.h"
#include "server/engine/drain_estimate.h"
#include "server/engine/engine_options.h"
#include "server/engine/residency.h"
#include "server/engine/runner.h"
#include "server/engine/scheduler.h"
#include "server/engine/state_pool.h"
#include "server/engine/stepper.h"
#include "server/engine/stream_task.h"
#include "server/metrics/metrics.h"
#include "server/sessions/session_directory.h"
#include "server/sessions/session_labels.h"
#include "server/sessions/session_registry.h"
#include "server/sessions/store_executor.h"

namespace fwserve {

// A unit of work for the engine. Items that name an existing session hold its lease
// from submission until the engine answers them (and, for a change, until the store
// holds it).
struct WorkItem {
  // kReadOutput: the session's last output (Core::GetSessionOutput); like kExport it
  // holds the lease while it reads, and changes nothing.
  enum class Kind { kGenerate, kScore, kCreate, kFork, kExport, kImport, kDelete, kReadOutput };
  Kind kind = Kind::kGenerate;
  std::string session_id;
  // kGenerate with GenerateParams::fork_from: the new session's id (chosen by the core);
  // `session_id` (and the lease and ticket) are then the source's until the engine
  // forks it, and the new session's after.
  std::string fork_id;
  // The caller's tenant: owns the sessions this item creates (Caller::tenant).
  std::string tenant;
  SessionLease lease;
  // Shared store only: the lease in the store (null otherwise, and for new sessions).
  std::shared_ptr<StoreTicket> ticket;
  std::vector<int64_t> tokens;  // prompt, scored text or prefix
  GenerateParams generate;
  GenerateObserver* observer = nullptr;  // kGenerate; see server/api/requests.h for its lifetime
  uint64_t stream_id = 0;                // kGenerate
  std::string blob;                      // kImport
  // The prompt, scored text or prefix as the caller sent it: Engine::Submit encodes it
  // into `tokens` with the model's tokenizer (the core may not know the model yet).
  std::string text;
  // The session's state read from the store (or the decoded import blob), when the
  // session was not resident at admission.
  std::optional<fwmodel::DecodedState> loaded;
  Callback<ScoreResult> on_score;
  Callback<SessionRecord> on_session;
  Callback<ExportResult> on_export;
  Callback<SessionOutput> on_output;
  Callback<bool> on_delete;
  // kScore, kCreate: polled between prefill chunks; may be null.
  std::function<bool()> is_cancelled;
  absl::Time arrival;
};

// What an engine shares with the rest of the core. Pointers are not owned and outlive
// the engine.
struct EngineContext {
  // Where the sessions are kept: the registry, the store threads, the store I/O and
  // what to do with a changed session (SessionDirectory::policy()).
  SessionDirectory* directory = nullptr;
  StateMemoryBudget* budget = nullptr;
  const Clock* clock = nullptr;
  // Never null (the null implementation when metrics are off).
  ModelMetrics* metrics = nullptr;
  // The model's tokenizer (config.json's `tokenizer`): bytes unless it names another.
  fwmodel::TextTokenizer tokenizer;
};

// Answers `item` with `status` through whichever callback its kind has (its lease
// released first).
void AnswerWorkItem(WorkItem& item, absl::Status status);

class Engine {
 public:
  Engine(std::string name, fwmodel::LoadedModel loaded, const EngineOptions& options,
         EngineContext context);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void Start();
  const std::string& name() const { return name_; }
  const fwmodel::Model& model() const { return model_; }
  const fwmodel::TextTokenizer& tokenizer() const { return tokenizer_; }
  const std::string& fingerprint() const { return fingerprint_; }
  uint64_t NewStreamId() { return next_stream_id_.fetch_add(1); }

  // Queues `item`. RESOURCE_EXHAUSTED when the queue is full, DEADLINE_EXCEEDED when a
  // Generate could not start before its deadline (GenerateParams::deadline) by the
  // queue's expected wait, UNAVAILABLE when draining; the first two carry a retry delay
  // (server/base/retry_delay.h). On error the item is returned untouched through `item`
  // (callbacks not called).
  absl::Status Submit(std::unique_ptr<WorkItem>& item);
  // The same refusals as Submit's, decided from published counts without the lock,
  // before any per-request work (docs/serving.md "Overload"): the cheap early answer.
  // OK does not promise that Submit accepts. Thread-safe, never blocks.
  absl::Status CheckAdmission(absl::Time deadline) const;
  // How long a stream queued now is expected to wait before it starts. Thread-safe.
  absl::Duration ExpectedQueueWait() const;
  void PostWriteDone(uint64_t stream_id, bool ok);
  void PostCancel(uint64_t stream_id);

  // Shutdown steps (see Core): refuse new work; wait for idle (store writes included);
  // end the rest; stop the threads (a last attempt to store sessions whose writes
  // failed). Stop is idempotent.
  void BeginDrain();
  bool WaitIdle(absl::Time deadline);
  void EndAllWork();
  void Stop();

 private:
  struct Task;
  struct PrefillJob;
  struct Event {
    uint64_t stream_id;
    enum Kind { kWriteOk, kWriteFailed, kCancel } kind;
  };

  // What one loop iteration takes from the other threads.
  struct IterationWork {
    std::vector<Event> events;
    std::vector<std::function<void()>> continuations;
    std::vector<std::unique_ptr<WorkItem>> admitted;
    // Streams shed by CoDel (AdmissionQueue::TakeShed): refused with a retry hint.
    std::vector<std::unique_ptr<WorkItem>> shed;
    bool end_all = false;
    bool stop = false;
    bool prefill_done = false;
  };

  // engine.cc: the loop, admission, prefill, decode, sampling.
  // Each iteration: wait for work; apply store results, the finished prefill chunk
  // and the streams' write/cancel events; admit; start the next prefill chunk; one
  // batched decode step; sample and emit; housekeeping; publish what is ready.
  void Loop();
  IterationWork WaitForWork();
  void AdmitAll(std::vector<std::unique_ptr<WorkItem>>& admitted, bool end_all);
  // Refuses each of `shed` with RESOURCE_EXHAUSTED and the queue's retry hint, counted
  // as fwserve_queue_shed_total.
  void ShedAll(std::vector<std::unique_ptr<WorkItem>>& shed);
  // Shutdown (EndAllWork): every task is cancelled as SHUTDOWN; those not waiting on a
  // write end now.
  void EndAllTasks();
  // Publishes the readiness of the next iteration to WaitIdle and the admission check.
  // False once the loop should end (stopping, nothing left).
  bool PublishReadiness(bool stop);
  bool HasImmediateWorkLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Carries out the scheduler's decisions, in order (an action for a task that an
  // earlier one ended is skipped).
  void Apply(std::vector<Action> actions);
  // The retry hint of a refusal: how long until the streams queued now have started
  // (at least 10 ms, at most 30 s; 1 s while unmeasured). Thread-safe.
  absl::Duration RetryDelay() const;
  // The items the queue may hold now: max_queued_requests, or with max_queue_wait what
  // drains within it at the measured rate (at least 2). Thread-safe.
  int64_t QueueCapacity() const;
  // DEADLINE_EXCEEDED (with a retry delay) when a stream queued now would start after
  // `deadline`; OK for InfiniteFuture. Thread-safe.
  absl::Status DeadlineRefusal(absl::Time deadline) const;
  bool IdleLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyEvent(const Event& event);
  void Admit(std::unique_ptr<WorkItem> item);
  void AdmitStream(Task& task);
  // Hands the next prefill chunk (one task, or several with equal chunk lengths) to the
  // prefill thread, unless one is in flight.
  void StartPrefill();
  // Applies a finished prefill job: scatters the rows back, advances its tasks.
  void CompletePrefill();
  // Blocks until the in-flight prefill job (if any) is done and drops its result.
  void AbandonPrefillJob();
  void PrefillThreadLoop();
  void RunDecodeStep();
  // RunDecodeStep in two halves, for --overlap-steps: the launched step (its tasks stay
  // in the scheduler until FinishDecodeStep, which waits for it and applies it).
  struct InFlightStep {
    Runner::Handle handle = 0;
    std::vector<TaskId> ids;
    std::vector<Task*> batch;
  };
  std::optional<InFlightStep> LaunchDecodeStep();
  void FinishDecodeStep(InFlightStep step);
  // Multi-step decode (--decode-steps-per-launch): the tokens task `t` may draw in one
  // launch, in [1, steps].
  int64_t TokensPerLaunch(const Task& t, int64_t steps) const;
  // The tokens a multi-step launch drew and absorbed for task `id` beyond its first
  // (Stepper::StepAhead): each is sampled and counted absorbed, in order, as single
  // steps would have; they stop where the stream stops (the rest were absorbed by a
  // throwaway state and are dropped with it).
  void TakeTokensAhead(TaskId id, const std::vector<SampledToken>& ahead);
  void SampleAndEmit();
  // Decode pipelining (StreamTask). Deliver: hands `chunk` (the stream's write in
  // flight now) to the transport. DropUnconfirmed: puts the slot back to before the
  // first token whose write was not confirmed and forgets those tokens.
  void Deliver(Task& t, GenerateChunk chunk);
  void DropUnconfirmed(Task& t);
  // End a task: answer its caller (after the store holds a changed session).
  void FinishTask(Task& task, FinishReason reason);
  void FailTask(Task& task, absl::Status status);
  // Removes `task` from tasks_ and the scheduler (destroying it); returns its work item.
  std::unique_ptr<WorkItem> TakeTask(Task& task);
  // Puts back the task's slot (state, next-token logits, token count) as it was before
  // the request.
  void RestoreSnapshot(Task& t);

  // engine_sessions.cc: session operations, residency, the store.
  void RunSessionOperation(std::unique_ptr<WorkItem>& item);
  // Answers `item` with `status` (its lease released first).
  void FailItem(std::unique_ptr<WorkItem> item, absl::Status status);
  void AnswerFailure(WorkItem& item, absl::Status status) {
    AnswerWorkItem(item, std::move(status));
  }
  // Shared store: drops the resident copy of the item's session unless its version is
  // the one the item's lease was taken at (then the item is served from the cache).
  void DropStaleCopy(WorkItem& item);
  // Ends `lease` after the write-through of a changed session: committed when
  // `written` is OK; otherwise kept in memory to retry (dir:), or forgotten (shared
  // store: the local copy was dropped and the store keeps the last committed state).
  void EndLeaseAfterWrite(SessionLease& lease, const std::string& id, int64_t tokens,
                          absl::Time now, const absl::Status& written);
  // The client's error for a failed write-through (details go to the log).
  absl::Status WriteFailure(const std::string& id, const absl::Status& written,
                            const char* what) const;
  // The session's slot; from item.loaded when it is not resident.
  absl::StatusOr<int> EnsureResident(WorkItem& item);
  // Reads the session's state from the store (or decodes an import blob) on a store
  // thread, then admits the item again with item->loaded set.
  void StartLoad(std::unique_ptr<WorkItem> item);
  // Write-through: copies the slot now, encodes and stores it on a store thread, then
  // runs `then(status)` on the engine thread. Without a store, `then(OK)` runs at once.
  // With a shared store, `ticket` fences the write (null: a new session, created at
  // version 1); on success the resident copy takes the new version, on failure it is
  // dropped (the store keeps the last committed state).
  void WriteThrough(const std::string& id, int slot, int64_t tokens, absl::Time created,
                    absl::Time last_used, std::shared_ptr<StoreTicket> ticket,
                    std::function<void(absl::Status)> then);
  // A new session made by fork or import, in `slot`, with the source's last output:
  // registered busy, stored, then answered.
  void CommitNewSession(std::unique_ptr<WorkItem> item, int slot, int64_t tokens,
                        LastOutput last_output, const char* operation);
  // Store thread (or the engine thread at exit): encodes a session's row with its
  // `labels` (their model is this engine's) and puts it in the store, timing a success
  // and logging and counting a failure.
  // Returns the stored version (shared store; 0 otherwise).
  // `new_tag`: the tag a shared store gives a created session (a commit's tag is its
  // ticket's token).
  absl::StatusOr<int64_t> StoreRow(const StoredSessionLabels& labels, const fwmodel::State& row,
                                   const torch::Tensor& logits, int64_t tokens, StoreTicket* ticket,
                                   const std::string& new_tag = "");
  // The last output the labels of `item.loaded` carry (a stored state, or an import's
  // blob). A malformed label fails the item: INVALID_ARGUMENT for an import's blob,
  // DATA_LOSS (logged) for a stored state, as an unreadable state would.
  absl::StatusOr<LastOutput> LoadedLastOutput(const WorkItem& item) const;
  // Store thread: deletes `id` from the store (fenced by `ticket` with a shared
  // store), logging and counting a failure.
  absl::Status DeleteFromStore(const std::string& id, StoreTicket* ticket);
  // Runs `job` on a store thread; the function it returns runs on the engine thread.
  void RunStoreJob(std::function<std::function<void()>()> job);
  absl::StatusOr<int> AllocateSlot();
  void FreeSlot(int slot);
  // Frees the least recently used idle resident session's slot (dropped from memory
  // when the store holds it, else evicted with the memory backend). False if none.
  bool ReleaseOneIdle();
  void RemoveSession(const std::string& id);
  // Session `id` is gone: removed from memory (RemoveSession) and the registry, and its
  // `lease` ended with nothing to release. For a deleted session, and for a new one
  // that keeps nothing or whose first write failed.
  void EraseSession(const std::string& id, SessionLease& lease);
  void Housekeeping();
  void RetryUnstored();
  void StoreUnstoredAtExit();
  void PublishGauges();

  const std::string name_;
  fwmodel::Model model_;
  const std::string fingerprint_;
  const fwmodel::TextTokenizer tokenizer_;
  const EngineOptions options_;
  SessionRegistry* const registry_;
  SessionDirectory* const directory_;
  const SessionPolicy policy_;  // the directory's
  StoreExecutor* const executor_;
  StateMemoryBudget* const budget_;
  const Clock* const clock_;
  ModelMetrics* const metrics_;  // never null
  const int64_t state_bytes_;
  const int64_t vocab_;
  const AdmissionOptions admission_;  // queue_'s; read without the lock by CheckAdmission

  std::atomic<uint64_t> next_stream_id_{1};
  std::thread thread_;

  absl::Mutex mu_;
  absl::CondVar wake_;          // the engine thread waits on it
  absl::CondVar idle_changed_;  // WaitIdle waits on it
  AdmissionQueue<WorkItem> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<Event> events_ ABSL_GUARDED_BY(mu_);
  // Results of store jobs, to run on the engine thread.
  std::vector<std::function<void()>> continuations_ ABSL_GUARDED_BY(mu_);
  // Store jobs started by this engine whose continuation is not queued yet.
  int64_t store_jobs_ ABSL_GUARDED_BY(mu_) = 0;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool end_all_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // end_all_ has been applied to every task (it is an edge, not a level, for waking).
  bool end_all_applied_ ABSL_GUARDED_BY(mu_) = false;
  // The prefill thread finished the in-flight job.
  bool prefill_done_ ABSL_GUARDED_BY(mu_) = false;
  // Published for CheckAdmission and ExpectedQueueWait (written under mu_ by the engine
  // thread, read anywhere): items queued, stream slots free, streams ending per second
  // while saturated (0 = not measured yet).
  std::atomic<int64_t> published_queued_{0};
  std::atomic<int64_t> published_free_slots_{0};
  std::atomic<double> published_drain_rate_{0};
  // Mirrors of engine-thread counts, for WaitIdle and the admission check.
  int64_t active_tasks_ ABSL_GUARDED_BY(mu_) = 0;
  bool immediate_work_ ABSL_GUARDED_BY(mu_) = false;

  // Engine-thread state.
  DrainEstimate drain_;
  // The rows, the decode step and sampling, the prefill thread.
  Runner runner_;
  StatePool& pool_;      // runner_'s
  bool ending_ = false;  // EndAllWork was applied: admit nothing more
  ResidentSessions resident_;
  // Which streams run, as plain data (phases, streams, parking, the prefill turn, the
  // batch deadline).
  Scheduler scheduler_;
  // The tasks' runner side, by the scheduler's ids; the stream ids' tasks.
  absl::flat_hash_map<TaskId, std::unique_ptr<Task>> tasks_;
  absl::flat_hash_map<uint64_t, TaskId> tasks_by_stream_;
  TaskId next_task_id_ = 1;
  std::unique_ptr<PrefillJob> prefill_job_;  // in flight on the prefill thread, or null
  absl::Time next_housekeeping_ = absl::InfinitePast();
};

}  // namespace fwserve
