#include "server/sessions/store_executor.h"

#include <pthread.h>

#include <algorithm>
#include <exception>

#include "absl/strings/str_cat.h"
#include "server/base/log.h"

namespace fwserve {

StoreExecutor::StoreExecutor(int threads) {
  for (int i = 0; i < std::max(1, threads); ++i) {
    threads_.emplace_back([this] {
      pthread_setname_np(pthread_self(), "fwserve-store");
      Work();
    });
  }
}

StoreExecutor::~StoreExecutor() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void StoreExecutor::Run(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  jobs_.push_back(std::move(job));
}

int64_t StoreExecutor::pending() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(jobs_.size()) + running_;
}

void StoreExecutor::Work() {
  while (true) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !jobs_.empty() || stop_; };
      mu_.Await(absl::Condition(&ready));
      if (jobs_.empty()) return;  // stopping, and nothing left to run
      job = std::move(jobs_.front());
      jobs_.pop_front();
      ++running_;
    }
    // A job must not take the process down: it reports its own errors; anything that
    // still escapes is logged.
    try {
      job();
    } catch (const std::exception& e) {
      Log(LogLevel::kError, absl::StrCat("session store job failed: ", e.what()));
    }
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

}  // namespace fwserve
