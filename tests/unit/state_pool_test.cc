// StatePool: slots, growth up to the slot limit, the shared memory budget, and row
// copies, on a small random model.
#include <gtest/gtest.h>

#include <set>

#include "server/engine/state_pool.h"
#include "server/engine/stepper.h"
#include "tests/unit/test_models.h"

namespace fwserve {
namespace {

using fwmodel::Architecture;
using fwmodel::FfnKind;

class StatePoolTest : public ::testing::Test {
 protected:
  StatePoolTest()
      : model_(fwtest::RandomModel(fwtest::TinyConfig(Architecture::kFastWeight, FfnKind::kRelu, 3),
                                   7, torch::kFloat32)) {}
  c10::NoGradGuard no_grad_;
  fwmodel::Model model_;
};

TEST_F(StatePoolTest, AllocatesUpToTheSlotLimitAndReusesFreedSlots) {
  StateMemoryBudget budget(int64_t{1} << 40);
  StatePool pool(model_, 20, &budget);
  StatePool::Shortage shortage;
  std::set<int> slots;
  for (int i = 0; i < 20; ++i) {
    auto slot = pool.TryAllocate(&shortage);
    ASSERT_TRUE(slot.has_value()) << i;
    EXPECT_TRUE(slots.insert(*slot).second);
  }
  EXPECT_EQ(pool.capacity(), 20);  // grew 16 -> 20, capped at the limit
  EXPECT_EQ(pool.slots_in_use(), 20);
  EXPECT_FALSE(pool.TryAllocate(&shortage).has_value());
  EXPECT_EQ(shortage, StatePool::Shortage::kSlots);
  pool.Free(5);
  auto again = pool.TryAllocate(&shortage);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(*again, 5);
}

TEST_F(StatePoolTest, TheBudgetIsSharedAndReleased) {
  const int64_t bytes = model_.state_bytes_per_session();
  StateMemoryBudget budget(3 * bytes);
  StatePool a(model_, 100, &budget), b(model_, 100, &budget);
  StatePool::Shortage shortage;
  ASSERT_TRUE(a.TryAllocate(&shortage).has_value());
  ASSERT_TRUE(a.TryAllocate(&shortage).has_value());
  auto last = b.TryAllocate(&shortage);
  ASSERT_TRUE(last.has_value());
  EXPECT_FALSE(b.TryAllocate(&shortage).has_value());
  EXPECT_EQ(shortage, StatePool::Shortage::kBudget);
  EXPECT_FALSE(a.TryAllocate(&shortage).has_value());
  b.Free(*last);
  EXPECT_TRUE(a.TryAllocate(&shortage).has_value());
  budget.RequestReclaim(bytes);
  EXPECT_EQ(budget.reclaim_wanted(), bytes);
  budget.Reclaimed(bytes);
  EXPECT_EQ(budget.reclaim_wanted(), 0);
}

TEST_F(StatePoolTest, RowsCopyResetAndRoundTrip) {
  StateMemoryBudget budget(int64_t{1} << 40);
  StatePool pool(model_, 8, &budget);
  StatePool::Shortage shortage;
  const int a = *pool.TryAllocate(&shortage);
  const int b = *pool.TryAllocate(&shortage);
  pool.Reset(a);
  pool.Reset(b);
  // Advance row a by a few tokens through the batched path.
  torch::Tensor rows = pool.Index(a);
  fwmodel::State state = pool.Gather(rows);
  auto logits = model_.Forward(fwtest::RandomTokens(1, 6, 256, 3), &state);
  ASSERT_TRUE(logits.ok());
  pool.Scatter(rows, state);
  pool.SetLogits(rows, logits->select(1, 5));
  // A copy is private: changing the pool afterwards does not change it.
  fwmodel::State copy = pool.CopyRow(a);
  torch::Tensor copied_logits = pool.CopyLogits(a);
  pool.Reset(a);
  EXPECT_TRUE(torch::equal(pool.logits(a), torch::zeros_like(copied_logits)));
  EXPECT_FALSE(torch::equal(copy.tensors[0], pool.CopyRow(a).tensors[0]));
  // SetRow puts it back exactly; CopySlot duplicates it.
  pool.SetRow(a, copy, copied_logits);
  pool.CopySlot(a, b);
  for (int slot : {a, b}) {
    fwmodel::State row = pool.CopyRow(slot);
    for (size_t i = 0; i < row.tensors.size(); ++i) {
      EXPECT_TRUE(torch::equal(row.tensors[i], copy.tensors[i])) << slot << " " << i;
    }
    EXPECT_TRUE(torch::equal(pool.logits(slot), copied_logits));
  }
  // Reset gives the initial state.
  pool.Reset(b);
  fwmodel::State fresh = pool.CopyRow(b);
  for (size_t i = 0; i < fresh.tensors.size(); ++i) {
    EXPECT_TRUE(torch::equal(fresh.tensors[i], pool.fresh_row().tensors[i]));
  }
}

TEST_F(StatePoolTest, APreallocatedPoolKeepsItsStorageAndAPadRowNoSlotGets) {
  StateMemoryBudget budget(int64_t{1} << 40);
  StatePool pool(model_, 6, &budget, /*preallocate=*/true);
  ASSERT_TRUE(pool.preallocated());
  EXPECT_EQ(pool.pad_row(), 6);
  EXPECT_EQ(pool.mutable_state()->tensors[0].size(0), 7);
  EXPECT_EQ(pool.all_logits().size(0), 7);
  const void* storage = pool.mutable_state()->tensors[0].data_ptr();
  StatePool::Shortage shortage;
  std::set<int> slots;
  for (int i = 0; i < 6; ++i) {
    auto slot = pool.TryAllocate(&shortage);
    ASSERT_TRUE(slot.has_value()) << i;
    EXPECT_NE(*slot, pool.pad_row());
    slots.insert(*slot);
    pool.Reset(*slot);
  }
  EXPECT_EQ(slots.size(), 6u);
  EXPECT_FALSE(pool.TryAllocate(&shortage).has_value());
  EXPECT_EQ(shortage, StatePool::Shortage::kSlots);
  EXPECT_EQ(pool.mutable_state()->tensors[0].data_ptr(), storage);
}

// The in-place graph step draws each stepped row's next token inside the step
// (Stepper::Step with draws); Sample hands it out for the same request only, advancing
// the generator as SampleToken would. A draw not taken in the engine's iteration is
// forgotten (Runner::EndIteration): the row may be another stream's by the next.
TEST_F(StatePoolTest, TheStepsDrawsAreHandedOutOnceForTheirOwnRequest) {
  StateMemoryBudget budget(int64_t{1} << 40);
  StatePool pool(model_, 4, &budget, /*preallocate=*/true);
  Stepper stepper(model_, "graph", false, 1, 1, "test", &pool, /*sample_in_step=*/true);
  ASSERT_STREQ(stepper.kernel(), "graph");
  StatePool::Shortage shortage;
  const int slot = *pool.TryAllocate(&shortage);
  pool.Reset(slot);
  const int64_t vocab = model_.config().vocab_size;
  SamplingParams warm;
  warm.temperature = 1.5f;
  SamplingParams greedy;
  greedy.temperature = 0;
  std::vector<int64_t> recent;
  std::mt19937_64 rng(99);
  auto host_draw = [&](const SamplingParams& params, std::mt19937_64& generator) {
    const torch::Tensor row = pool.logits(slot).contiguous();
    return SampleToken(row.data_ptr<float>(), vocab, params, generator, recent);
  };
  for (int round = 0; round < 3; ++round) {
    Stepper::SampleRequest request{slot, &warm, &rng, &recent, true};
    ASSERT_TRUE(stepper.Step({slot}, {round + 1}, pool, {request}).ok());
    std::mt19937_64 expected_rng = rng;
    const int64_t expected = host_draw(warm, expected_rng);
    auto sampled = stepper.Sample({request}, pool);
    ASSERT_TRUE(sampled.ok()) << sampled.status();
    EXPECT_EQ((*sampled)[0].token, expected) << "round " << round;
    EXPECT_EQ(rng(), expected_rng()) << "the generator advanced as SampleToken's";
  }
  // Drawn for `warm`, then asked with other params: sampled afresh (greedy: argmax).
  Stepper::SampleRequest request{slot, &warm, &rng, &recent, false};
  ASSERT_TRUE(stepper.Step({slot}, {7}, pool, {request}).ok());
  Stepper::SampleRequest other{slot, &greedy, &rng, &recent, false};
  auto sampled = stepper.Sample({other}, pool);
  ASSERT_TRUE(sampled.ok());
  EXPECT_EQ((*sampled)[0].token, pool.logits(slot).argmax().item<int64_t>());
  // Drawn, then the iteration ended: a later greedy sampling of the row is its argmax,
  // even when it asks with the same params object.
  ASSERT_TRUE(stepper.Step({slot}, {9}, pool, {request}).ok());
  stepper.DiscardDrawsAhead();
  warm.temperature = 0;  // the same object, now greedy
  sampled = stepper.Sample({request}, pool);
  ASSERT_TRUE(sampled.ok());
  EXPECT_EQ((*sampled)[0].token, pool.logits(slot).argmax().item<int64_t>());
}

// The benchmark-only null kernel (--benchmark-null-step) does no model work: a step
// leaves the pool's rows as they were, prefill gives zero logits, and sampling hands out
// the same pre-drawn printable bytes on every run without touching the generators.
TEST_F(StatePoolTest, TheNullKernelDoesNoModelWorkAndHandsOutPreDrawnTokens) {
  StateMemoryBudget budget(int64_t{1} << 40);
  StatePool pool(model_, 4, &budget);
  Stepper stepper(model_, Stepper::kNullKernel, false, 1, 1, "test", &pool);
  Stepper again(model_, Stepper::kNullKernel, false, 1, 1, "test", &pool);
  ASSERT_STREQ(stepper.kernel(), "null");
  StatePool::Shortage shortage;
  const int slot = *pool.TryAllocate(&shortage);
  pool.Reset(slot);
  // A row that is not the initial state, so that a step that wrote it would show.
  for (torch::Tensor& t : pool.mutable_state()->tensors) t.normal_();
  std::vector<torch::Tensor> before;
  for (const torch::Tensor& t : pool.mutable_state()->tensors) before.push_back(t.clone());
  ASSERT_TRUE(stepper.Step({slot}, {65}, pool, {}).ok());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(torch::equal(pool.mutable_state()->tensors[i], before[i])) << "state " << i;
  }
  SamplingParams warm;
  warm.temperature = 1.0f;
  std::vector<int64_t> recent;
  std::mt19937_64 rng(5);
  const std::mt19937_64 untouched = rng;
  std::vector<int64_t> first_run;
  std::set<int64_t> distinct;
  for (int i = 0; i < 64; ++i) {
    Stepper::SampleRequest request{slot, &warm, &rng, &recent, true};
    auto sampled = stepper.Sample({request}, pool);
    auto repeated = again.Sample({request}, pool);
    ASSERT_TRUE(sampled.ok() && repeated.ok());
    const int64_t token = (*sampled)[0].token;
    EXPECT_GE(token, 32);
    EXPECT_LE(token, 126);
    EXPECT_EQ(token, (*repeated)[0].token) << "draw " << i;
    distinct.insert(token);
  }
  EXPECT_GT(distinct.size(), 20u) << "the pre-drawn tokens vary";
  EXPECT_TRUE(rng == untouched) << "no generator is consumed";
  fwmodel::State prefill_rows = model_.InitialState(2);
  auto logits = stepper.Prefill(torch::full({2, 5}, 66, torch::kInt64), &prefill_rows);
  ASSERT_TRUE(logits.ok()) << logits.status();
  EXPECT_EQ(logits->sizes(), (std::vector<int64_t>{2, model_.config().vocab_size}));
  EXPECT_EQ(logits->abs().sum().item<float>(), 0.0f);
}

// The engine's default kernel on a float32 CPU model is the native step for RWKV-7 and
// RWKV-4 too (models/kernels/native_rwkv.h), and it steps a pool's rows as LibTorch's does.
TEST(StepperKernelTest, NativeServesRwkv7AndRwkv4) {
  c10::NoGradGuard no_grad;
  for (Architecture arch : {Architecture::kRwkv7, Architecture::kRwkv4}) {
    fwmodel::ModelConfig c;
    c.architecture = arch;
    c.d_model = 32;
    c.n_layers = 2;
    c.n_heads = arch == Architecture::kRwkv7 ? 4 : 1;
    c.d_ff = 48;
    if (arch == Architecture::kRwkv7) {
      c.decay_low_rank_dim = 5;
      c.a_low_rank_dim = 6;
      c.v_low_rank_dim = 3;
      c.gate_low_rank_dim = 7;
    }
    const fwmodel::Model model = fwtest::RandomModel(c, 4, torch::kFloat32);
    StateMemoryBudget budget(int64_t{1} << 40);
    StatePool pool(model, 4, &budget);
    Stepper stepper(model, "native", /*packed_gemm=*/true, 1, 1, "test", &pool);
    EXPECT_STREQ(stepper.kernel(), "native") << fwmodel::ArchitectureName(arch);
    StatePool::Shortage shortage;
    const int a = *pool.TryAllocate(&shortage), b = *pool.TryAllocate(&shortage);
    pool.Reset(a);
    pool.Reset(b);
    fwmodel::State reference = model.InitialState(2);
    for (int64_t token : {34, 105, 110}) {
      ASSERT_TRUE(stepper.Step({a, b}, {token, token + 1}, pool, {}).ok());
      auto expected = model.Step(torch::tensor({token, token + 1}, torch::kInt64), &reference);
      ASSERT_TRUE(expected.ok()) << expected.status();
      fwtest::ExpectNearRelative(pool.logits(a).unsqueeze(0), expected->narrow(0, 0, 1), 1e-4,
                                 "row a");
      fwtest::ExpectNearRelative(pool.logits(b).unsqueeze(0), expected->narrow(0, 1, 1), 1e-4,
                                 "row b");
    }
  }
}

}  // namespace
}  // namespace fwserve
