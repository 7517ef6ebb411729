// The redis://HOST:PORT[/DB] backend: a SharedSessionStore in one Redis (key layout and
// semantics in shared_session_store.h), spoken to with hiredis's synchronous API.
//
// Every change of a session is one Lua script that touches only that session's keys
// (so it stays Redis-Cluster-ready); the listing index is updated by separate commands
// after it. Scripts go as EVALSHA, falling back to EVAL when Redis does not know them
// (a restart, SCRIPT FLUSH).
//
// Connections: a pool of options.pool_size, each serving one command (or pipeline) at
// a time. A connection that fails (I/O error, no answer within options.timeout) is
// dropped, and an idle one that the server closed is noticed before use. New ones are
// made on demand (AUTH with the password file's first line, SELECT DB); after a failed
// connect further attempts back off exponentially (50 ms doubling to 2 s), and calls
// in the meantime fail at once. Waiting for a free connection is bounded by the
// timeout too. Every failure to reach Redis is UNAVAILABLE "session store unavailable:
// redis HOST:PORT: ..."; messages never contain the password.
//
// Caveat: a HOST that is a name (not an address) is resolved by getaddrinfo on each
// connect, which the timeout does not bound.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/sessions/store/shared_session_store.h"

struct redisContext;  // hiredis
struct redisReply;

namespace fwserve {

// Where a redis:// store lives.
struct RedisAddress {
  std::string host;  // a name, an IPv4 address, or an IPv6 address without brackets
  int port = 6379;
  int db = 0;
};

// Parses "redis://HOST:PORT[/DB]" (HOST may be "[IPv6]"). INVALID_ARGUMENT naming
// --session-store and the bad value; a URL with a password ("user:pw@") is refused
// without repeating it.
absl::StatusOr<RedisAddress> ParseRedisSpec(const std::string& spec);

class RedisSessionStore : public SharedSessionStore {
 public:
  // Reads the password file (INVALID_ARGUMENT if it cannot be read or its first line
  // is empty) and checks the options; connects lazily, so an unreachable Redis is not
  // an error here (see Ping).
  static absl::StatusOr<std::unique_ptr<RedisSessionStore>> Open(
      const RedisAddress& address, const SessionStoreOptions& options);
  ~RedisSessionStore() override;

  // "redis://HOST:PORT/DB", never the password.
  std::string Describe() const override;

  // One round trip (PING) on a pooled connection: OK if Redis answers. Not reported to
  // the observer.
  absl::Status Ping();

  // SessionStore. Put is unfenced (no lease, the version is bumped blindly): for tools
  // only, never while replicas serve the session. Put of an unknown id creates a
  // session with an empty model. Put and CreateSession need a well-formed session id.
  absl::Status Put(const std::string& id, const std::string& blob) override;
  absl::StatusOr<std::string> Get(const std::string& id) override;
  absl::Status Delete(const std::string& id) override;
  // Walks the listing index (dropping stale entries as List does).
  absl::Status ForEachId(const std::function<bool(const std::string& id)>& visit) override;

  // SharedSessionStore.
  absl::StatusOr<StoreLeaseGrant> AcquireLease(const std::string& id, absl::Duration lease_ttl,
                                               int64_t cached_version,
                                               const std::string& tenant) override;
  absl::Status RenewLease(const std::string& id, const std::string& token,
                          absl::Duration lease_ttl) override;
  absl::Status ReleaseLease(const std::string& id, const std::string& token) override;
  absl::StatusOr<int64_t> CommitLeased(const std::string& id, const std::string& token,
                                       int64_t expected_version, const std::string& blob,
                                       int64_t tokens, absl::Time last_used) override;
  absl::Status CreateSession(const StoredSessionInfo& info, const std::string& blob) override;
  absl::Status DeleteLeased(const std::string& id, const std::string& token) override;
  absl::StatusOr<StoredSessionInfo> GetInfo(const std::string& id) override;
  absl::StatusOr<SessionPage> List(const std::string& model, const std::string& tenant,
                                   int page_size, const std::string& page_token) override;

  // The keys of session `id` and of the index (for tests and operators).
  std::string SessionKey(const std::string& id) const;
  std::string LeaseKey(const std::string& id) const;
  std::string IndexKey() const;

 private:
  class Connection;

  RedisSessionStore(RedisAddress address, SessionStoreOptions options, std::string password);

  absl::StatusOr<std::unique_ptr<Connection>> Checkout();
  void Return(redisContext* ctx);
  absl::StatusOr<redisContext*> Connect();
  std::string Where() const;  // "redis HOST:PORT"
  // UNAVAILABLE "session store unavailable: redis HOST:PORT: <what>" (password masked).
  absl::Status Unavailable(absl::string_view what) const;
  // The status for a broken connection (I/O error, timeout, EOF).
  absl::Status ContextError(const redisContext* ctx) const;
  // The status for an error reply of Redis.
  absl::Status ErrorReply(const redisReply* reply) const;

  template <typename F>
  auto Observed(const char* op, F&& body) -> decltype(body());

  // `tenant`: nullopt = every tenant's sessions.
  absl::StatusOr<SessionPage> ListImpl(const std::string& model,
                                       const std::optional<std::string>& tenant, int page_size,
                                       const std::string& page_token);
  // Releases leases that acquires may have taken although they timed out.
  void ReleaseOrphanedLeases(Connection& conn);
  absl::Status RemoveFromIndex(Connection& conn, const std::string& id,
                               const std::string& created_ms);

  const RedisAddress address_;
  const SessionStoreOptions options_;
  const std::string password_;  // empty: no AUTH

  absl::Mutex mu_;
  std::vector<redisContext*> idle_ ABSL_GUARDED_BY(mu_);
  int free_slots_ ABSL_GUARDED_BY(mu_);
  // Backoff of connection attempts after a failed one.
  absl::Duration backoff_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  absl::Time next_connect_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::string last_connect_error_ ABSL_GUARDED_BY(mu_);
  bool reachable_ ABSL_GUARDED_BY(mu_) = true;  // for logging transitions only
  // (id, token) of acquires that timed out after sending: released by the next acquire.
  static constexpr size_t kMaxOrphanedLeases = 10000;
  std::vector<std::pair<std::string, std::string>> orphaned_leases_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fwserve
