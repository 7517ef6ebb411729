#include "server/transport/grpc/status_mapping.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "server/base/retry_delay.h"

namespace fwserve {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(status.code());
  std::string message(status.message());
  const std::optional<absl::Duration> delay = RetryDelayOf(status);
  if (!delay.has_value()) return grpc::Status(code, message);
  google::rpc::RetryInfo retry;
  const int64_t ms = absl::ToInt64Milliseconds(*delay);
  retry.mutable_retry_delay()->set_seconds(ms / 1000);
  retry.mutable_retry_delay()->set_nanos(static_cast<int32_t>(ms % 1000) * 1000000);
  google::rpc::Status details;
  details.set_code(static_cast<int32_t>(status.code()));
  details.set_message(message);
  details.add_details()->PackFrom(retry);
  return grpc::Status(code, message, details.SerializeAsString());
}

void AddRetryPushback(grpc::ServerContextBase* context, const absl::Status& status,
                      absl::Duration already_waited) {
  const std::optional<absl::Duration> delay = RetryDelayOf(status);
  if (!delay.has_value()) return;
  const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(*delay - already_waited));
  context->AddTrailingMetadata("grpc-retry-pushback-ms", absl::StrCat(ms));
}

}  // namespace fwserve
