#include "server/tenancy/authenticator.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"

namespace fwserve {

absl::StatusOr<std::string> BearerKey(absl::string_view authorization) {
  if (authorization.empty()) {
    return absl::UnauthenticatedError("no API key: send 'Authorization: Bearer <key>'");
  }
  if (authorization.size() > 7 && absl::EqualsIgnoreCase(authorization.substr(0, 7), "bearer ")) {
    return std::string(absl::StripAsciiWhitespace(authorization.substr(7)));
  }
  return absl::UnauthenticatedError("Authorization must be 'Bearer <key>'");
}

absl::StatusOr<std::string> ApiKeyAuthenticator::Authenticate(const CallCredentials& credentials) {
  absl::StatusOr<std::string> tenant =
      absl::UnauthenticatedError("no API key: send 'Authorization: Bearer <key>'");
  auto header = credentials.metadata.find("authorization");
  if (header != credentials.metadata.end()) {
    absl::StatusOr<std::string> key = BearerKey(header->second);
    tenant = key.ok() ? tenants_->TenantOfKey(*key) : key.status();
  } else if (!credentials.certificate_common_name.empty()) {
    tenant = tenants_->TenantOfCertificate(credentials.certificate_common_name);
  }
  if (!tenant.ok()) metrics_->CountRefused("unauthenticated");
  return tenant;
}

}  // namespace fwserve
