// The engine's scheduler: which admitted streams run this iteration, as plain data.
// Torch-free and clock-free (times are passed in), so it is unit-tested without a
// model (tests/unit/scheduler_test.cc).
//
// The shape is vLLM v1's (vllm/v1/core/sched/interface.py): the loop asks for a plan,
// the runner carries it out, and the results go back to the scheduler, which decides
// what happens to each task next. Here a plan is split where the loop's order needs
// it: `PlanPrefill` (one chunk for the prefill thread), `PlanStep` (the rows that absorb
// their sampled token in one batched step), `PlanSample` (the rows that draw a token),
// each answered by `AfterPrefill`, `AfterStep`, `AfterSample` (docs/architecture.md,
// "The engine's parts").
//
// What a task's caller must hear, and what must be delivered, comes back as `Action`s:
// emit a chunk, finish with a reason, fail with a status. The engine carries them out
// in order (rows restored, answers sent, the task removed with `Remove`).
//
// The scheduler owns each stream's phase, its StreamTask (lookahead, flushing,
// rollback points), parking for the tenants' fair share, the prefill turn and the
// batch deadline. It does not own the queue (AdmissionQueue, under the engine's lock),
// the rows (the runner's StatePool) or sessions (the engine's session keeper).
//
// Thread-safety: none; the engine thread alone calls it.
#pragma once

#include <array>
#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/api/requests.h"
#include "server/engine/scheduler_options.h"
#include "server/engine/stream_task.h"

namespace fwserve {

// A task's identity within one engine, unique for the engine's lifetime.
using TaskId = uint64_t;

enum class TaskKind { kGenerate, kScore, kCreate };

// One admitted stream as the scheduler sees it.
struct ScheduledTask {
  // kPrefill: prompt tokens remain to be absorbed (chunk by chunk).
  // kReadyToSample: draws its next token in the next sampling.
  // kReadyToAbsorb: a sampled token goes into the next decode step.
  // kBlocked: absorbed, but `lookahead` tokens are unconfirmed: waits for a write.
  // kDraining: done sampling (stop, length or cancelled); waits for its last write.
  enum class Phase { kPrefill, kReadyToSample, kReadyToAbsorb, kBlocked, kDraining };

  static constexpr int kPhases = 5;

  TaskId id = 0;
  TaskKind kind = TaskKind::kGenerate;
  std::string tenant;
  // Set by the Scheduler alone (it indexes the tasks by phase).
  Phase phase = Phase::kPrefill;
  // The task's place in the Scheduler's list of its phase (Scheduler-internal).
  size_t phase_slot = 0;
  size_t prompt_tokens = 0;  // to absorb in prefill
  size_t prefilled = 0;      // absorbed so far
  // Generate: tokens at most; 0 ends the task after its prefill.
  int64_t max_tokens = 0;
  // Generate: sampled, sent and confirmed tokens, stop strings, rollback points.
  StreamTask stream{StreamLimits{}};
  bool cancelled = false;
  bool shutdown = false;  // cancelled by the server's shutdown
  // Preempted for another tenant's fair share: keeps its row and stream, but is not
  // stepped or sampled and does not count as running until a slot frees. A cancelled
  // task is never held parked (it must be able to end).
  bool parked = false;
  // Its rows are on the prefill thread: it must not end until the chunk returns.
  bool in_prefill_job = false;

  bool Parked() const { return parked && !cancelled; }
  // How a cut stream ends: kShutdown when the server cut it, else kCancelled.
  FinishReason CutReason() const {
    return shutdown ? FinishReason::kShutdown : FinishReason::kCancelled;
  }
  // How a stream that sampled all it will ends: kStop or kLength.
  FinishReason DoneReason() const {
    return stream.stop_hit() ? FinishReason::kStop : FinishReason::kLength;
  }
};

// What the engine does for a task, decided by the scheduler.
struct Action {
  enum class Kind {
    // Deliver `chunk` (the stream's write in flight now): the runner's rollback rows
    // move along (before_unsent becomes before_inflight).
    kEmit,
    // End the task with `reason` (a Generate's unconfirmed tokens are dropped first
    // when the reason is kCancelled or kShutdown).
    kFinish,
    // End the task with `status`.
    kFail,
  };
  Kind kind = Kind::kFinish;
  TaskId id = 0;
  FinishReason reason = FinishReason::kLength;
  absl::Status status;
  GenerateChunk chunk;
};

// One prefill chunk: `length` prompt tokens of each task, from its `prefilled`.
// A Score chunk has one task (a private context, not a pool row).
struct PrefillChunk {
  std::vector<TaskId> tasks;
  size_t length = 0;
  bool score = false;
};

// How the loop should wait after an iteration.
struct Readiness {
  // Work is ready now: the loop must not sleep.
  bool immediate = false;
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options);

  // A new stream in phase kPrefill (its StreamTask set by Start). The reference is
  // stable until Remove.
  ScheduledTask& Add(TaskId id, TaskKind kind, std::string tenant);
  // The task is ready to run: `prompt_tokens` to absorb, then up to `limits.max_tokens`
  // to sample (Generate). Returns the actions due at once (a Generate with nothing to
  // sample and no prompt finishes).
  std::vector<Action> Start(TaskId id, size_t prompt_tokens, StreamLimits limits);
  // Forgets the task (the engine has ended it). Unknown ids are ignored.
  void Remove(TaskId id);
  ScheduledTask* Find(TaskId id);
  // In admission order.
  const std::list<ScheduledTask>& tasks() const { return tasks_; }
  size_t size() const { return tasks_.size(); }
  // The tasks in `phase`, parked ones included, in no particular order; invalidated by
  // any call that changes a phase or removes a task. What an iteration plans is found
  // here, so its cost follows the tasks that are ready, not all the tasks held.
  const std::vector<ScheduledTask*>& InPhase(ScheduledTask::Phase phase) const {
    return by_phase_[static_cast<size_t>(phase)];
  }

  // --- Fair share (docs/serving.md "Admission").
  // Streams running per tenant (the parked ones not counted).
  absl::flat_hash_map<std::string, int64_t> RunningByTenant() const;
  // Tasks running (not parked).
  int64_t Running() const;
  // Resumes parked streams, oldest first, while fewer than max_active_streams run;
  // returns the streams running then.
  int64_t ResumeParked(int64_t running);
  // With every slot taken (`running`) and a stream of a tenant below its fair share
  // (max_active_streams over the tenants with streams running, parked or waiting) in
  // `waiting_tenants` (the queue's, oldest first): parks the newest running Generate,
  // between tokens, of the tenant furthest above its share, and returns it.
  std::optional<TaskId> PreemptForFairShare(int64_t running,
                                            const std::vector<std::string>& waiting_tenants);

  // --- Prefill.
  // The next chunk (marks its tasks in_prefill_job), or nothing when no task is in
  // kPrefill. The lead task goes round robin; its piece is at most prefill_chunk_tokens;
  // other pool-backed tasks whose next piece has the same length join it, up to
  // prefill_batch_tokens in all (no padding).
  // Precondition: no chunk in flight.
  std::optional<PrefillChunk> PlanPrefill();
  // The chunk came back (`ok`: it was absorbed). Advances its tasks; returns what ends.
  std::vector<Action> AfterPrefill(const PrefillChunk& chunk, bool ok);

  // --- Decode.
  // The rows absorbing now (kReadyToAbsorb, not parked), or none while the batch waits.
  std::vector<TaskId> PlanStep(absl::Time now);
  // The step absorbed each task's pending token (or failed: `ok` false, the engine
  // fails them). Moves each on: to sample, to wait for a write, to drain, or to finish.
  std::vector<Action> AfterStep(const std::vector<TaskId>& stepped);
  // The rows that draw a token now (kReadyToSample, not parked); cancelled ones drain
  // or finish instead (in `actions`).
  std::vector<TaskId> PlanSample(std::vector<Action>* actions);
  // A row of PlanSample's whose next token cannot be drawn (a constraint no token of the
  // vocabulary continues) ends as after a stop string: its unsent tokens go out, and it
  // finishes (kStop) once its last write returns. Instead of sampling it.
  std::vector<Action> EndSampling(TaskId id);
  // The sampled tokens of PlanSample's rows, in its order (log-probs beside them).
  // Each goes into its stream; a stream with no write in flight whose chunk is due
  // emits it. `alternatives` (may be null or empty): per token, its top_logprobs.
  std::vector<Action> AfterSample(
      const std::vector<TaskId>& sampled, const std::vector<int64_t>& tokens,
      const std::vector<float>& logprobs, absl::Time now,
      const std::vector<std::vector<std::pair<int64_t, float>>>* alternatives = nullptr);

  // --- Events from the transport.
  // The stream's write returned (`ok`: the client has it).
  std::vector<Action> OnWriteDone(TaskId id, bool ok, absl::Time now);
  // The client cancelled the stream.
  std::vector<Action> OnCancel(TaskId id);
  // Shutdown: every task is cut (reason kShutdown); those not waiting on a write, a
  // step or the prefill thread end now (a Generate finishes, others fail UNAVAILABLE).
  std::vector<Action> CancelAll();

  // After an iteration: whether the next one has work at once, and when a waiting
  // step runs anyway (InfiniteFuture when none waits). `prefill_in_flight`: the
  // prefill thread holds a chunk.
  Readiness ReadinessAfterIteration(bool prefill_in_flight);
  absl::Time batch_deadline() const { return batch_deadline_; }

 private:
  // Moves `t` to `phase`'s list.
  void SetPhase(ScheduledTask& t, ScheduledTask::Phase phase);
  void Link(ScheduledTask& t);
  void Unlink(ScheduledTask& t);
  // The ids of the non-parked tasks of `phase`, in admission order (ids increase).
  std::vector<TaskId> RunnableIn(ScheduledTask::Phase phase) const;
  // Whether some task of `phase` is not parked.
  bool AnyRunnableIn(ScheduledTask::Phase phase) const;

  const SchedulerOptions options_;
  std::list<ScheduledTask> tasks_;
  absl::flat_hash_map<TaskId, std::list<ScheduledTask>::iterator> by_id_;
  // Every task in the list of its phase (ScheduledTask::phase_slot is its index there).
  std::array<std::vector<ScheduledTask*>, ScheduledTask::kPhases> by_phase_;
  // Tasks whose `parked` flag is set (cancelled ones included): while none is, the
  // counts of running tasks need no scan.
  int64_t parked_flagged_ = 0;
  size_t prefill_turn_ = 0;
  // When the pending decode step runs even if some streams are still writing.
  absl::Time batch_deadline_ = absl::InfiniteFuture();
};

}  // namespace fwserve
