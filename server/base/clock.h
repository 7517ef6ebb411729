// Time source for session bookkeeping (creation, last use, TTL). Injectable so that
// expiry and eviction are unit-tested without sleeping. Latency measurements and batch
// deadlines use absl::Now() directly: they are about the machine, not the session.
//
// Thread-safety: Now() may be called from any thread.
#pragma once

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace fwserve {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // The process-wide real clock (never null, never destroyed).
  static const Clock* Real();
};

// A clock that moves only when told to. For tests.
class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'700'000'000)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration by) {
    absl::MutexLock lock(&mu_);
    now_ += by;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fwserve
