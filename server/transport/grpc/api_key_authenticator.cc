#include "server/transport/grpc/api_key_authenticator.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"

namespace fwserve {

absl::StatusOr<std::string> ApiKeyAuthenticator::Authenticate(const CallCredentials& credentials) {
  absl::StatusOr<std::string> tenant =
      absl::UnauthenticatedError("no API key: send the metadata 'authorization: Bearer <key>'");
  auto header = credentials.metadata.find("authorization");
  if (header != credentials.metadata.end()) {
    const std::string& value = header->second;
    if (value.size() > 7 && absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) {
      tenant = tenants_->TenantOfKey(absl::StripAsciiWhitespace(value.substr(7)));
    } else {
      tenant = absl::UnauthenticatedError("the authorization metadata must be 'Bearer <key>'");
    }
  } else if (!credentials.certificate_common_name.empty()) {
    tenant = tenants_->TenantOfCertificate(credentials.certificate_common_name);
  }
  if (!tenant.ok()) metrics_->CountRefused("unauthenticated");
  return tenant;
}

}  // namespace fwserve
