#include "server/base/retry_delay.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fwserve {
namespace {

// The payload's type URL; its value is the delay in milliseconds, in decimal.
constexpr char kRetryDelayUrl[] = "fwserve.dev/retry-delay-ms";

}  // namespace

absl::Status WithRetryDelay(absl::Status status, absl::Duration delay) {
  if (status.ok()) return status;
  const int64_t ms =
      std::max<int64_t>(1, absl::ToInt64Milliseconds(delay + absl::Microseconds(500)));
  status.SetPayload(kRetryDelayUrl, absl::Cord(absl::StrCat(ms)));
  return status;
}

std::optional<absl::Duration> RetryDelayOf(const absl::Status& status) {
  auto payload = status.GetPayload(kRetryDelayUrl);
  if (!payload.has_value()) return std::nullopt;
  int64_t ms = 0;
  if (!absl::SimpleAtoi(std::string(*payload), &ms) || ms < 0) return std::nullopt;
  return absl::Milliseconds(ms);
}

}  // namespace fwserve
