#include "server/engine/state_memory_budget.h"

#include <algorithm>

namespace fwserve {

bool StateMemoryBudget::TryReserve(int64_t bytes) {
  int64_t used = used_.load();
  do {
    if (used + bytes > limit_) return false;
  } while (!used_.compare_exchange_weak(used, used + bytes));
  return true;
}

void StateMemoryBudget::Release(int64_t bytes) { used_.fetch_sub(bytes); }

void StateMemoryBudget::RequestReclaim(int64_t bytes) {
  int64_t wanted = reclaim_.load();
  while (wanted < bytes && !reclaim_.compare_exchange_weak(wanted, bytes)) {
  }
}

void StateMemoryBudget::Reclaimed(int64_t bytes) {
  int64_t wanted = reclaim_.load();
  while (wanted > 0 &&
         !reclaim_.compare_exchange_weak(wanted, std::max<int64_t>(0, wanted - bytes))) {
  }
}

}  // namespace fwserve
