// The Runner's overlapped steps (EngineOptions::overlap_steps, --overlap-steps), with a
// step held on the step thread by the test: Launch returns while the step runs, the
// engine's side can hand a prefill chunk out and get it back meanwhile, and Wait then
// gives the step's result, the same rows and logits as a runner that steps inside
// Launch. AbandonStep waits for a step in flight.
#include "server/engine/runner.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <vector>

#include "absl/synchronization/notification.h"
#include "tests/unit/test_models.h"

namespace fwserve {
namespace {

using fwmodel::Architecture;
using fwmodel::FfnKind;

class RunnerTest : public ::testing::Test {
 protected:
  RunnerTest()
      : model_(fwtest::RandomModel(fwtest::TinyConfig(Architecture::kFastWeight, FfnKind::kRelu, 3),
                                   7, torch::kFloat32)) {}

  // Three fresh rows of `runner`'s pool.
  static std::vector<int> ThreeRows(Runner& runner) {
    std::vector<int> rows;
    StatePool::Shortage shortage;
    for (int i = 0; i < 3; ++i) {
      auto slot = runner.pool().TryAllocate(&shortage);
      EXPECT_TRUE(slot.has_value());
      if (!slot) return rows;
      runner.pool().Reset(*slot);
      rows.push_back(*slot);
    }
    return rows;
  }

  c10::NoGradGuard no_grad_;
  fwmodel::Model model_;
  StateMemoryBudget budget_{int64_t{1} << 30};
};

TEST_F(RunnerTest, AnOverlappedStepRunsWhileTheEngineSideHandsOutAPrefillChunk) {
  EngineOptions sync_options;
  Runner sync_runner(model_, sync_options, &budget_, "sync");
  EXPECT_FALSE(sync_runner.overlaps_steps());

  EngineOptions overlap_options;
  overlap_options.overlap_steps = true;
  absl::Notification step_started, release_step;
  std::atomic<int> steps_started{0};
  overlap_options.step_started_for_testing = [&] {
    if (steps_started.fetch_add(1) == 0) {
      step_started.Notify();
      release_step.WaitForNotification();
    }
  };
  Runner runner(model_, overlap_options, &budget_, "overlap");
  ASSERT_TRUE(runner.overlaps_steps());

  const std::vector<int> sync_rows = ThreeRows(sync_runner);
  const std::vector<int> rows = ThreeRows(runner);
  ASSERT_EQ(rows.size(), 3u);
  ASSERT_EQ(sync_rows.size(), 3u);
  const std::vector<int64_t> tokens = {5, 7};

  StepWork work;
  work.rows = {rows[0], rows[1]};
  work.tokens = tokens;
  const Runner::Handle handle = runner.Launch(work);
  // Launch returned; the step is held on the step thread.
  step_started.WaitForNotification();

  // The engine's side meanwhile: a prefill chunk on the third row's copy, out and back.
  absl::Notification prefill_done;
  runner.StartPrefillThread([&] { prefill_done.Notify(); });
  PrefillWork prefill;
  prefill.rows = torch::tensor({static_cast<int64_t>(rows[2])}, torch::kInt64);
  prefill.state = runner.pool().Gather(prefill.rows);
  prefill.tokens = torch::tensor({{1, 2, 3, 4}}, torch::kInt64);
  runner.LaunchPrefill(&prefill);
  EXPECT_TRUE(prefill_done.WaitForNotificationWithTimeout(absl::Seconds(30)))
      << "the prefill chunk did not finish while the step was held";
  EXPECT_TRUE(prefill.status.ok()) << prefill.status;
  EXPECT_FALSE(release_step.HasBeenNotified());  // the step was still in flight

  release_step.Notify();
  const StepResult stepped = runner.Wait(handle);
  ASSERT_TRUE(stepped.status.ok()) << stepped.status;
  runner.StopPrefillThread();

  StepWork sync_work;
  sync_work.rows = {sync_rows[0], sync_rows[1]};
  sync_work.tokens = tokens;
  const StepResult sync_stepped = sync_runner.Wait(sync_runner.Launch(sync_work));
  ASSERT_TRUE(sync_stepped.status.ok()) << sync_stepped.status;
  for (int i = 0; i < 2; ++i) {
    const fwmodel::State got = runner.pool().CopyRow(rows[i]);
    const fwmodel::State want = sync_runner.pool().CopyRow(sync_rows[i]);
    for (size_t t = 0; t < got.tensors.size(); ++t) {
      EXPECT_TRUE(torch::equal(got.tensors[t], want.tensors[t])) << "row " << i << " tensor " << t;
    }
    EXPECT_TRUE(torch::equal(runner.pool().CopyLogits(rows[i]),
                             sync_runner.pool().CopyLogits(sync_rows[i])))
        << "logits of row " << i;
  }
  // The prefilled row's pool state is untouched: the chunk ran on a copy.
  const fwmodel::State third = runner.pool().CopyRow(rows[2]);
  const fwmodel::State fresh = sync_runner.pool().CopyRow(sync_rows[2]);
  for (size_t t = 0; t < third.tensors.size(); ++t) {
    EXPECT_TRUE(torch::equal(third.tensors[t], fresh.tensors[t])) << "tensor " << t;
  }
}

TEST_F(RunnerTest, AbandonStepWaitsForTheStepInFlight) {
  EngineOptions options;
  options.overlap_steps = true;
  absl::Notification step_started;
  std::atomic<bool> step_ended{false};
  options.step_started_for_testing = [&] {
    step_started.Notify();
    absl::SleepFor(absl::Milliseconds(200));
    step_ended.store(true);
  };
  Runner runner(model_, options, &budget_, "overlap");
  const std::vector<int> rows = ThreeRows(runner);
  ASSERT_EQ(rows.size(), 3u);
  StepWork work;
  work.rows = {rows[0]};
  work.tokens = {3};
  runner.Launch(work);
  step_started.WaitForNotification();
  runner.AbandonStep();
  EXPECT_TRUE(step_ended.load()) << "AbandonStep returned while the step ran";
}

}  // namespace
}  // namespace fwserve
