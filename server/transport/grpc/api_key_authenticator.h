// The Authenticator of --api-keys-file: "authorization: Bearer <key>" call metadata,
// or a client certificate's common name verified by mutual TLS, mapped to a tenant by
// Tenants. Torch-free; thread-safe (Tenants may be reloaded meanwhile).
#pragma once

#include "server/metrics/metrics.h"
#include "server/tenancy/tenants.h"
#include "server/transport/grpc/grpc_server.h"

namespace fwserve {

class ApiKeyAuthenticator : public Authenticator {
 public:
  // Neither is owned; `metrics` null = Metrics::Null().
  ApiKeyAuthenticator(const Tenants* tenants, Metrics* metrics)
      : tenants_(tenants), metrics_(Metrics::OrNull(metrics)) {}

  // A bearer key, when sent, decides alone (a wrong key is refused even with a mapped
  // certificate). UNAUTHENTICATED messages say what is missing or wrong, never echo
  // the key.
  absl::StatusOr<std::string> Authenticate(const CallCredentials& credentials) override;

 private:
  const Tenants* const tenants_;
  Metrics* const metrics_;  // never null
};

}  // namespace fwserve
