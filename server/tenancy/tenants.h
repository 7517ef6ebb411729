// API keys, the tenants they name and the tenants' quotas (docs/security.md gives the
// file format and the threat model). Torch-free.
//
// Only SHA-256 hashes of keys are ever held; a presented key is hashed and compared
// with every configured hash in constant time.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#include "absl/strings/string_view.h"

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace fwserve {

// Limits of one tenant. 0 means "no limit" for each.
struct TenantQuota {
  // Sessions the tenant holds at once (on this replica's view; docs/security.md).
  int64_t max_sessions = 0;
  // Generate streams of the tenant running or queued at once.
  int64_t max_streams = 0;
  // Generated tokens per second, as a token bucket holding at most one second of
  // tokens. A Generate is refused while the bucket is empty; a running stream is not
  // cut short, it drives the bucket negative.
  double tokens_per_second = 0;

  bool operator==(const TenantQuota& other) const {
    return max_sessions == other.max_sessions && max_streams == other.max_streams &&
           tokens_per_second == other.tokens_per_second;
  }
};

// The parsed --api-keys-file.
struct ApiKeysTable {
  struct Tenant {
    std::string name;
    TenantQuota quota;
  };
  struct Key {
    std::array<uint8_t, 32> sha256;
    size_t tenant;  // index into `tenants`
  };
  struct Certificate {
    std::string common_name;  // a verified client certificate's subject CN (mTLS)
    size_t tenant;
  };
  std::vector<Tenant> tenants;  // in order of first appearance; names unique
  std::vector<Key> keys;
  std::vector<Certificate> certificates;
};

// Parses the API-keys file format (docs/security.md): one credential per line,
//   sha256:<64 hex digits> tenant=NAME [max_sessions=N] [max_streams=N] [tokens_per_second=X]
//   x509-cn:<common name> tenant=NAME [quotas as above]
// '#' starts a comment; blank lines are ignored. Quotas belong to the tenant: lines of
// one tenant that both give quotas must give the same ones. Errors name the line
// number and the bad field, never echo a key hash.
absl::StatusOr<ApiKeysTable> ParseApiKeys(absl::string_view text);

// SHA-256 of `data` as 64 lowercase hex digits (what goes into the file after sha256:).
std::string Sha256Hex(absl::string_view data);

// True for names the file accepts as tenants: 1 to 64 of [A-Za-z0-9_.-].
bool IsValidTenantName(absl::string_view name);

// The live table: answers who a credential belongs to and what its tenant may do.
// Reload() swaps the table atomically; lookups in flight finish on the old one.
// Thread-safe.
class Tenants {
 public:
  // Reads and parses `path`. Errors name the file as given on the command line.
  static absl::StatusOr<std::unique_ptr<Tenants>> Load(const std::string& path);
  // From text (tests); Reload() re-reads nothing then.
  static absl::StatusOr<std::unique_ptr<Tenants>> FromText(absl::string_view text);

  // Re-reads the file (SIGHUP). On error the current table stays in force.
  absl::Status Reload();

  // The tenant of a presented API key; UNAUTHENTICATED if no configured key matches.
  absl::StatusOr<std::string> TenantOfKey(absl::string_view key) const;
  // The tenant mapped to a verified client certificate's common name; UNAUTHENTICATED
  // if none is.
  absl::StatusOr<std::string> TenantOfCertificate(absl::string_view common_name) const;
  // The quota of a configured tenant; nullopt if the tenant is not (or no longer)
  // configured.
  std::optional<TenantQuota> QuotaOf(absl::string_view tenant) const;
  // Every configured tenant name, in file order.
  std::vector<std::string> Names() const;

 private:
  explicit Tenants(std::string path) : path_(std::move(path)) {}

  const std::string path_;  // empty: built from text
  mutable absl::Mutex mu_;
  std::shared_ptr<const ApiKeysTable> table_ ABSL_GUARDED_BY(mu_);

  std::shared_ptr<const ApiKeysTable> table() const {
    absl::MutexLock lock(&mu_);
    return table_;
  }
};

}  // namespace fwserve
