#include "server/engine/stream_driver.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/base/log.h"

namespace fwserve {

// A Generate, Score or CreateSession being served: the runner's and the caller's side
// of it (rows, rollback copies, sampling state, the work item). Its phase, stream and
// flags are the scheduler's (`s`). Engine thread only.
struct StreamDriver::Task {
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
  // The last repetition_window tokens of prompt + generated, for the repetition
  // penalty; kept only when the request sets one (the sampler ignores it otherwise).
  std::vector<int64_t> recent;
  // A failed write or a cancellation puts the slot back to the rollback point of the
  // first unconfirmed token (StreamTask names it), so the session holds exactly the
  // tokens the client was sent.
  RollbackPoint before_inflight;  // valid while the stream has a write in flight
  RollbackPoint before_unsent;    // valid while the stream has unsent tokens
  absl::Time first_token_at = absl::InfinitePast();
  absl::Time last_emit_at;

  // OpenAI's presence and frequency penalties (kept only when one is set): each generated
  // token's count (ids ascending) and the request's own logit_bias; the stream's
  // generate->sampling.logit_bias is their sum, one entry updated per absorbed token.
  std::vector<std::pair<int64_t, int32_t>> counts;
  std::vector<std::pair<int64_t, float>> request_bias;
  // Structured output: the mask of the next sampling (vocab entries), kept to reuse.
  std::vector<uint8_t> allowed;

  // Adds an absorbed (generated) token to the repetition window and to the counts of a
  // Generate's penalties.
  void Remember(int64_t token) {
    SamplingParams& p = generate->sampling;
    if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) Count(token);
    if (p.repetition_penalty == 1.0f) return;
    recent.push_back(token);
    const size_t window = static_cast<size_t>(generate->repetition_window);
    if (recent.size() > window) recent.erase(recent.begin());
  }

  // The token's count goes up by one, and its entry of the stream's logit_bias becomes
  // the request's bias for it (if any) plus the penalty of its new count; the other
  // entries keep theirs. O(log n) to find it, O(n) to insert a new one.
  void Count(int64_t token) {
    auto count = std::lower_bound(counts.begin(), counts.end(), token, IdBefore<int32_t>);
    if (count != counts.end() && count->first == token) {
      ++count->second;
    } else {
      count = counts.insert(count, {token, 1});
    }
    SamplingParams& p = generate->sampling;
    float value = -(static_cast<float>(count->second) * p.frequency_penalty + p.presence_penalty);
    auto requested =
        std::lower_bound(request_bias.begin(), request_bias.end(), token, IdBefore<float>);
    if (requested != request_bias.end() && requested->first == token) {
      value = requested->second + value;
    }
    std::vector<std::pair<int64_t, float>>& bias = p.logit_bias;
    auto entry = std::lower_bound(bias.begin(), bias.end(), token, IdBefore<float>);
    if (entry != bias.end() && entry->first == token) {
      entry->second = value;
    } else {
      bias.insert(entry, {token, value});
    }
  }

  // Orders (id, value) pairs by id against an id, for std::lower_bound.
  template <typename Value>
  static bool IdBefore(const std::pair<int64_t, Value>& entry, int64_t id) {
    return entry.first < id;
  }
};

// A prefill chunk in flight: the scheduler's plan, its tasks and the runner's work.
struct StreamDriver::PrefillJob {
  PrefillChunk chunk;        // the scheduler's plan
  std::vector<Task*> tasks;  // chunk.tasks' runner side
  PrefillWork work;
};

namespace {

// The scheduler's kind of a stream's work (WorkItem::IsStream).
TaskKind TaskKindOf(const WorkItem& item) {
  if (item.Is<ScoreWork>()) return TaskKind::kScore;
  if (item.Is<CreateWork>()) return TaskKind::kCreate;
  return TaskKind::kGenerate;
}

double Seconds(absl::Time from, absl::Time to) { return absl::ToDoubleSeconds(to - from); }

}  // namespace

StreamDriver::StreamDriver(StreamDriverContext context)
    : name_(std::move(context.name)),
      model_(*context.model),
      tokenizer_(*context.tokenizer),
      options_(*context.options),
      metrics_(context.metrics),
      runner_(*context.runner),
      pool_(context.runner->pool()),
      keeper_(*context.keeper),
      drain_(context.drain),
      host_(context.host),
      scheduler_(options_.scheduler) {}

StreamDriver::~StreamDriver() = default;

void StreamDriver::RunIteration() {
  if (!released_choices_.empty()) {
    std::vector<std::unique_ptr<WorkItem>> released = std::move(released_choices_);
    released_choices_.clear();
    for (std::unique_ptr<WorkItem>& item : released) Admit(std::move(item));
  }
  if (!choice_groups_.empty()) DropSettledChoiceGroups();
  StartPrefill();   // prefill: the next chunk to the prefill thread
  RunDecodeStep();  // step: one batched step for every stream ready to absorb
  SampleAndEmit();  // sample, and emit what may go out
}

void StreamDriver::FailAll(const absl::Status& status, bool prefill_returned) {
  AbandonPrefillJob(prefill_returned);
  while (!tasks_.empty()) FailTask(*tasks_.begin()->second, status);
}

void StreamDriver::OnWriteDone(uint64_t stream_id, bool ok) {
  auto it = tasks_by_stream_.find(stream_id);
  if (it == tasks_by_stream_.end()) return;  // already finished
  Apply(scheduler_.OnWriteDone(it->second, ok, now_));
}

void StreamDriver::OnCancel(uint64_t stream_id) {
  auto it = tasks_by_stream_.find(stream_id);
  if (it == tasks_by_stream_.end()) return;  // already finished
  Apply(scheduler_.OnCancel(it->second));
}

void StreamDriver::Admit(std::unique_ptr<WorkItem> item) {
  if (ending_) {
    return FailItem(std::move(item), absl::UnavailableError("the server is shutting down"));
  }
  // A tensor exception (e.g. out of memory) while admitting fails this item alone, with
  // its lease released and its caller answered; nothing is dropped silently.
  std::optional<TaskId> admitted;  // the stream task made for `item`, if any
  try {
    if (HoldChoice(item)) return;
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

void StreamDriver::AdmitStream(Task& t) {
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
  // Choice i > 0 of a request: its throwaway row starts as choice 0's after the prompt
  // (HoldChoice admitted it only once that row was saved).
  const ChoiceGroup* choice_row = nullptr;
  if (const GenerateWork* generate = w.As<GenerateWork>();
      generate != nullptr && generate->params.choice.index > 0) {
    auto group = choice_groups_.find(generate->params.choice.group);
    if (group == choice_groups_.end() || !group->second.ready) {
      return FailTask(t, absl::AbortedError("n: the request's first choice is gone"));
    }
    choice_row = &group->second;
    pool_.RestoreRow(t.slot, choice_row->row);
    t.tokens_before = t.tokens = choice_row->tokens;
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
    // The request's message grouping, else the server's: a token count waits without a
    // time limit unless one is set.
    const int64_t min_tokens =
        g.min_tokens_per_message > 0 || g.max_message_delay > absl::ZeroDuration()
            ? g.min_tokens_per_message
            : options_.stream_min_tokens_per_message;
    absl::Duration flush_interval = options_.stream_flush_interval;
    if (g.max_message_delay > absl::ZeroDuration()) {
      flush_interval = g.max_message_delay;
    } else if (g.min_tokens_per_message > 0 ||
               (min_tokens > 0 && flush_interval <= absl::ZeroDuration())) {
      flush_interval = absl::InfiniteDuration();
    }
    limits = StreamLimits{g.max_tokens,
                          g.stop,
                          g.logprobs,
                          /*top_logprobs=*/g.logprobs && g.top_logprobs > 0,
                          options_.decode_lookahead,
                          flush_interval,
                          min_tokens,
                          g.constraint,
                          &tokenizer_,
                          /*keep_output=*/!t.session_id.empty()};
    t.rng.seed(g.sampling.seed);
    if (g.sampling.presence_penalty != 0.0f || g.sampling.frequency_penalty != 0.0f) {
      t.request_bias = g.sampling.logit_bias;
    }
    if (g.sampling.repetition_penalty != 1.0f) {
      t.recent.assign(w.tokens.end() - std::min<size_t>(w.tokens.size(), g.repetition_window),
                      w.tokens.end());
      if (choice_row != nullptr) t.recent = choice_row->recent;
    }
    if (choice_row != nullptr) DropSettledChoiceGroups();  // HoldChoice counted it
    metrics_->AddPromptTokensSaved(t.tokens_before);
    tasks_by_stream_[generate->stream_id] = t.s->id;
  }
  Apply(scheduler_.Start(t.s->id, w.tokens.size(), std::move(limits)));
}

void StreamDriver::Apply(std::vector<Action> actions) {
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

void StreamDriver::Deliver(Task& t, GenerateChunk chunk) {
  std::swap(t.before_inflight, t.before_unsent);  // reuses the buffers
  const int64_t count = static_cast<int64_t>(chunk.token_ids.size());
  const absl::Time now = now_;
  if (t.first_token_at == absl::InfinitePast()) {
    metrics_->ObserveTimeToFirstToken(Seconds(t.item->arrival, now));
  } else if (count > 0) {
    // A chunk of n tokens: each is counted as arriving n-th of the wait.
    metrics_->ObserveInterTokenLatency(Seconds(t.last_emit_at, now) / static_cast<double>(count),
                                       count);
  }
  if (t.first_token_at == absl::InfinitePast()) t.first_token_at = now;
  t.last_emit_at = now;
  t.item->As<GenerateWork>()->observer->OnChunk(std::move(chunk));
}

void StreamDriver::DropUnconfirmed(Task& t) {
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

void StreamDriver::StartPrefill() {
  if (prefill_job_ != nullptr) return;
  // A Score or CreateSession whose caller went away stops before its next chunk.
  std::vector<Task*> abandoned;
  for (const ScheduledTask* s : scheduler_.InPhase(ScheduledTask::Phase::kPrefill)) {
    Task& t = *tasks_.at(s->id);
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

void StreamDriver::CompletePrefill() {
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

void StreamDriver::AbandonPrefillJob(bool returned) {
  if (prefill_job_ == nullptr) return;
  if (!returned) host_->AwaitPrefillDone();
  for (Task* t : prefill_job_->tasks) t->s->in_prefill_job = false;
  prefill_job_.reset();
}

void StreamDriver::RunDecodeStep() {
  const std::vector<TaskId> batch_ids = scheduler_.PlanStep(absl::Now());
  if (batch_ids.empty()) return;
  if (options_.before_decode_step_for_testing) {
    options_.before_decode_step_for_testing([this] { return host_->EndAllAsked(); });
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
    t->Remember(t->pending_token);
    // What the row's next sampling will ask, for a kernel that samples inside the step
    // (Stepper::Step; a row that does not sample next leaves its draw unused).
    if (draws_ahead) {
      work.draws.push_back(
          {t->slot, &t->generate->sampling, &t->rng, &t->recent, t->generate->logprobs});
      // A constrained stream's next mask is known now (its matcher already took the
      // pending token): the step draws under it, into the buffer SampleAndEmit fills
      // again with the same mask (the masker caches it).
      const constraints::Matcher* matcher = t->s->stream.matcher();
      if (matcher != nullptr && Masker().Allowed(*matcher, &t->allowed) > 0) {
        work.draws.back().allowed = t->allowed.data();
      }
    }
    if (work.multi.steps > 1) work.multi.limits.push_back(TokensPerLaunch(*t, steps));
  }
  const StepResult stepped = runner_.Step(work);
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

int64_t StreamDriver::TokensPerLaunch(const Task& t, int64_t steps) const {
  const ScheduledTask& s = *t.s;
  const StreamTask& stream = s.stream;
  if (s.cancelled || stream.done_sampling() || t.generate->sampling.repetition_penalty != 1.0f ||
      t.generate->sampling.AdjustsLogits() || t.generate->top_logprobs > 0 ||
      t.generate->constraint != nullptr) {
    // The penalty window, the counts and the alternatives are the host's.
    return 1;
  }
  // A session's state must hold exactly the tokens its client was sent, and a rollback
  // restores a row saved where a chunk began. A session stream therefore draws ahead
  // only where no rollback point can fall inside the launch: it has no stop strings
  // (found on the host, after the launch absorbed what followed them; an end-of-text
  // token stops the row on the device, unabsorbed, as a single step leaves it), and its
  // pending token already sits in an unsent chunk behind a write in flight, so every
  // token of the launch joins that chunk (nothing is emitted before the write returns,
  // an event between iterations) and its saved row undoes them all. A throwaway stream's
  // state is dropped with it, so it may absorb tokens past a stop string.
  if (!t.session_id.empty() &&
      (!stream.limits().stop.empty() || !stream.write_in_flight() || !stream.has_unsent())) {
    return 1;
  }
  // What the stream may still sample after this step: its lookahead room (nothing is
  // confirmed during the launch) and its max tokens.
  const int64_t room =
      std::min(stream.limits().lookahead - stream.inflight_tokens() - stream.unsent_tokens(),
               stream.limits().max_tokens - stream.sampled());
  return std::clamp<int64_t>(room, 1, steps);
}

void StreamDriver::TakeTokensAhead(TaskId id, const std::vector<SampledToken>& ahead) {
  Tick();
  const absl::Time now = now_;
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
    t->Remember(t->pending_token);
    ++t->tokens;
    t->pending_token = -1;
    Apply(scheduler_.AfterStep({id}));
  }
}

const constraints::TokenMasker& StreamDriver::Masker() {
  if (masker_ == nullptr) {
    const int64_t vocab = model_.config().vocab_size;
    std::vector<std::string> pieces(static_cast<size_t>(vocab));
    for (int64_t id = 0; id < vocab; ++id) {
      if (id == tokenizer_.end_of_text()) continue;  // no bytes: allowed by its own rule
      pieces[static_cast<size_t>(id)] = std::string(tokenizer_.TokenBytesView(id));
    }
    // Its mask cache at most 64 MiB per model (about 8,000 grammar states of a
    // 65,536-token vocabulary; the least recently used schemas' dropped first).
    constexpr size_t kMaskCacheBytes = size_t{64} << 20;
    masker_ = std::make_unique<constraints::TokenMasker>(std::move(pieces),
                                                         tokenizer_.end_of_text(), kMaskCacheBytes);
  }
  return *masker_;
}

void StreamDriver::SampleAndEmit() {
  // A stream whose lease expired may be another request's now: its write would be
  // refused, so it stops here (FinishTask answers ABORTED).
  std::vector<Task*> lost;
  for (const ScheduledTask* s : scheduler_.InPhase(ScheduledTask::Phase::kReadyToSample)) {
    if (s->Parked()) continue;
    Task& t = *tasks_.at(s->id);
    if (t.item->ticket != nullptr && t.item->ticket->lost.load()) lost.push_back(&t);
  }
  for (Task* t : lost) FinishTask(*t, FinishReason::kCancelled);
  std::vector<Action> ended;
  std::vector<TaskId> sampling_ids = scheduler_.PlanSample(&ended);
  Apply(std::move(ended));
  if (sampling_ids.empty()) return;
  std::vector<Task*> sampling;
  for (TaskId id : sampling_ids) {
    Task* t = tasks_.at(id).get();
    sampling.push_back(t);
    if (t->generate->choice.count > 1 && t->generate->choice.index == 0 &&
        t->s->stream.sampled() == 0) {
      SaveChoiceRow(*t);
    }
    if (t->s->stream.starts_chunk()) {
      // Only a session's state outlives the stream: a throwaway stream's rollback point
      // is its token count alone (copying the state row for every message was a quarter
      // of the engine thread's time on fast_weight at 64 streams; docs/benchmarks.md).
      if (!t->session_id.empty()) pool_.SaveRow(t->slot, &t->before_unsent.row);
      t->before_unsent.tokens = t->tokens;
    }
  }
  // Constrained streams: the tokens that may come next. One that can take none ends
  // (the scheduler drains it as after a stop string), the others sample.
  std::vector<TaskId> cannot_continue;
  for (size_t i = 0; i < sampling.size();) {
    const constraints::Matcher* matcher = sampling[i]->s->stream.matcher();
    if (matcher != nullptr && Masker().Allowed(*matcher, &sampling[i]->allowed) == 0) {
      cannot_continue.push_back(sampling_ids[i]);
      sampling.erase(sampling.begin() + static_cast<std::ptrdiff_t>(i));
      sampling_ids.erase(sampling_ids.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  for (TaskId id : cannot_continue) Apply(scheduler_.EndSampling(id));
  if (sampling.empty()) return;
  SampleWork work;
  work.requests.resize(sampling.size());
  for (size_t i = 0; i < sampling.size(); ++i) {
    Task* t = sampling[i];
    work.requests[i] = {t->slot, &t->generate->sampling, &t->rng, &t->recent,
                        t->generate->logprobs};
    if (t->generate->logprobs) work.requests[i].top_logprobs = t->generate->top_logprobs;
    if (t->s->stream.matcher() != nullptr) work.requests[i].allowed = t->allowed.data();
  }
  const StepResult sampled = runner_.Sample(work);
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
  Tick();
  Apply(scheduler_.AfterSample(sampling_ids, tokens, logprobs, now_, &sampled.alternatives));
}

std::unique_ptr<WorkItem> StreamDriver::TakeTask(Task& t) {
  std::unique_ptr<WorkItem> item = std::move(t.item);
  drain_->StreamEnded();
  if (const GenerateWork* generate = item->As<GenerateWork>()) {
    tasks_by_stream_.erase(generate->stream_id);
    const GenerateParams::Choice& choice = generate->params.choice;
    if (choice.count > 1 && choice.index == 0) {
      auto group = choice_groups_.find(choice.group);
      if (group == choice_groups_.end() || !group->second.ready) {
        FailChoiceGroup(choice, absl::AbortedError("n: the request's first choice ended before its "
                                                   "prompt was read"));
      }
    }
  }
  const TaskId id = t.s->id;
  scheduler_.Remove(id);
  tasks_.erase(id);  // `t` is gone
  return item;
}

void StreamDriver::FinishTask(Task& t, FinishReason reason) {
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

void StreamDriver::FailTask(Task& t, absl::Status status) {
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

void StreamDriver::RestoreSnapshot(Task& t) {
  pool_.SetRow(t.slot, t.snapshot, t.snapshot_logits);
  t.tokens = t.tokens_before;
}

void StreamDriver::EndAll() {
  const absl::Status shutting_down = absl::UnavailableError("the server is shutting down");
  for (std::unique_ptr<WorkItem>& item : released_choices_)
    FailItem(std::move(item), shutting_down);
  released_choices_.clear();
  for (auto& [id, group] : choice_groups_) {
    for (std::unique_ptr<WorkItem>& item : group.waiting) FailItem(std::move(item), shutting_down);
    group.waiting.clear();
  }
  Apply(scheduler_.CancelAll());
}

bool StreamDriver::HoldChoice(std::unique_ptr<WorkItem>& item) {
  const GenerateWork* generate = item->As<GenerateWork>();
  if (generate == nullptr || generate->params.choice.index == 0) return false;
  ChoiceGroup& group = GroupOf(generate->params.choice);
  if (group.ready) {
    // Counted now, so that a choice whose admission fails later counts as arrived too.
    ++group.arrived;
    return false;  // AdmitStream starts it from the group's row
  }
  if (!group.failed.ok()) {
    ++group.arrived;
    FailItem(std::move(item), group.failed);
    DropSettledChoiceGroups();
    return true;
  }
  group.waiting.push_back(std::move(item));
  return true;
}

StreamDriver::ChoiceGroup& StreamDriver::GroupOf(const GenerateParams::Choice& choice) {
  ChoiceGroup& group = choice_groups_[choice.group];
  group.expected = choice.count - 1;
  return group;
}

void StreamDriver::SaveChoiceRow(Task& t) {
  ChoiceGroup& group = GroupOf(t.generate->choice);
  if (group.ready || !group.failed.ok()) return;
  pool_.SaveRow(t.slot, &group.row);
  group.tokens = t.tokens;
  group.recent = t.recent;
  group.ready = true;
  group.settled = absl::Now();
  for (std::unique_ptr<WorkItem>& item : group.waiting)
    released_choices_.push_back(std::move(item));
  group.waiting.clear();
}

void StreamDriver::FailChoiceGroup(const GenerateParams::Choice& choice,
                                   const absl::Status& status) {
  ChoiceGroup& group = GroupOf(choice);
  group.failed = status;
  group.settled = absl::Now();
  for (std::unique_ptr<WorkItem>& item : group.waiting) {
    ++group.arrived;
    FailItem(std::move(item), status);
  }
  group.waiting.clear();
  DropSettledChoiceGroups();
}

void StreamDriver::DropSettledChoiceGroups() {
  // A choice refused on its way (a quota, a full queue) never arrives; its group's row
  // is dropped after this long, and a choice arriving later fails.
  constexpr absl::Duration kSettledLifetime = absl::Seconds(60);
  const absl::Time now = absl::Now();
  for (auto& [id, g] : choice_groups_) {
    if (g.ready && g.arrived < g.expected && now - g.settled > kSettledLifetime) {
      // Its row is freed; what remains marks the group as over for a late choice.
      g.ready = false;
      g.row = StatePool::RowCopy();
      g.failed = absl::AbortedError("n: the request's choices did not all start in time");
    }
  }
  absl::erase_if(choice_groups_, [&](const auto& entry) {
    const ChoiceGroup& g = entry.second;
    return (g.ready || !g.failed.ok()) && g.waiting.empty() && g.arrived >= g.expected;
  });
}

}  // namespace fwserve
