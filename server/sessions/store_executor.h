// Threads that run session-store work (encode + write, read + decode, delete) off the
// engine threads, so a slow disk or network store never stalls decoding.
//
// Jobs run in submission order per thread, concurrently across threads; ordering
// between jobs on one session comes from its lease (one request at a time), not from
// the executor. Thread-safety: Run and Drain may be called from any thread.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace fwserve {

class StoreExecutor {
 public:
  explicit StoreExecutor(int threads);
  // Runs every job already queued, then joins the threads.
  ~StoreExecutor();
  StoreExecutor(const StoreExecutor&) = delete;
  StoreExecutor& operator=(const StoreExecutor&) = delete;

  void Run(std::function<void()> job);
  // Jobs queued or running.
  int64_t pending() const;

 private:
  void Work();

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  int64_t running_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace fwserve
