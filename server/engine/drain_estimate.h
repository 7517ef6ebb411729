// How fast an engine's streams finish while every stream slot is taken, and so how
// long a stream queued now waits before it starts: the basis of the retry hint on a
// refusal and of admission by deadline (docs/serving.md, "Overload"). Pure: the caller
// supplies the clock. Not thread-safe (the engine thread owns it and publishes its
// answers through atomics).
#pragma once

#include <cstdint>

#include "absl/time/time.h"

namespace fwserve {

class DrainEstimate {
 public:
  // Rates are measured over windows of at least `window` and smoothed across them.
  explicit DrainEstimate(absl::Duration window = absl::Milliseconds(250)) : window_(window) {}

  // A stream ended (finished, failed or cancelled).
  void StreamEnded() { ++ended_in_window_; }
  // Once per loop iteration. `saturated`: every stream slot is taken now. Only windows
  // that were saturated throughout say how fast the slots free up; the others say only
  // how fast streams arrived.
  void Tick(absl::Time now, bool saturated);
  // Streams ending per second while saturated, smoothed; 0 = not measured yet.
  double rate() const { return rate_; }
  // How long until `ahead` more streams have ended (the wait of a stream with `ahead`
  // streams to start before it, none of whose slots is free). `unmeasured`: the answer
  // while no rate is known. Zero when ahead <= 0.
  absl::Duration WaitFor(int64_t ahead, absl::Duration unmeasured) const {
    return WaitFor(ahead, rate_, unmeasured);
  }
  static absl::Duration WaitFor(int64_t ahead, double rate, absl::Duration unmeasured);

 private:
  const absl::Duration window_;
  absl::Time window_start_ = absl::InfinitePast();
  bool window_saturated_ = true;
  int64_t ended_in_window_ = 0;
  double rate_ = 0;
};

}  // namespace fwserve
