// The engine's Scheduler without a model, a clock or gRPC (in the style of vLLM's
// tests/v1/core/test_scheduler.py): plans are plain data, results go back through the
// After*/On* calls, and each test checks the decisions that come out.
#include "server/engine/scheduler.h"

#include <algorithm>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fwserve {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using Phase = ScheduledTask::Phase;

const absl::Time kSchedulerT0 = absl::FromUnixSeconds(1000);

StreamLimits Limits(int64_t max_tokens, int64_t lookahead = 16) {
  StreamLimits limits;
  limits.max_tokens = max_tokens;
  limits.lookahead = lookahead;
  return limits;
}

SchedulerOptions Options(int64_t slots = 4, int64_t chunk = 8,
                         absl::Duration batch_wait = absl::Milliseconds(1)) {
  SchedulerOptions options;
  options.max_active_streams = slots;
  options.prefill_chunk_tokens = chunk;
  options.batch_wait = batch_wait;
  return options;
}

// Adds and starts a Generate with `prompt` tokens.
TaskId AddGenerate(Scheduler& s, TaskId id, const std::string& tenant, size_t prompt,
                   int64_t max_tokens, int64_t lookahead = 16) {
  s.Add(id, TaskKind::kGenerate, tenant);
  EXPECT_THAT(s.Start(id, prompt, Limits(max_tokens, lookahead)), IsEmpty());
  return id;
}

// Runs prefill chunks until no task is in kPrefill.
void PrefillAll(Scheduler& s) {
  while (auto chunk = s.PlanPrefill()) EXPECT_THAT(s.AfterPrefill(*chunk, true), IsEmpty());
}

// Samples every row PlanSample names (token 7 each) and returns the actions.
std::vector<Action> SampleAll(Scheduler& s, absl::Time now, std::vector<TaskId>* sampled) {
  std::vector<Action> ended;
  *sampled = s.PlanSample(&ended);
  EXPECT_THAT(ended, IsEmpty());
  std::vector<int64_t> tokens(sampled->size(), 'a');
  std::vector<float> logprobs(sampled->size(), -0.5f);
  return s.AfterSample(*sampled, tokens, logprobs, now);
}

std::vector<TaskId> Ids(const std::vector<Action>& actions, Action::Kind kind) {
  std::vector<TaskId> ids;
  for (const Action& a : actions) {
    if (a.kind == kind) ids.push_back(a.id);
  }
  return ids;
}

// --- Prefill and decode under a token budget.

// --prefill-batch-tokens: a wider budget over tasks, each piece still at most
// prefill_chunk_tokens.
TEST(SchedulerTest, PrefillBatchesPiecesUpToTheBatchBudgetEachUpToTheChunk) {
  SchedulerOptions options = Options(/*slots=*/16, /*chunk=*/4);
  options.prefill_batch_tokens = 12;
  Scheduler s(options);
  for (TaskId id = 1; id <= 5; ++id) AddGenerate(s, id, "a", 6, 1);
  auto first = s.PlanPrefill();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->length, 4u);                     // a piece is at most the chunk
  EXPECT_THAT(first->tasks, ElementsAre(1, 2, 3));  // 3 x 4 = 12 tokens
  EXPECT_THAT(s.AfterPrefill(*first, true), IsEmpty());
  EXPECT_EQ(s.Find(1)->prefilled, 4u);
  EXPECT_EQ(s.Find(1)->phase, Phase::kPrefill);
  // Tasks 4 and 5 have 4-token pieces next, 1-3 have 2: two lengths, two chunks.
  auto second = s.PlanPrefill();
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->tasks.size(), second->length == 4 ? 2u : 3u);
  EXPECT_THAT(s.AfterPrefill(*second, true), IsEmpty());
  PrefillAll(s);
  for (TaskId id = 1; id <= 5; ++id) EXPECT_EQ(s.Find(id)->prefilled, 6u) << id;
}

TEST(SchedulerTest, PrefillBatchesEqualPiecesUpToTheTokenBudget) {
  Scheduler s(Options(/*slots=*/8, /*chunk=*/8));
  AddGenerate(s, 1, "a", 4, 1);
  AddGenerate(s, 2, "a", 4, 1);
  AddGenerate(s, 3, "a", 4, 1);  // would make 12 tokens: waits
  AddGenerate(s, 4, "a", 3, 1);  // another length: never joins a 4-token chunk
  auto first = s.PlanPrefill();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->length, 4u);
  EXPECT_THAT(first->tasks, ElementsAre(1, 2));
  EXPECT_TRUE(s.Find(1)->in_prefill_job);
  EXPECT_FALSE(s.Find(3)->in_prefill_job);
  EXPECT_THAT(s.AfterPrefill(*first, true), IsEmpty());
  EXPECT_EQ(s.Find(1)->phase, Phase::kReadyToSample);
  EXPECT_EQ(s.Find(1)->prefilled, 4u);
  // The lead goes round robin over what is left.
  auto second = s.PlanPrefill();
  ASSERT_TRUE(second.has_value());
  auto third = second;
  EXPECT_THAT(s.AfterPrefill(*second, true), IsEmpty());
  third = s.PlanPrefill();
  ASSERT_TRUE(third.has_value());
  std::vector<TaskId> both = second->tasks;
  both.insert(both.end(), third->tasks.begin(), third->tasks.end());
  std::sort(both.begin(), both.end());
  EXPECT_THAT(both, ElementsAre(3, 4));
  EXPECT_THAT(s.AfterPrefill(*third, true), IsEmpty());
  EXPECT_FALSE(s.PlanPrefill().has_value());
}

TEST(SchedulerTest, LongPromptsGoInChunksAndAScoreRunsAlone) {
  Scheduler s(Options(/*slots=*/8, /*chunk=*/8));
  s.Add(1, TaskKind::kScore, "a");
  EXPECT_THAT(s.Start(1, 8, StreamLimits{}), IsEmpty());
  AddGenerate(s, 2, "a", 20, 1);
  auto score = s.PlanPrefill();
  ASSERT_TRUE(score.has_value());
  EXPECT_TRUE(score->score);
  EXPECT_THAT(score->tasks, ElementsAre(1));
  // A Score ends once its text is in.
  std::vector<Action> done = s.AfterPrefill(*score, true);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].kind, Action::Kind::kFinish);
  EXPECT_EQ(done[0].reason, FinishReason::kLength);
  s.Remove(1);
  std::vector<size_t> lengths;
  while (auto chunk = s.PlanPrefill()) {
    lengths.push_back(chunk->length);
    EXPECT_THAT(s.AfterPrefill(*chunk, true), IsEmpty());
  }
  EXPECT_THAT(lengths, ElementsAre(8, 8, 4));
  EXPECT_EQ(s.Find(2)->phase, Phase::kReadyToSample);
}

TEST(SchedulerTest, DecodeRunsBesideAPrefillInFlight) {
  Scheduler s(Options());
  AddGenerate(s, 1, "a", 1, 5);
  PrefillAll(s);
  AddGenerate(s, 2, "a", 100, 5);
  auto chunk = s.PlanPrefill();  // task 2's first chunk is on the prefill thread
  ASSERT_TRUE(chunk.has_value());
  std::vector<TaskId> sampled;
  std::vector<Action> emitted = SampleAll(s, kSchedulerT0, &sampled);
  EXPECT_THAT(sampled, ElementsAre(1));
  EXPECT_THAT(Ids(emitted, Action::Kind::kEmit), ElementsAre(1));
  EXPECT_THAT(s.PlanStep(kSchedulerT0), ElementsAre(1));
  EXPECT_THAT(s.AfterStep({1}), IsEmpty());
  EXPECT_EQ(s.Find(1)->phase, Phase::kReadyToSample);
  EXPECT_EQ(s.Find(2)->phase, Phase::kPrefill);
  // While the chunk is out, prefill is no work for the loop; the ready sample is.
  EXPECT_TRUE(s.ReadinessAfterIteration(/*prefill_in_flight=*/true).immediate);
}

TEST(SchedulerTest, AGenerateWithNothingToDoFinishesAtStart) {
  Scheduler s(Options());
  s.Add(1, TaskKind::kGenerate, "a");
  std::vector<Action> actions = s.Start(1, 0, Limits(0));
  ASSERT_EQ(actions.size(), 1u);
  EXPECT_EQ(actions[0].kind, Action::Kind::kFinish);
  // A CreateSession with a prefix samples nothing, whatever limits it is given.
  s.Add(2, TaskKind::kCreate, "a");
  EXPECT_THAT(s.Start(2, 3, Limits(50)), IsEmpty());
  auto chunk = s.PlanPrefill();
  ASSERT_TRUE(chunk.has_value());
  EXPECT_THAT(Ids(s.AfterPrefill(*chunk, true), Action::Kind::kFinish), ElementsAre(2));
}

// --- The batch deadline.

TEST(SchedulerTest, AStepWaitsBatchWaitForStreamsStillWriting) {
  Scheduler s(Options(4, 8, absl::Milliseconds(2)));
  AddGenerate(s, 1, "a", 1, 10, /*lookahead=*/1);
  AddGenerate(s, 2, "a", 1, 10, /*lookahead=*/1);
  PrefillAll(s);
  std::vector<TaskId> sampled;
  SampleAll(s, kSchedulerT0, &sampled);
  EXPECT_THAT(s.PlanStep(kSchedulerT0), ElementsAre(1, 2));
  EXPECT_THAT(s.AfterStep({1, 2}), IsEmpty());
  // Both wrote their token; lookahead 1: blocked until a write returns.
  EXPECT_EQ(s.Find(1)->phase, Phase::kBlocked);
  EXPECT_THAT(s.OnWriteDone(1, true, kSchedulerT0), IsEmpty());
  EXPECT_EQ(s.Find(1)->phase, Phase::kReadyToSample);
  SampleAll(s, kSchedulerT0, &sampled);
  EXPECT_THAT(sampled, ElementsAre(1));
  // Stream 2 is still writing: the step waits for it, up to batch_wait.
  EXPECT_THAT(s.PlanStep(kSchedulerT0), IsEmpty());
  EXPECT_EQ(s.batch_deadline(), kSchedulerT0 + absl::Milliseconds(2));
  EXPECT_FALSE(s.ReadinessAfterIteration(false).immediate);
  EXPECT_THAT(s.PlanStep(kSchedulerT0 + absl::Milliseconds(1)), IsEmpty());
  EXPECT_THAT(s.PlanStep(kSchedulerT0 + absl::Milliseconds(2)), ElementsAre(1));
  EXPECT_EQ(s.batch_deadline(), absl::InfiniteFuture());
}

// --- Lookahead and rollback.

TEST(SchedulerTest, LookaheadBoundsUnconfirmedTokensAndAFailedWriteEndsTheStream) {
  Scheduler s(Options());
  AddGenerate(s, 1, "a", 2, 100, /*lookahead=*/3);
  PrefillAll(s);
  int emitted = 0;
  for (int i = 0; i < 3; ++i) {
    std::vector<TaskId> sampled;
    emitted +=
        static_cast<int>(Ids(SampleAll(s, kSchedulerT0, &sampled), Action::Kind::kEmit).size());
    ASSERT_THAT(sampled, ElementsAre(1)) << i;
    ASSERT_THAT(s.PlanStep(kSchedulerT0), ElementsAre(1));
    EXPECT_THAT(s.AfterStep({1}), IsEmpty());
  }
  // The first token went out at once; two wait unsent behind the write in flight.
  EXPECT_EQ(emitted, 1);
  EXPECT_EQ(s.Find(1)->phase, Phase::kBlocked);
  EXPECT_EQ(s.Find(1)->stream.sampled(), 3);
  // The write returns: confirmed, and the unsent two go out as one chunk.
  std::vector<Action> after = s.OnWriteDone(1, true, kSchedulerT0);
  ASSERT_THAT(Ids(after, Action::Kind::kEmit), ElementsAre(1));
  EXPECT_EQ(after[0].chunk.token_ids.size(), 2u);
  EXPECT_EQ(s.Find(1)->stream.confirmed(), 1);
  // That write fails: the stream ends as cancelled, for the engine to roll back.
  std::vector<Action> failed = s.OnWriteDone(1, false, kSchedulerT0);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].kind, Action::Kind::kFinish);
  EXPECT_EQ(failed[0].reason, FinishReason::kCancelled);
  EXPECT_EQ(s.Find(1)->stream.DropUnconfirmed(), StreamTask::RollbackPoint::kBeforeInflight);
}

// A constrained stream that no token can continue ends as after a stop string: with a
// write in flight it drains and finishes (kStop) when the write returns; with nothing in
// flight it finishes at once.
TEST(SchedulerTest, AStreamWhoseNextTokenCannotBeDrawnEndsAsAfterAStop) {
  Scheduler s(Options());
  AddGenerate(s, 1, "a", 1, 100);
  PrefillAll(s);
  std::vector<TaskId> sampled;
  EXPECT_THAT(Ids(SampleAll(s, kSchedulerT0, &sampled), Action::Kind::kEmit), ElementsAre(1));
  ASSERT_THAT(s.PlanStep(kSchedulerT0), ElementsAre(1));
  EXPECT_THAT(s.AfterStep({1}), IsEmpty());
  std::vector<Action> ended;
  ASSERT_THAT(s.PlanSample(&ended), ElementsAre(1));
  EXPECT_THAT(s.EndSampling(1), IsEmpty());  // the first token's write is in flight
  EXPECT_EQ(s.Find(1)->phase, Phase::kDraining);
  EXPECT_TRUE(s.Find(1)->stream.done_sampling());
  std::vector<Action> done = s.OnWriteDone(1, true, kSchedulerT0);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].kind, Action::Kind::kFinish);
  EXPECT_EQ(done[0].reason, FinishReason::kStop);

  AddGenerate(s, 2, "a", 1, 100);
  PrefillAll(s);
  ASSERT_THAT(s.PlanSample(&ended), ElementsAre(2));  // nothing sampled, nothing in flight
  std::vector<Action> at_once = s.EndSampling(2);
  ASSERT_EQ(at_once.size(), 1u);
  EXPECT_EQ(at_once[0].kind, Action::Kind::kFinish);
  EXPECT_EQ(at_once[0].reason, FinishReason::kStop);
}

TEST(SchedulerTest, AStreamDoneSamplingDrainsUntilItsLastWrite) {
  Scheduler s(Options());
  AddGenerate(s, 1, "a", 1, 1);
  PrefillAll(s);
  std::vector<TaskId> sampled;
  EXPECT_THAT(Ids(SampleAll(s, kSchedulerT0, &sampled), Action::Kind::kEmit), ElementsAre(1));
  ASSERT_THAT(s.PlanStep(kSchedulerT0), ElementsAre(1));
  EXPECT_THAT(s.AfterStep({1}), IsEmpty());
  EXPECT_EQ(s.Find(1)->phase, Phase::kDraining);
  std::vector<Action> done = s.OnWriteDone(1, true, kSchedulerT0);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].reason, FinishReason::kLength);
}

// --- Cancellation mid-plan.

TEST(SchedulerTest, ACancelWhileTheChunkRunsEndsTheTaskWhenItReturns) {
  Scheduler s(Options());
  AddGenerate(s, 1, "a", 4, 5);
  auto chunk = s.PlanPrefill();
  ASSERT_TRUE(chunk.has_value());
  // Its rows are on the prefill thread: nothing ends yet.
  EXPECT_THAT(s.OnCancel(1), IsEmpty());
  std::vector<Action> after = s.AfterPrefill(*chunk, true);
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0].kind, Action::Kind::kFinish);
  EXPECT_EQ(after[0].reason, FinishReason::kCancelled);
  s.Remove(1);  // the engine ended it
  // A CreateSession cut by shutdown mid-chunk fails instead (its state would be partial).
  s.Add(2, TaskKind::kCreate, "a");
  EXPECT_THAT(s.Start(2, 4, StreamLimits{}), IsEmpty());
  auto create = s.PlanPrefill();
  ASSERT_TRUE(create.has_value());
  ASSERT_THAT(create->tasks, ::testing::Contains(2));
  EXPECT_THAT(s.CancelAll(), ::testing::Not(::testing::Contains(::testing::Field(&Action::id, 2))));
  std::vector<Action> cut = s.AfterPrefill(*create, true);
  ASSERT_THAT(Ids(cut, Action::Kind::kFail), ::testing::Contains(2));
  for (const Action& a : cut) {
    if (a.id == 2) {
      EXPECT_EQ(a.status.code(), absl::StatusCode::kUnavailable);
    }
  }
}

TEST(SchedulerTest, ADeliveredTokenIsAbsorbedBeforeACancelEndsTheStream) {
  Scheduler s(Options());
  AddGenerate(s, 1, "a", 1, 10);
  PrefillAll(s);
  std::vector<TaskId> sampled;
  SampleAll(s, kSchedulerT0, &sampled);
  EXPECT_THAT(s.OnWriteDone(1, true, kSchedulerT0), IsEmpty());  // the client has the token
  // Ready to absorb with nothing in flight: the token is absorbed first.
  EXPECT_THAT(s.OnCancel(1), IsEmpty());
  ASSERT_THAT(s.PlanStep(kSchedulerT0), ElementsAre(1));
  std::vector<Action> after = s.AfterStep({1});
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0].reason, FinishReason::kCancelled);
}

TEST(SchedulerTest, ShutdownEndsWhatWaitsOnNothingAndLetsWritesReturn) {
  Scheduler s(Options());
  AddGenerate(s, 1, "a", 1, 10);  // will have a write in flight
  AddGenerate(s, 2, "a", 1, 10);  // ready to sample
  s.Add(3, TaskKind::kScore, "a");
  EXPECT_THAT(s.Start(3, 5, StreamLimits{}), IsEmpty());
  auto chunk = s.PlanPrefill();
  ASSERT_TRUE(chunk.has_value());
  EXPECT_THAT(s.AfterPrefill(*chunk, true), IsEmpty());
  while (auto more = s.PlanPrefill()) {
    if (more->score) break;  // leave the Score's chunk out: it is in flight
    EXPECT_THAT(s.AfterPrefill(*more, true), IsEmpty());
  }
  // Stream 1 samples and writes; stream 2 is between tokens.
  std::vector<Action> ended;
  std::vector<TaskId> ready = s.PlanSample(&ended);
  ASSERT_THAT(ready, ::testing::Contains(1));
  std::vector<Action> emitted = s.AfterSample({1}, {'a'}, {0.0f}, kSchedulerT0);
  ASSERT_THAT(Ids(emitted, Action::Kind::kEmit), ElementsAre(1));
  std::vector<Action> cut = s.CancelAll();
  // Stream 2 ends now as shut down; stream 1 waits for its write (and its token);
  // the Score waits for its chunk.
  EXPECT_THAT(Ids(cut, Action::Kind::kFinish), ElementsAre(2));
  for (const Action& a : cut) EXPECT_EQ(a.reason, FinishReason::kShutdown);
  EXPECT_TRUE(s.Find(1)->shutdown);
}

// --- Fair share and preemption.

TEST(SchedulerTest, AWaitingTenantBelowItsShareParksTheNewestStreamOfTheHeaviest) {
  Scheduler s(Options(/*slots=*/3));
  for (TaskId id : {1, 2, 3}) AddGenerate(s, id, "heavy", 1, 100);
  PrefillAll(s);
  EXPECT_EQ(s.Running(), 3);
  // Nobody waits: nothing is parked.
  EXPECT_FALSE(s.PreemptForFairShare(3, {}).has_value());
  // A tenant with nothing running waits: "heavy" holds 3 of 3 slots over 2 tenants.
  auto parked = s.PreemptForFairShare(3, {"light"});
  ASSERT_TRUE(parked.has_value());
  EXPECT_EQ(*parked, 3u);  // the newest
  EXPECT_EQ(s.Running(), 2);
  EXPECT_EQ(s.RunningByTenant().at("heavy"), 2);
  // Parked streams are neither sampled nor stepped.
  std::vector<Action> ended;
  EXPECT_THAT(s.PlanSample(&ended), ElementsAre(1, 2));
  // A waiting tenant at or above its share parks nobody.
  AddGenerate(s, 4, "light", 1, 100);
  PrefillAll(s);
  EXPECT_FALSE(s.PreemptForFairShare(3, {"heavy"}).has_value());
  // When a slot frees, the parked stream resumes, oldest first.
  s.Remove(1);
  EXPECT_EQ(s.ResumeParked(s.Running()), 3);
  EXPECT_FALSE(s.Find(3)->parked);
}

TEST(SchedulerTest, APromptInPrefillIsNeverParkedAndACancelledStreamIsNeverHeld) {
  Scheduler s(Options(/*slots=*/2));
  AddGenerate(s, 1, "heavy", 1, 100);
  AddGenerate(s, 2, "heavy", 50, 100);
  auto chunk = s.PlanPrefill();  // stream 1's prompt is in; stream 2 is mid-prompt
  ASSERT_TRUE(chunk.has_value());
  EXPECT_THAT(s.AfterPrefill(*chunk, true), IsEmpty());
  auto parked = s.PreemptForFairShare(2, {"light"});
  ASSERT_TRUE(parked.has_value());
  EXPECT_EQ(*parked, 1u);  // not the prefilling stream 2
  // A parked stream that is cancelled is no longer held: it can end.
  EXPECT_TRUE(s.Find(1)->Parked());
  EXPECT_FALSE(s.OnCancel(1).empty());
  EXPECT_FALSE(s.Find(1)->Parked());
}

TEST(SchedulerTest, FairShareCountsEachTenantsRunningStreams) {
  Scheduler s(Options(/*slots=*/8));
  AddGenerate(s, 1, "a", 1, 5);
  AddGenerate(s, 2, "a", 1, 5);
  AddGenerate(s, 3, "b", 1, 5);
  auto running = s.RunningByTenant();
  EXPECT_EQ(running.at("a"), 2);
  EXPECT_EQ(running.at("b"), 1);
  // Slots are not all taken: nobody is parked whoever waits.
  EXPECT_FALSE(s.PreemptForFairShare(3, {"c"}).has_value());
}

}  // namespace
}  // namespace fwserve
