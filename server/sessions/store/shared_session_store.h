// A session store shared by several fwserve replicas (redis://): the store, not any
// one process, is where a session lives. Each replica's resident pool is only a cache.
//
// The model (docs/sessions.md, "Many replicas"):
//   * Every session has a version, 1 at creation, bumped by each committed request,
//     and a tag naming the commit that wrote it. A replica uses its resident copy only
//     if its version and tag equal the store's.
//   * One request per session across replicas: a request takes the session's lease in
//     the store (set-if-absent with an expiry and a random token), renews it while it
//     runs, and ends it by committing or releasing.
//   * Writes are fenced: Commit succeeds only if the writer still holds the lease and
//     the version is the one it read, so a writer that was paused or cut off past its
//     lease's expiry can never overwrite newer state.
//   * Idle sessions expire through the store (a TTL refreshed by every lease/commit).
//
// Key layout (cluster-ready: the keys of one session share the hash tag {<id>}):
//   <prefix>{<id>}:s      hash: ver, tag, model, tokens, created (unix ms), used (unix ms),
//                         blob
//   <prefix>{<id>}:lease  string: the holder's token, with a PX expiry
//   <prefix>index         sorted set (all scores 0) of "<created ms, 13 digits>:<id>", the
//                         listing index. It is a hint, updated after the session's own
//                         keys: List checks every entry and drops stale ones.
//
// Errors: UNAVAILABLE "session store unavailable: ..." when the store cannot be reached
// or does not answer within its timeout; NOT_FOUND for an unknown id; ABORTED for a
// busy session or a lost lease (see each method). Messages may name hosts: for logs.
//
// Thread-safety: every method is thread-safe and blocks on the network: call from store
// threads (StoreExecutor), never from an engine or gRPC thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/sessions/store/session_store.h"

namespace fwserve {

// What the store knows of a session without reading its state.
struct StoredSessionInfo {
  std::string id;
  std::string model;
  // The owning tenant (empty: none; see SessionRecord::tenant).
  std::string tenant;
  int64_t tokens = 0;
  absl::Time created;
  absl::Time last_used;
  int64_t version = 0;  // >= 1
  // Names the commit that wrote this version (random; the committing lease's token).
  // A version number can repeat if Redis loses acknowledged commits (a failover), so a
  // cached copy is current only if both version and tag match. AcquireLease fills it;
  // CreateSession stores it (a random one if empty).
  std::string tag;
  // GetInfo only: a request (on any replica) holds the session's lease.
  bool busy = false;
};

// A held lease: the right to change one session until `token` expires in the store.
struct StoreLeaseGrant {
  std::string token;       // random, 128 bits, hex
  StoredSessionInfo info;  // as of taking the lease; info.version is the fence
  // The session's blob, returned only when info.version differs from the caller's
  // cached version (a cache miss); nullopt on a hit.
  std::optional<std::string> blob;
};

struct SessionPage {
  std::vector<StoredSessionInfo> sessions;  // oldest first
  std::string next_page_token;              // empty: this was the last page
};

class SharedSessionStore : public SessionStore {
 public:
  // Takes the lease of session `id` for `lease_ttl` and refreshes the session's TTL.
  // NOT_FOUND: no such session (never created, deleted, or expired). ABORTED: another
  // request (on any replica) holds the lease. `cached_version` is the version of the
  // caller's resident copy, 0 if none. A session of another tenant than `tenant` is
  // NOT_FOUND, and nothing of it (lease, TTL) is touched.
  virtual absl::StatusOr<StoreLeaseGrant> AcquireLease(const std::string& id,
                                                       absl::Duration lease_ttl,
                                                       int64_t cached_version,
                                                       const std::string& tenant) = 0;
  // Extends a held lease. ABORTED if `token` no longer holds it (it expired and maybe
  // another request took it).
  virtual absl::Status RenewLease(const std::string& id, const std::string& token,
                                  absl::Duration lease_ttl) = 0;
  // Ends a held lease without changing the session. OK also if it was already lost.
  virtual absl::Status ReleaseLease(const std::string& id, const std::string& token) = 0;
  // The fenced write: stores `blob` (and tokens, last_used) as version
  // expected_version + 1 with tag `token`, refreshes the TTL and ends the lease, all
  // atomically, only if `token` still holds the lease and the stored version is
  // `expected_version`.
  // Returns the new version. ABORTED if the lease or the version moved on (nothing is
  // written, and a lease `token` still held is ended).
  virtual absl::StatusOr<int64_t> CommitLeased(const std::string& id, const std::string& token,
                                               int64_t expected_version, const std::string& blob,
                                               int64_t tokens, absl::Time last_used) = 0;
  // A new session at version 1 (with its TTL and an index entry). ALREADY_EXISTS if
  // the id is taken.
  virtual absl::Status CreateSession(const StoredSessionInfo& info, const std::string& blob) = 0;
  // Deletes the session and its lease (and its index entry) if `token` still holds the
  // lease; ABORTED otherwise.
  virtual absl::Status DeleteLeased(const std::string& id, const std::string& token) = 0;
  // The session's metadata, no lease taken. NOT_FOUND if absent.
  virtual absl::StatusOr<StoredSessionInfo> GetInfo(const std::string& id) = 0;
  // A page of at most `page_size` (1..1000) sessions in creation order, of `model`
  // (empty = every model) owned by `tenant` (empty = sessions of no tenant), after
  // `page_token` (empty = from the start; otherwise a value of next_page_token).
  // INVALID_ARGUMENT for a malformed token. Costs O(page_size + index entries skipped:
  // stale ones and other models' or tenants'), never a scan of the keyspace; a page may
  // come back short (even empty) with a next_page_token when many were skipped.
  virtual absl::StatusOr<SessionPage> List(const std::string& model, const std::string& tenant,
                                           int page_size, const std::string& page_token) = 0;
};

}  // namespace fwserve
