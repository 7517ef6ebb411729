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

}  // namespace fwserve
