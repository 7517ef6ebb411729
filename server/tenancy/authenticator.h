// Who a call comes from, decided once for both front doors: the gRPC transport and the
// HTTP API hand the call's credentials to one Authenticator and get the caller's tenant.
// Torch-free; includes nothing above tenancy.
#pragma once

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/metrics/metrics.h"
#include "server/tenancy/tenants.h"

namespace fwserve {

// What a call presents to prove who it comes from.
struct CallCredentials {
  // The call's metadata or headers, with lowercase keys, e.g. "authorization".
  std::multimap<std::string, std::string> metadata;
  // The subject common name of the client certificate that mutual TLS verified; empty
  // without one.
  std::string certificate_common_name;
};

// The key of an "authorization: Bearer <key>" value: the scheme is case-insensitive,
// ASCII whitespace around the key is dropped (the key may be empty, which no tenant
// has). UNAUTHENTICATED for an empty value, another scheme or a bare "Bearer ".
absl::StatusOr<std::string> BearerKey(absl::string_view authorization);

// Decides who a call comes from. Thread-safe; must not block.
class Authenticator {
 public:
  virtual ~Authenticator() = default;
  // The caller's tenant, or UNAUTHENTICATED to refuse the call.
  virtual absl::StatusOr<std::string> Authenticate(const CallCredentials& credentials) = 0;
};

// The Authenticator of --api-keys-file: "authorization: Bearer <key>" (gRPC metadata or
// the HTTP header), or a client certificate's common name verified by mutual TLS,
// mapped to a tenant by Tenants. Thread-safe (Tenants may be reloaded meanwhile).
class ApiKeyAuthenticator : public Authenticator {
 public:
  // Neither is owned; `metrics` null = Metrics::Null().
  ApiKeyAuthenticator(const Tenants* tenants, Metrics* metrics)
      : tenants_(tenants), metrics_(Metrics::OrNull(metrics)) {}

  // A bearer key, when sent, decides alone (a wrong key is refused even with a mapped
  // certificate). UNAUTHENTICATED messages say what is missing or wrong, never echo
  // the key. Each refusal counts as fwserve_requests_refused_total{reason=
  // "unauthenticated"}.
  absl::StatusOr<std::string> Authenticate(const CallCredentials& credentials) override;

 private:
  const Tenants* const tenants_;
  Metrics* const metrics_;  // never null
};

}  // namespace fwserve
