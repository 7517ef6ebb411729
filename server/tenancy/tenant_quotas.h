// Per-tenant quotas as they are spent: open Generate streams, generated tokens (a
// token bucket on the injected Clock) and sessions held. Torch-free.
//
// The limits come from the API-keys table (Tenants, --api-keys-file); the usage lives
// here, on this replica. A tenant at a limit is refused at once (RESOURCE_EXHAUSTED,
// counted in fwserve_requests_refused_total by reason) and never makes another tenant's
// requests wait.
//
// Thread-safety: every method is thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/api/requests.h"
#include "server/base/clock.h"
#include "server/metrics/metrics.h"
#include "server/tenancy/tenants.h"

namespace fwserve {

class TenantQuotas {
 public:
  // `tenants` null: an open server, one anonymous tenant without quotas. None is owned;
  // all outlive this object. `metrics` is never null (Metrics::Null() for none).
  TenantQuotas(const Tenants* tenants, const Clock* clock, Metrics* metrics);
  TenantQuotas(const TenantQuotas&) = delete;
  TenantQuotas& operator=(const TenantQuotas&) = delete;

  // OK while `tenant` may hold one more session (max_sessions). `held` counts the
  // sessions it holds; it is called only when the tenant has such a quota.
  absl::Status CheckSessions(const std::string& tenant, const std::function<int64_t()>& held);

  // Takes one of the tenant's Generate streams (max_streams), refused while its token
  // bucket is empty (tokens_per_second). On OK, the returned observer wraps `inner`:
  // it charges each chunk's tokens to the bucket and gives the stream back at OnFinish,
  // then deletes itself. If the request is refused later, before the engine took it,
  // destroying the unique_ptr gives the stream back (nothing reaches `inner`). On an
  // open server the result is null: use `inner` directly.
  absl::StatusOr<std::unique_ptr<GenerateObserver>> AdmitStream(const std::string& tenant,
                                                                GenerateObserver* inner);

  // Streams of `tenant` open now (for tests and gauges).
  int64_t OpenStreams(const std::string& tenant) const;
  // The tenant's token bucket as of now (refilled first); nullopt without a rate.
  std::optional<double> TokensAvailable(const std::string& tenant);

 private:
  class StreamObserver;
  struct Usage {
    int64_t streams = 0;  // Generate streams accepted and not finished
    // Token bucket: refilled at tokens_per_second, holding at most one second's worth;
    // generated tokens are taken out (it may go negative).
    double bucket = 0;
    absl::Time refilled = absl::InfinitePast();
  };

  // The tenant's quota; nullopt on an open server (or for a tenant removed by a reload
  // after its request was authenticated: it runs without quotas this once).
  std::optional<TenantQuota> QuotaOf(const std::string& tenant) const;
  absl::Status Refuse(const char* reason, std::string message);
  void RefillLocked(Usage& usage, double rate) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndStream(const std::string& tenant);
  void ChargeTokens(const std::string& tenant, int64_t tokens);

  const Tenants* const tenants_;
  const Clock* const clock_;
  Metrics* const metrics_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fwserve
