#include "server/engine/scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"

namespace fwserve {

namespace {

using Phase = ScheduledTask::Phase;

Action Finish(TaskId id, FinishReason reason) {
  Action action;
  action.kind = Action::Kind::kFinish;
  action.id = id;
  action.reason = reason;
  return action;
}

Action Fail(TaskId id, absl::Status status) {
  Action action;
  action.kind = Action::Kind::kFail;
  action.id = id;
  action.status = std::move(status);
  return action;
}

Action Emit(ScheduledTask& t) {
  Action action;
  action.kind = Action::Kind::kEmit;
  action.id = t.id;
  action.chunk = t.stream.TakeChunkForWrite();
  return action;
}

absl::Status ShuttingDown() { return absl::UnavailableError("the server is shutting down"); }

}  // namespace

Scheduler::Scheduler(SchedulerOptions options) : options_(std::move(options)) {}

ScheduledTask& Scheduler::Add(TaskId id, TaskKind kind, std::string tenant) {
  ScheduledTask& t = tasks_.emplace_back();
  t.id = id;
  t.kind = kind;
  t.tenant = std::move(tenant);
  by_id_[id] = std::prev(tasks_.end());
  Link(t);
  return t;
}

void Scheduler::Link(ScheduledTask& t) {
  std::vector<ScheduledTask*>& list = by_phase_[static_cast<size_t>(t.phase)];
  t.phase_slot = list.size();
  list.push_back(&t);
}

void Scheduler::Unlink(ScheduledTask& t) {
  std::vector<ScheduledTask*>& list = by_phase_[static_cast<size_t>(t.phase)];
  ScheduledTask* last = list.back();
  list[t.phase_slot] = last;
  last->phase_slot = t.phase_slot;
  list.pop_back();
}

void Scheduler::SetPhase(ScheduledTask& t, Phase phase) {
  if (t.phase == phase) return;
  Unlink(t);
  t.phase = phase;
  Link(t);
}

std::vector<TaskId> Scheduler::RunnableIn(Phase phase) const {
  std::vector<TaskId> ids;
  const std::vector<ScheduledTask*>& list = by_phase_[static_cast<size_t>(phase)];
  ids.reserve(list.size());
  for (const ScheduledTask* t : list) {
    if (!t->Parked()) ids.push_back(t->id);
  }
  std::sort(ids.begin(), ids.end());
  return ids;
}

bool Scheduler::AnyRunnableIn(Phase phase) const {
  for (const ScheduledTask* t : by_phase_[static_cast<size_t>(phase)]) {
    if (!t->Parked()) return true;
  }
  return false;
}

std::vector<Action> Scheduler::Start(TaskId id, size_t prompt_tokens, StreamLimits limits) {
  std::vector<Action> actions;
  ScheduledTask* t = Find(id);
  if (t == nullptr) return actions;
  t->prompt_tokens = prompt_tokens;
  // Only a Generate samples: a Score or CreateSession ends once its prompt is in.
  t->max_tokens = t->kind == TaskKind::kGenerate ? limits.max_tokens : 0;
  if (t->kind == TaskKind::kGenerate) t->stream = StreamTask(std::move(limits));
  SetPhase(*t, prompt_tokens == 0 ? Phase::kReadyToSample : Phase::kPrefill);
  if (t->phase == Phase::kReadyToSample && t->max_tokens == 0) {
    actions.push_back(Finish(id, FinishReason::kLength));
  }
  return actions;
}

void Scheduler::Remove(TaskId id) {
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return;
  ScheduledTask& t = *it->second;
  Unlink(t);
  if (t.parked) --parked_flagged_;
  tasks_.erase(it->second);
  by_id_.erase(it);
}

ScheduledTask* Scheduler::Find(TaskId id) {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &*it->second;
}

// ---------------------------------------------------------------------------------
// Fair share.

absl::flat_hash_map<std::string, int64_t> Scheduler::RunningByTenant() const {
  absl::flat_hash_map<std::string, int64_t> running;
  for (const ScheduledTask& t : tasks_) {
    if (!t.Parked()) ++running[t.tenant];
  }
  return running;
}

int64_t Scheduler::Running() const {
  if (parked_flagged_ == 0) return static_cast<int64_t>(tasks_.size());
  int64_t running = 0;
  for (const ScheduledTask& t : tasks_) running += t.Parked() ? 0 : 1;
  return running;
}

int64_t Scheduler::ResumeParked(int64_t running) {
  if (parked_flagged_ == 0) return running;
  for (ScheduledTask& t : tasks_) {
    if (running >= options_.max_active_streams) break;
    if (!t.Parked()) continue;
    t.parked = false;
    --parked_flagged_;
    ++running;
  }
  return running;
}

std::optional<TaskId> Scheduler::PreemptForFairShare(
    int64_t running, const std::vector<std::string>& waiting_tenants) {
  if (running < options_.max_active_streams || waiting_tenants.empty()) return std::nullopt;
  // What each tenant holds: its streams running and parked (a tenant is not short of
  // its share because of its own parked streams, so two tenants never take turns).
  absl::flat_hash_map<std::string, int64_t> held;
  for (const ScheduledTask& t : tasks_) ++held[t.tenant];
  absl::flat_hash_set<std::string> tenants(waiting_tenants.begin(), waiting_tenants.end());
  for (const auto& [tenant, count] : held) tenants.insert(tenant);
  // The share is max_active_streams / tenants, compared without rounding.
  const int64_t n = static_cast<int64_t>(tenants.size());
  const int64_t slots = options_.max_active_streams;
  // The oldest waiting stream of a tenant below its share, against the newest running
  // stream of the tenant furthest above it. Only a Generate between tokens is parked
  // (not one in its prompt's prefill).
  const std::string* under = nullptr;
  for (const std::string& tenant : waiting_tenants) {
    if (held[tenant] * n < slots) {
      under = &tenant;
      break;
    }
  }
  if (under == nullptr) return std::nullopt;
  ScheduledTask* victim = nullptr;
  int64_t victim_held = 0;
  for (ScheduledTask& t : tasks_) {
    if (t.Parked() || t.cancelled || t.in_prefill_job || t.kind != TaskKind::kGenerate ||
        t.phase == Phase::kPrefill || t.phase == Phase::kDraining) {
      continue;
    }
    const int64_t count = held[t.tenant];
    if (count * n <= slots) continue;  // not above its share
    if (victim == nullptr || count > victim_held ||
        (count == victim_held && t.tenant == victim->tenant)) {
      victim = &t;  // later tasks of the same tenant replace it: the newest is parked
      victim_held = count;
    }
  }
  if (victim == nullptr) return std::nullopt;
  victim->parked = true;
  ++parked_flagged_;
  return victim->id;
}

// ---------------------------------------------------------------------------------
// Prefill.

std::optional<PrefillChunk> Scheduler::PlanPrefill() {
  std::vector<ScheduledTask*> prefilling;
  for (ScheduledTask* t : InPhase(Phase::kPrefill)) {
    if (!t->in_prefill_job) prefilling.push_back(t);
  }
  if (prefilling.empty()) return std::nullopt;
  // In admission order: the round robin's turn and the batch's order do not depend on
  // how the phase's list was shuffled.
  std::sort(prefilling.begin(), prefilling.end(),
            [](const ScheduledTask* a, const ScheduledTask* b) { return a->id < b->id; });
  const size_t piece = static_cast<size_t>(std::max<int64_t>(1, options_.prefill_chunk_tokens));
  const size_t budget = options_.prefill_batch_tokens > 0
                            ? static_cast<size_t>(options_.prefill_batch_tokens)
                            : piece;
  auto next_length = [piece](const ScheduledTask* t) {
    return std::min(piece, t->prompt_tokens - t->prefilled);
  };
  ScheduledTask* lead = prefilling[prefill_turn_++ % prefilling.size()];
  PrefillChunk chunk;
  chunk.length = next_length(lead);
  chunk.tasks = {lead->id};
  chunk.score = lead->kind == TaskKind::kScore;
  if (!chunk.score) {
    for (ScheduledTask* other : prefilling) {
      if ((chunk.tasks.size() + 1) * chunk.length > budget) break;
      if (other != lead && other->kind != TaskKind::kScore && next_length(other) == chunk.length) {
        chunk.tasks.push_back(other->id);
      }
    }
  }
  for (TaskId id : chunk.tasks) Find(id)->in_prefill_job = true;
  return chunk;
}

std::vector<Action> Scheduler::AfterPrefill(const PrefillChunk& chunk, bool ok) {
  std::vector<Action> actions;
  for (TaskId id : chunk.tasks) {
    ScheduledTask* t = Find(id);
    if (t == nullptr) continue;
    t->in_prefill_job = false;
    if (!ok) {
      actions.push_back(Fail(id, absl::InternalError("prefill failed")));
      continue;
    }
    t->prefilled += chunk.length;
    if (t->cancelled) {
      // Cut while the chunk ran: a Generate rolls back (nothing was streamed); a Score
      // or CreateSession fails (its result would be partial).
      actions.push_back(t->kind == TaskKind::kGenerate ? Finish(id, t->CutReason())
                                                       : Fail(id, ShuttingDown()));
    } else if (t->prefilled < t->prompt_tokens) {
      continue;
    } else if (t->max_tokens > 0) {
      SetPhase(*t, Phase::kReadyToSample);
    } else {
      actions.push_back(Finish(id, FinishReason::kLength));
    }
  }
  return actions;
}

// ---------------------------------------------------------------------------------
// Decode.

std::vector<TaskId> Scheduler::PlanStep(absl::Time now) {
  std::vector<TaskId> batch = RunnableIn(Phase::kReadyToAbsorb);
  if (batch.empty()) return batch;
  const bool awaiting = AnyRunnableIn(Phase::kBlocked);
  // Streams whose write is still in flight get `batch_wait` to join this step.
  if (awaiting) {
    if (batch_deadline_ == absl::InfiniteFuture()) {
      batch_deadline_ = now + options_.batch_wait;
      return {};
    }
    if (now < batch_deadline_) return {};
  }
  batch_deadline_ = absl::InfiniteFuture();
  return batch;
}

std::vector<Action> Scheduler::AfterStep(const std::vector<TaskId>& stepped) {
  std::vector<Action> actions;
  for (TaskId id : stepped) {
    ScheduledTask* t = Find(id);
    if (t == nullptr) continue;
    const bool done = t->stream.done_sampling() || t->cancelled;
    if (done && t->stream.write_in_flight()) {
      SetPhase(*t, Phase::kDraining);  // ends when the write returns (OnWriteDone)
    } else if (done) {
      actions.push_back(Finish(id, t->cancelled ? t->CutReason() : t->DoneReason()));
    } else {
      SetPhase(*t, t->stream.CanSample() ? Phase::kReadyToSample : Phase::kBlocked);
    }
  }
  return actions;
}

std::vector<TaskId> Scheduler::PlanSample(std::vector<Action>* actions) {
  std::vector<TaskId> sampling;
  for (TaskId id : RunnableIn(Phase::kReadyToSample)) {
    ScheduledTask& t = *Find(id);
    if (t.cancelled) {
      // Cancelled while a write is in flight: nothing more is sampled.
      if (t.stream.write_in_flight()) {
        SetPhase(t, Phase::kDraining);
      } else {
        actions->push_back(Finish(t.id, t.CutReason()));
      }
      continue;
    }
    sampling.push_back(t.id);
  }
  return sampling;
}

std::vector<Action> Scheduler::AfterSample(
    const std::vector<TaskId>& sampled, const std::vector<int64_t>& tokens,
    const std::vector<float>& logprobs, absl::Time now,
    const std::vector<std::vector<std::pair<int64_t, float>>>* alternatives) {
  std::vector<Action> actions;
  for (size_t i = 0; i < sampled.size(); ++i) {
    ScheduledTask* t = Find(sampled[i]);
    if (t == nullptr) continue;
    t->stream.AddSampled(
        tokens[i], i < logprobs.size() ? logprobs[i] : 0.0f, now,
        alternatives != nullptr && i < alternatives->size() ? &(*alternatives)[i] : nullptr);
    SetPhase(*t, Phase::kReadyToAbsorb);
    if (!t->stream.write_in_flight() && t->stream.ShouldFlush(now)) actions.push_back(Emit(*t));
  }
  return actions;
}

std::vector<Action> Scheduler::EndSampling(TaskId id) {
  std::vector<Action> actions;
  ScheduledTask* t = Find(id);
  if (t == nullptr) return actions;
  t->stream.EndSampling();
  if (!t->stream.write_in_flight() && t->stream.has_unsent()) actions.push_back(Emit(*t));
  if (t->stream.write_in_flight()) {
    SetPhase(*t, Phase::kDraining);  // ends when the write returns (OnWriteDone)
  } else {
    actions.push_back(Finish(id, t->DoneReason()));
  }
  return actions;
}

// ---------------------------------------------------------------------------------
// Events.

std::vector<Action> Scheduler::OnWriteDone(TaskId id, bool ok, absl::Time now) {
  std::vector<Action> actions;
  ScheduledTask* t = Find(id);
  if (t == nullptr) return actions;  // already finished
  if (!ok) {
    // The client never got the chunk: it and everything after it are undone.
    t->cancelled = true;
    if (t->stream.write_in_flight()) actions.push_back(Finish(id, t->CutReason()));
    return actions;
  }
  if (!t->stream.write_in_flight()) return actions;
  t->stream.ConfirmWrite();
  if (t->cancelled) {
    // The chunk arrived; what was sampled after it was never sent. A pending token with
    // nothing unsent was delivered: the next step absorbs it, then the task ends.
    if (!t->stream.has_unsent() && t->phase == Phase::kReadyToAbsorb) return actions;
    actions.push_back(Finish(id, t->CutReason()));  // drops the unsent tokens
    return actions;
  }
  if (t->stream.has_unsent() && t->stream.ShouldFlush(now)) actions.push_back(Emit(*t));
  if (t->phase == Phase::kDraining && !t->stream.write_in_flight()) {
    actions.push_back(Finish(id, t->DoneReason()));
  } else if (t->phase == Phase::kBlocked && t->stream.CanSample()) {
    SetPhase(*t, Phase::kReadyToSample);
  }
  return actions;
}

std::vector<Action> Scheduler::OnCancel(TaskId id) {
  std::vector<Action> actions;
  ScheduledTask* t = Find(id);
  if (t == nullptr) return actions;
  t->cancelled = true;
  if ((t->phase == Phase::kPrefill && !t->in_prefill_job) ||
      (t->phase == Phase::kReadyToSample && !t->stream.write_in_flight())) {
    actions.push_back(Finish(id, FinishReason::kCancelled));
  }
  // A write in flight: decided when it returns. Ready to absorb with nothing in flight:
  // the token was delivered, so it is absorbed first (AfterStep ends it).
  return actions;
}

std::vector<Action> Scheduler::CancelAll() {
  std::vector<Action> actions;
  for (ScheduledTask& t : tasks_) {
    if (!t.cancelled) {
      t.cancelled = true;
      t.shutdown = true;
    }
  }
  // Streams not waiting on a write, a step or a chunk end now; the others when it returns.
  for (const ScheduledTask& t : tasks_) {
    if (t.stream.write_in_flight() || t.phase == Phase::kReadyToAbsorb || t.in_prefill_job) {
      continue;
    }
    actions.push_back(t.kind == TaskKind::kGenerate ? Finish(t.id, FinishReason::kShutdown)
                                                    : Fail(t.id, ShuttingDown()));
  }
  return actions;
}

Readiness Scheduler::ReadinessAfterIteration(bool prefill_in_flight) {
  Readiness readiness;
  if (parked_flagged_ == 0) {
    // Nothing parked: the phases' lists say it all, whatever the number of tasks.
    const bool awaiting = !InPhase(Phase::kBlocked).empty();
    const bool ready_to_absorb = !InPhase(Phase::kReadyToAbsorb).empty();
    readiness.immediate = !InPhase(Phase::kReadyToSample).empty() ||
                          (!prefill_in_flight && !InPhase(Phase::kPrefill).empty()) ||
                          (ready_to_absorb && !awaiting);
    if (!ready_to_absorb) batch_deadline_ = absl::InfiniteFuture();
    return readiness;
  }
  int64_t running = 0;  // counted against max_active_streams: all but the parked
  bool awaiting = false;
  bool ready_to_absorb = false;
  bool parked = false;
  for (const ScheduledTask& t : tasks_) {
    if (t.Parked()) {
      parked = true;
      continue;
    }
    ++running;
    switch (t.phase) {
      case Phase::kBlocked:
        awaiting = true;  // joins the next step once a write returns
        break;
      case Phase::kDraining:
        break;  // waits for its last write
      case Phase::kReadyToAbsorb:
        ready_to_absorb = true;
        break;
      case Phase::kPrefill:
        // Waiting for the prefill thread is not work for this one.
        if (!prefill_in_flight) readiness.immediate = true;
        break;
      case Phase::kReadyToSample:
        readiness.immediate = true;
        break;
    }
  }
  if (parked && running < options_.max_active_streams) readiness.immediate = true;
  // Absorb at once if nothing else can join the batch; else wait (at most until the
  // batch deadline) for the streams still writing.
  if (ready_to_absorb && !awaiting) readiness.immediate = true;
  if (!ready_to_absorb) batch_deadline_ = absl::InfiniteFuture();
  return readiness;
}

}  // namespace fwserve
