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

namespace {

constexpr char kRefusalReasonUrl[] = "fwserve.dev/refusal-reason";

}  // namespace

absl::Status WithRefusalReason(absl::Status status, RefusalReason reason) {
  if (status.ok()) return status;
  status.SetPayload(kRefusalReasonUrl, absl::Cord(absl::StrCat(static_cast<int>(reason))));
  return status;
}

std::optional<RefusalReason> RefusalReasonOf(const absl::Status& status) {
  auto payload = status.GetPayload(kRefusalReasonUrl);
  if (!payload.has_value()) return std::nullopt;
  int value = 0;
  if (!absl::SimpleAtoi(std::string(*payload), &value) || value < 0 ||
      value > static_cast<int>(RefusalReason::kShed)) {
    return std::nullopt;
  }
  return static_cast<RefusalReason>(value);
}

const char* RefusalReasonLabel(RefusalReason reason) {
  switch (reason) {
    case RefusalReason::kQueueFull:
      return "queue_full";
    case RefusalReason::kQueueWait:
      return "queue_wait";
    case RefusalReason::kTenantQueueShare:
      return "tenant_queue_share";
    case RefusalReason::kDeadline:
      return "deadline";
    case RefusalReason::kShed:
      return "shed";
  }
  return "unknown";
}

}  // namespace fwserve
