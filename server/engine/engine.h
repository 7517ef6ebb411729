// One model's engine: a thread that runs continuous batching (admit -> prefill one
// chunk -> one batched step -> sample -> emit). What runs is the Scheduler's plan
// (scheduler.h, plain data); the Runner (runner.h) owns the rows (StatePool), the
// kernels and the prefill thread; the SessionKeeper (session_keeper.h) owns what the
// engine holds of sessions: residency, loads, write-through, session operations,
// housekeeping and the end of a request's claim. Internal to the core (includes
// LibTorch): the transports see server/core/core.h only.
//
// Files: engine.cc holds the loop and its thread protocol, admission, prefill, decode,
// sampling and the streams' ends; work_item.h the work items (a std::variant of typed
// works); session_keeper.cc the session keeping.
//
// Durability (docs/sessions.md): a request that changes a session answers its caller
// only after the session store holds the new state; the session's lease is held until
// then. Store I/O runs on store threads; its results come back to the engine thread as
// continuations, so every session-state change happens on the engine thread.
//
// Thread-safety: Submit, SubmitClaimed, PostWriteDone, PostCancel, BeginDrain,
// WaitIdle, EndAllWork, Stop and the accessors are thread-safe. Everything else runs on
// the engine thread (the KeeperHost calls: as documented there).
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
#include "models/architectures/model.h"
#include "models/checkpoints/checkpoint.h"
#include "models/checkpoints/state_codec.h"
#include "models/kernels/native_step.h"
#include "models/tokenizers/text_tokenizer.h"
#include "models/tokenizers/tokenizer.h"
#include "server/api/requests.h"
#include "server/base/clock.h"
#include "server/engine/admission_queue.h"
#include "server/engine/drain_estimate.h"
#include "server/engine/engine_options.h"
#include "server/engine/model_engine.h"
#include "server/engine/runner.h"
#include "server/engine/scheduler.h"
#include "server/engine/session_keeper.h"
#include "server/engine/state_pool.h"
#include "server/engine/stream_driver.h"
#include "server/engine/work_item.h"
#include "server/metrics/metrics.h"
#include "server/sessions/session_directory.h"

namespace fwserve {

class Engine : public ModelEngine, private KeeperHost, private StreamHost {
 public:
  Engine(std::string name, fwmodel::LoadedModel loaded, const EngineOptions& options,
         EngineContext context);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // ModelEngine (model_engine.h has the contracts).
  void Start() override;
  const std::string& name() const override { return name_; }
  const std::string& fingerprint() const override { return fingerprint_; }
  const fwmodel::TextTokenizer& tokenizer() const override { return tokenizer_; }
  int64_t state_bytes_per_session() const override { return model_.state_bytes_per_session(); }
  absl::Status Submit(std::unique_ptr<WorkItem>& item) override;
  absl::Status SubmitClaimed(std::unique_ptr<WorkItem>& item,
                             std::optional<std::string> stored_state) override;
  absl::Status CheckAdmission(absl::Time deadline) const override;
  absl::Duration ExpectedQueueWait() const override;
  void BeginDrain() override;
  bool WaitIdle(absl::Time deadline) override;
  void EndAllWork() override;
  void Stop() override;

  const fwmodel::Model& model() const { return model_; }
  // A stream's write finished (ok: delivered), or its client cancelled it.
  void PostWriteDone(uint64_t stream_id, bool ok);
  void PostCancel(uint64_t stream_id);

 private:
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

  // engine.cc: the loop and the thread protocol; the streams' work is the driver's.
  // Each iteration: wait for work; apply store results, the finished prefill chunk
  // and the streams' write/cancel events; admit; the driver's iteration (the next
  // prefill chunk, one batched decode step, sample and emit); housekeeping; publish
  // what is ready.
  void Loop();
  IterationWork WaitForWork();
  void AdmitAll(std::vector<std::unique_ptr<WorkItem>>& admitted, bool end_all);
  // Refuses each of `shed` with RESOURCE_EXHAUSTED and the queue's retry hint, counted
  // as fwserve_queue_shed_total.
  void ShedAll(std::vector<std::unique_ptr<WorkItem>>& shed);
  // Publishes the readiness of the next iteration to WaitIdle and the admission check.
  // False once the loop should end (stopping, nothing left).
  bool PublishReadiness(bool stop);
  bool HasImmediateWorkLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // A stream's write or cancel event, to its task (StreamDriver).
  void ApplyEvent(const Event& event);

  // StreamHost.
  void AwaitPrefillDone() override;
  bool EndAllAsked() override;

  // KeeperHost: the keeper's store jobs count as the engine's work until their
  // continuations ran; a loaded item is admitted again.
  void StoreJobStarted() override;
  void StoreJobDone(std::function<void()> then) override;
  void Readmit(std::unique_ptr<WorkItem> item) override { driver_.Admit(std::move(item)); }
  // The keeper's housekeeping, then the engine's gauges.
  void Housekeeping();
  void PublishGauges();
  uint64_t NewStreamId() { return next_stream_id_.fetch_add(1); }

  const std::string name_;
  fwmodel::Model model_;
  const std::string fingerprint_;
  const fwmodel::TextTokenizer tokenizer_;
  const EngineOptions options_;
  ModelMetrics* const metrics_;       // never null
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
  StatePool& pool_;  // runner_'s
  // Residency, loads, write-through, session operations, housekeeping.
  SessionKeeper keeper_;
  // The admitted streams: their tasks, the scheduler, prefill, decode, sampling, delivery.
  StreamDriver driver_;
  absl::Time next_housekeeping_ = absl::InfinitePast();
};

}  // namespace fwserve
