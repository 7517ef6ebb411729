// One model's engine: a single thread that owns the model's state pool and runs
// continuous batching (admit -> prefill one chunk -> one batched step -> sample ->
// emit). Prefill chunks run on a helper thread, on private copies of the rows, while
// the engine thread decodes; the engine thread gathers and scatters them, so it alone
// touches the pool. Internal to server/core (includes LibTorch); the transport sees
// core.h only.
//
// Thread-safety: Submit, PostWriteDone, PostCancel, BeginDrain, EndAllWork, counts and
// the accessors are thread-safe. Everything else runs on the engine thread, which alone
// touches state tensors.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
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
#include "models/tokenizer.h"
#include "server/core/core.h"
#include "server/core/metrics.h"
#include "server/core/session_store.h"

namespace fwserve {

// Resident state bytes over all engines, against --max-state-memory-bytes.
class StateMemoryBudget {
 public:
  explicit StateMemoryBudget(int64_t limit_bytes) : limit_(limit_bytes) {}
  bool TryReserve(int64_t bytes);
  void Release(int64_t bytes);
  // An engine needs `bytes` and has no idle session of its own to give up: engines with
  // idle sessions spill (or evict) some at their next housekeeping.
  void RequestReclaim(int64_t bytes);
  // Bytes still wanted by RequestReclaim (0 = none); Reclaimed subtracts what was freed.
  int64_t reclaim_wanted() const { return reclaim_.load(); }
  void Reclaimed(int64_t bytes);

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
  std::atomic<int64_t> reclaim_{0};
};

// A unit of work for the engine. Items that name an existing session hold its lease
// (SessionStore::Acquire) from submission; the engine returns it when done.
struct WorkItem {
  enum class Kind { kGenerate, kScore, kCreate, kFork, kExport, kImport, kDelete };
  Kind kind = Kind::kGenerate;
  std::string session_id;
  std::vector<int64_t> tokens;  // prompt, scored text or prefix
  GenerateParams generate;
  GenerateObserver* observer = nullptr;  // kGenerate; see core.h for its lifetime
  uint64_t stream_id = 0;                // kGenerate
  std::string blob;                      // kImport
  Callback<ScoreResult> on_score;
  Callback<SessionRecord> on_session;
  Callback<ExportResult> on_export;
  Callback<bool> on_delete;
  // kScore, kCreate: polled between prefill chunks; may be null.
  std::function<bool()> is_cancelled;
  absl::Time arrival;
};

class Engine {
 public:
  Engine(std::string name, fwmodel::LoadedModel loaded, const CoreOptions& options,
         SessionStore* store, StateMemoryBudget* budget, ModelMetrics* metrics);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void Start();
  const std::string& name() const { return name_; }
  const fwmodel::Model& model() const { return model_; }
  const std::string& fingerprint() const { return fingerprint_; }
  uint64_t NewStreamId() { return next_stream_id_.fetch_add(1); }

  // Queues `item`. RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE when draining;
  // on error the item is returned untouched through `item` (callbacks not called).
  absl::Status Submit(std::unique_ptr<WorkItem>& item);
  void PostWriteDone(uint64_t stream_id, bool ok);
  void PostCancel(uint64_t stream_id);

  // Shutdown steps (see Core): refuse new work; wait for idle; end the rest; persist
  // and stop the thread.
  void BeginDrain();
  bool WaitIdle(absl::Time deadline);
  void EndAllWork();
  void StopAndPersist();

 private:
  struct Task;
  struct PrefillJob;
  struct ResidentSession {
    int slot = -1;
    int64_t tokens = 0;
    absl::Time created;
    absl::Time last_used;
    bool in_use = false;  // a task or session operation is using the slot
  };
  struct Event {
    uint64_t stream_id;
    enum Kind { kWriteOk, kWriteFailed, kCancel } kind;
  };

  void Loop();
  bool HasImmediateWorkLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyEvent(const Event& event);
  void Admit(std::unique_ptr<WorkItem> item);
  void AdmitStream(std::unique_ptr<Task> task);
  void RunSessionOperation(WorkItem& item);
  // Hands the next prefill chunk (one task, or several with equal chunk lengths) to the
  // prefill thread, unless one is in flight.
  void StartPrefill();
  // Applies a finished prefill job: scatters the rows back, advances its tasks.
  void CompletePrefill();
  // Blocks until the in-flight prefill job (if any) is done and drops its result.
  void AbandonPrefillJob();
  void PrefillThreadLoop();
  void RunDecodeStep();
  void SampleAndEmit();
  void FinishTask(Task& task, FinishReason reason);
  void FailTask(Task& task, absl::Status status);
  void Housekeeping();
  void PublishGauges();

  // Slots. All on the engine thread.
  absl::StatusOr<int> AllocateSlot();
  void FreeSlot(int slot);
  void ResetSlot(int slot);
  // The index tensor {slot} on the model's device, for Gather/Scatter of one row.
  torch::Tensor SlotIndex(int64_t slot) const;
  // Puts back the task's slot (state, next-token logits, token count) as it was before
  // the request.
  void RestoreSnapshot(Task& t);
  bool Grow();
  bool SpillOrEvictOne();
  absl::Status Spill(const std::string& id);
  absl::StatusOr<int> EnsureResident(const std::string& id);
  void RemoveSession(const std::string& id);
  std::string SpillPath(const std::string& id) const;
  absl::StatusOr<std::string> EncodeSlot(int slot, int64_t tokens,
                                         const std::map<std::string, std::string>& labels);

  const std::string name_;
  fwmodel::Model model_;
  const std::string fingerprint_;
  const CoreOptions options_;
  SessionStore* const store_;
  StateMemoryBudget* const budget_;
  ModelMetrics* const metrics_;  // may be null
  const int64_t state_bytes_;
  const int64_t vocab_;
  const int64_t max_slots_;

  std::atomic<uint64_t> next_stream_id_{1};
  std::thread thread_;
  std::thread prefill_thread_;

  // Hand-off to the prefill thread: at most one job in flight.
  absl::Mutex prefill_mu_;
  absl::CondVar prefill_cv_;
  PrefillJob* prefill_pending_ ABSL_GUARDED_BY(prefill_mu_) = nullptr;
  bool prefill_stop_ ABSL_GUARDED_BY(prefill_mu_) = false;

  absl::Mutex mu_;
  absl::CondVar wake_;          // the engine thread waits on it
  absl::CondVar idle_changed_;  // WaitIdle waits on it
  std::deque<std::unique_ptr<WorkItem>> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<Event> events_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool end_all_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // end_all_ has been applied to every task (it is an edge, not a level, for waking).
  bool end_all_applied_ ABSL_GUARDED_BY(mu_) = false;
  // The prefill thread finished the in-flight job.
  bool prefill_done_ ABSL_GUARDED_BY(mu_) = false;
  // Mirrors of engine-thread counts, for WaitIdle and the admission check.
  int64_t active_tasks_ ABSL_GUARDED_BY(mu_) = 0;
  bool immediate_work_ ABSL_GUARDED_BY(mu_) = false;

  // Engine-thread state.
  fwmodel::State pool_;        // [capacity, ...] per state tensor
  torch::Tensor next_logits_;  // float32 CPU [capacity, vocab]
  fwmodel::State fresh_row_;   // InitialState(1)
  int64_t capacity_ = 0;
  std::vector<int> free_slots_;
  int64_t slots_in_use_ = 0;
  absl::flat_hash_map<std::string, ResidentSession> resident_;
  std::list<std::unique_ptr<Task>> tasks_;
  absl::flat_hash_map<uint64_t, Task*> tasks_by_stream_;
  size_t prefill_turn_ = 0;
  std::unique_ptr<PrefillJob> prefill_job_;  // in flight on the prefill thread, or null
  // When the pending decode step runs even if some streams are still writing.
  absl::Time batch_deadline_ = absl::InfiniteFuture();
  absl::Time next_housekeeping_ = absl::InfinitePast();
};

}  // namespace fwserve
