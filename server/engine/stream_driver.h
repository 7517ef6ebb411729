// The admitted streams of one engine, on its thread. A Generate, Score or CreateSession
// the queue releases becomes a task; its prompt goes through prefill chunks, its tokens
// through decode steps and sampling, its chunks to the caller, and it ends committed or
// failed. What runs when is the Scheduler's decision (owned here), the rows and kernels
// are the Runner's, the sessions the SessionKeeper's. The Engine owns this, the queue,
// the loop and the threads (server/engine/engine.h).
//
// Thread-safety: engine thread only. What it needs of the engine's lock goes through
// StreamHost.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "models/architectures/model.h"
#include "models/constraints/token_masker.h"
#include "models/tokenizers/text_tokenizer.h"
#include "server/engine/drain_estimate.h"
#include "server/engine/engine_options.h"
#include "server/engine/runner.h"
#include "server/engine/scheduler.h"
#include "server/engine/session_keeper.h"
#include "server/engine/work_item.h"
#include "server/metrics/metrics.h"

namespace fwserve {

// What the driver asks of the engine's threads.
class StreamHost {
 public:
  virtual ~StreamHost() = default;
  // Blocks until the prefill thread reported the chunk in flight done, and consumes
  // the report (the loop will not see it).
  virtual void AwaitPrefillDone() = 0;
  // Whether the server asked every task to end (EndAllWork); for the test hook only.
  virtual bool EndAllAsked() = 0;
};

// What a driver works with. Pointers are not owned and outlive the driver.
struct StreamDriverContext {
  std::string name;  // the model's, for log lines
  const fwmodel::Model* model = nullptr;
  const fwmodel::TextTokenizer* tokenizer = nullptr;
  const EngineOptions* options = nullptr;
  ModelMetrics* metrics = nullptr;  // never null
  Runner* runner = nullptr;
  SessionKeeper* keeper = nullptr;
  DrainEstimate* drain = nullptr;  // told when a stream ends
  StreamHost* host = nullptr;
};

class StreamDriver {
 public:
  explicit StreamDriver(StreamDriverContext context);
  ~StreamDriver();
  StreamDriver(const StreamDriver&) = delete;
  StreamDriver& operator=(const StreamDriver&) = delete;

  // An item the queue released: a stream becomes a task (its session opened or loaded
  // first), a session operation runs. Once ending, it is refused UNAVAILABLE.
  void Admit(std::unique_ptr<WorkItem> item);
  // EndAllWork was applied: admit nothing more.
  void set_ending(bool ending) { ending_ = ending; }
  bool ending() const { return ending_; }
  // Shutdown: every task is cancelled as SHUTDOWN; those not waiting on a write, a step
  // or the prefill thread end now.
  void EndAll();
  // Reads the clock: what the events and deliveries that follow count as now (one read
  // per batch of events or sampled tokens, not one per token).
  void Tick() { now_ = absl::Now(); }
  // The transport's events for stream `stream_id` (ignored once it ended); they happen
  // at the last Tick.
  void OnWriteDone(uint64_t stream_id, bool ok);
  void OnCancel(uint64_t stream_id);
  // The prefill thread returned the chunk in flight: its rows go back, its tasks on.
  void CompletePrefill();
  // One iteration's compute: the next prefill chunk out, one batched decode step for
  // every stream ready to absorb, then sampling and emission.
  void RunIteration();
  // After an iteration threw: waits for the step and the chunk in flight (unless the
  // prefill thread's report of it was already taken: `prefill_returned`), then fails
  // every task with `status`.
  void FailAll(const absl::Status& status, bool prefill_returned);

  Scheduler& scheduler() { return scheduler_; }
  // Tasks being served (running or parked).
  int64_t tasks() const { return static_cast<int64_t>(tasks_.size()); }
  bool prefill_in_flight() const { return prefill_job_ != nullptr; }

 private:
  struct Task;
  struct PrefillJob;

  // Carries out the scheduler's decisions, in order (an action for a task that an
  // earlier one ended is skipped).
  void Apply(std::vector<Action> actions);
  void AdmitStream(Task& task);
  // Hands the next prefill chunk (one task, or several with equal chunk lengths) to the
  // prefill thread, unless one is in flight.
  void StartPrefill();
  // Drops the in-flight prefill job (if any) and its result, first waiting for the
  // prefill thread's report unless it was already taken (`returned`).
  void AbandonPrefillJob(bool returned = false);
  // One batched decode step for every stream ready to absorb, and its results applied.
  void RunDecodeStep();
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

  // Several choices of one request (GenerateParams::choice, docs/http.md "Several
  // choices"): choice 0 reads the prompt; just before it draws its first token, its row
  // (state, logits, token count, repetition window) is saved in its group, and every
  // other choice of the group starts from a copy of it, with no prompt of its own.
  struct ChoiceGroup {
    bool ready = false;  // `row` holds choice 0's row after its prompt
    // Not OK: choice 0 ended before that; the others fail with this status.
    absl::Status failed;
    StatePool::RowCopy row;
    int64_t tokens = 0;
    std::vector<int64_t> recent;
    int32_t expected = 0;  // the other choices: count - 1
    int32_t arrived = 0;   // of them, let through to start from `row`, or failed
    // Admitted before `ready`: admitted again once it is (or failed).
    std::vector<std::unique_ptr<WorkItem>> waiting;
    absl::Time settled;  // when it became ready or failed
  };
  // The group of `choice` (made if new), its expected count set.
  ChoiceGroup& GroupOf(const GenerateParams::Choice& choice);
  // Whether Admit took `item` (a choice i > 0): it waits for its group's row, or failed.
  // A choice let through (its group is ready) counts as arrived.
  bool HoldChoice(std::unique_ptr<WorkItem>& item);
  // Choice 0 is about to draw its first token: its row becomes the group's.
  void SaveChoiceRow(Task& t);
  // Choice 0 ended before SaveChoiceRow: the group's waiting and later choices fail.
  void FailChoiceGroup(const GenerateParams::Choice& choice, const absl::Status& status);
  // Drops groups every choice of which has arrived, and those settled long ago (a choice
  // refused before it reached the engine never arrives).
  void DropSettledChoiceGroups();
  absl::flat_hash_map<uint64_t, ChoiceGroup> choice_groups_;
  // Choices whose group became ready: admitted at the next iteration's start.
  std::vector<std::unique_ptr<WorkItem>> released_choices_;

  const std::string name_;
  const fwmodel::Model& model_;
  const fwmodel::TextTokenizer& tokenizer_;
  // The vocabulary's token trie for constrained streams: built at the first one.
  const constraints::TokenMasker& Masker();
  std::unique_ptr<constraints::TokenMasker> masker_;
  const EngineOptions& options_;
  ModelMetrics* const metrics_;
  Runner& runner_;
  StatePool& pool_;  // runner_'s
  SessionKeeper& keeper_;
  DrainEstimate* const drain_;
  StreamHost* const host_;

  bool ending_ = false;
  // Which streams run, as plain data (phases, streams, parking, the prefill turn, the
  // batch deadline).
  Scheduler scheduler_;
  // The tasks' runner side, by the scheduler's ids; the stream ids' tasks.
  absl::flat_hash_map<TaskId, std::unique_ptr<Task>> tasks_;
  absl::flat_hash_map<uint64_t, TaskId> tasks_by_stream_;
  TaskId next_task_id_ = 1;
  absl::Time now_ = absl::Now();             // Tick's
  std::unique_ptr<PrefillJob> prefill_job_;  // in flight on the prefill thread, or null
};

}  // namespace fwserve
