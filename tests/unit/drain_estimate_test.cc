#include "server/engine/drain_estimate.h"

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "server/base/retry_delay.h"

namespace fwserve {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1000);

// 10 streams end every 100 ms while saturated: 100 streams/s.
TEST(DrainEstimateTest, MeasuresTheRateWhileSaturated) {
  DrainEstimate estimate(absl::Milliseconds(250));
  EXPECT_EQ(estimate.rate(), 0);
  EXPECT_EQ(estimate.WaitFor(5, absl::Seconds(1)), absl::Seconds(1));  // unmeasured
  absl::Time now = kStart;
  estimate.Tick(now, true);
  for (int i = 0; i < 3; ++i) {
    for (int s = 0; s < 10; ++s) estimate.StreamEnded();
    now += absl::Milliseconds(100);
    estimate.Tick(now, true);
  }
  EXPECT_NEAR(estimate.rate(), 100.0, 1e-9);
  EXPECT_EQ(estimate.WaitFor(50, absl::Seconds(1)), absl::Milliseconds(500));
  EXPECT_EQ(estimate.WaitFor(0, absl::Seconds(1)), absl::ZeroDuration());
  EXPECT_EQ(estimate.WaitFor(-3, absl::Seconds(1)), absl::ZeroDuration());
}

// A window with a free slot at any tick measures arrivals, not capacity: ignored.
TEST(DrainEstimateTest, IgnoresWindowsWithFreeSlots) {
  DrainEstimate estimate(absl::Milliseconds(250));
  absl::Time now = kStart;
  estimate.Tick(now, true);
  for (int i = 0; i < 3; ++i) {
    for (int s = 0; s < 10; ++s) estimate.StreamEnded();
    now += absl::Milliseconds(100);
    estimate.Tick(now, true);
  }
  const double measured = estimate.rate();
  for (int i = 0; i < 6; ++i) {
    estimate.StreamEnded();
    now += absl::Milliseconds(100);
    estimate.Tick(now, /*saturated=*/i % 2 == 0);
  }
  EXPECT_EQ(estimate.rate(), measured);
}

// A slower drain moves the estimate toward it, smoothed.
TEST(DrainEstimateTest, FollowsAChangeSmoothly) {
  DrainEstimate estimate(absl::Milliseconds(250));
  absl::Time now = kStart;
  estimate.Tick(now, true);
  for (int s = 0; s < 100; ++s) estimate.StreamEnded();
  now += absl::Seconds(1);
  estimate.Tick(now, true);
  EXPECT_NEAR(estimate.rate(), 100, 1e-9);
  for (int s = 0; s < 20; ++s) estimate.StreamEnded();
  now += absl::Seconds(1);
  estimate.Tick(now, true);
  EXPECT_NEAR(estimate.rate(), 0.75 * 100 + 0.25 * 20, 1e-9);
}

TEST(RetryDelayTest, RidesOnTheStatus) {
  const absl::Status refused =
      WithRetryDelay(absl::ResourceExhaustedError("full"), absl::Microseconds(2400));
  ASSERT_TRUE(RetryDelayOf(refused).has_value());
  EXPECT_EQ(*RetryDelayOf(refused), absl::Milliseconds(2));
  EXPECT_EQ(refused.message(), "full");
  EXPECT_EQ(*RetryDelayOf(WithRetryDelay(absl::UnavailableError("x"), absl::ZeroDuration())),
            absl::Milliseconds(1));  // at least 1 ms
  EXPECT_FALSE(RetryDelayOf(absl::ResourceExhaustedError("full")).has_value());
  EXPECT_TRUE(WithRetryDelay(absl::OkStatus(), absl::Seconds(1)).ok());
  EXPECT_FALSE(RetryDelayOf(WithRetryDelay(absl::OkStatus(), absl::Seconds(1))).has_value());
}

}  // namespace
}  // namespace fwserve
