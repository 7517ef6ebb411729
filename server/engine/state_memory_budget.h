// Resident session-state bytes over all of a server's engines, against
// --max-state-memory-bytes (torch-free: the core owns one and hands it to each engine).
//
// Thread-safety: thread-safe (atomics).
#pragma once

#include <atomic>
#include <cstdint>

namespace fwserve {

// Resident state bytes over all engines, against --max-state-memory-bytes.
class StateMemoryBudget {
 public:
  explicit StateMemoryBudget(int64_t limit_bytes) : limit_(limit_bytes) {}
  bool TryReserve(int64_t bytes);
  void Release(int64_t bytes);
  // An engine needs `bytes` and has no idle session of its own to give up: engines with
  // idle sessions release some at their next housekeeping.
  void RequestReclaim(int64_t bytes);
  // Bytes still wanted by RequestReclaim (0 = none); Reclaimed subtracts what was freed.
  int64_t reclaim_wanted() const { return reclaim_.load(); }
  // Bytes reserved now, over all pools, and the limit.
  int64_t used() const { return used_.load(); }
  int64_t limit() const { return limit_; }
  void Reclaimed(int64_t bytes);

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
  std::atomic<int64_t> reclaim_{0};
};

}  // namespace fwserve
