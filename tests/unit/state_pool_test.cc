// StatePool: slots, growth up to the slot limit, the shared memory budget, and row
// copies, on a small random model.
#include <gtest/gtest.h>

#include <set>

#include "server/engine/state_pool.h"
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
  torch::NoGradGuard no_grad_;
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

}  // namespace
}  // namespace fwserve
