// The one place absl::Status becomes grpc::Status. Codes map one to one (both follow
// google.rpc.Code); messages are passed through, so the core's messages must be safe
// to show to clients (they name fields and values, never paths or internals).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace fwserve {

grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace fwserve
