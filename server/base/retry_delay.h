// A refusal's hint of when to come back: RESOURCE_EXHAUSTED (and a deadline refusal)
// carries how long the caller should wait before retrying, computed by the engine from
// how fast its queue drains. Each transport turns it into its own form: gRPC's
// `grpc-retry-pushback-ms` trailer and a google.rpc.RetryInfo detail, HTTP's
// `Retry-After` and `retry-after-ms` headers. Torch-free.
#pragma once

#include <optional>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace fwserve {

// `status` with `delay` attached (rounded to whole milliseconds, at least 1 ms). An OK
// status is returned unchanged.
absl::Status WithRetryDelay(absl::Status status, absl::Duration delay);

// The delay attached by WithRetryDelay, if any.
std::optional<absl::Duration> RetryDelayOf(const absl::Status& status);

// Why an engine refused work it was offered: carried with the status (a payload, like
// the retry delay), so that callers count and classify refusals without reading their
// messages. The label is the `reason` of fwserve_requests_refused_total.
enum class RefusalReason {
  kQueueFull,         // the queue held --max-queued-requests
  kQueueWait,         // the queue held what drains within --max-queue-wait
  kTenantQueueShare,  // the tenant already had half the queue
  kDeadline,          // it could not start before its deadline
  kShed,              // CoDel shed it from a standing queue
};

// `status` with `reason` attached. An OK status is returned unchanged.
absl::Status WithRefusalReason(absl::Status status, RefusalReason reason);
// The reason attached by WithRefusalReason, if any.
std::optional<RefusalReason> RefusalReasonOf(const absl::Status& status);
// "queue_full", "queue_wait", "tenant_queue_share", "deadline", "shed".
const char* RefusalReasonLabel(RefusalReason reason);

}  // namespace fwserve
