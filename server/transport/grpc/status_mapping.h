// The one place absl::Status becomes grpc::Status. Codes map one to one (both follow
// google.rpc.Code); messages are passed through, so the core's messages must be safe
// to show to clients (they name fields and values, never paths or internals).
//
// A refusal with a retry delay (server/base/retry_delay.h) also carries it the two ways
// gRPC clients read: a google.rpc.RetryInfo in the rich error details
// (`grpc-status-details-bin`), and the `grpc-retry-pushback-ms` trailer that gRPC's own
// retry policy honours (docs/serving.md "Overload").
#pragma once

#include <grpcpp/server_context.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace fwserve {

grpc::Status ToGrpcStatus(const absl::Status& status);

// Adds the `grpc-retry-pushback-ms` trailer: `status`'s retry delay less `already_waited`
// (a refusal answered late has already made the caller wait that long), never below 0.
// No-op without a retry delay. Call before the call finishes.
void AddRetryPushback(grpc::ServerContextBase* context, const absl::Status& status,
                      absl::Duration already_waited = absl::ZeroDuration());

}  // namespace fwserve
