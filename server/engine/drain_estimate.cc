#include "server/engine/drain_estimate.h"

namespace fwserve {

void DrainEstimate::Tick(absl::Time now, bool saturated) {
  if (window_start_ == absl::InfinitePast()) {
    window_start_ = now;
    window_saturated_ = saturated;
    ended_in_window_ = 0;
    return;
  }
  window_saturated_ = window_saturated_ && saturated;
  const absl::Duration elapsed = now - window_start_;
  if (elapsed < window_) return;
  if (window_saturated_ && ended_in_window_ > 0) {
    const double sample = static_cast<double>(ended_in_window_) / absl::ToDoubleSeconds(elapsed);
    // Smoothed over about four windows: a second at the default window.
    rate_ = rate_ == 0 ? sample : 0.75 * rate_ + 0.25 * sample;
  }
  window_start_ = now;
  window_saturated_ = saturated;
  ended_in_window_ = 0;
}

absl::Duration DrainEstimate::WaitFor(int64_t ahead, double rate, absl::Duration unmeasured) {
  if (ahead <= 0) return absl::ZeroDuration();
  if (rate <= 0) return unmeasured;
  return absl::Seconds(static_cast<double>(ahead) / rate);
}

}  // namespace fwserve
