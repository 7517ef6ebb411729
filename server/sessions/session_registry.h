// Metadata of every session of this server (resident or not) and the per-session lease
// that keeps two requests off one session. Torch-free: the state tensors live in the
// owning model's StatePool, the durable copy in the SessionStore.
//
// Thread-safety: all methods are thread-safe (one mutex; no method blocks on I/O).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/api/session_record.h"

namespace fwserve {

class SessionRegistry;

// The right to change one session, held by at most one request. Move-only; a lease that
// is destroyed without Commit() is released with the session unchanged.
class SessionLease {
 public:
  SessionLease() = default;
  SessionLease(SessionLease&& other) noexcept { *this = std::move(other); }
  SessionLease& operator=(SessionLease&& other) noexcept;
  ~SessionLease() { Release(); }

  bool held() const { return registry_ != nullptr; }
  const std::string& id() const { return id_; }
  // Ends the lease, recording the request's effect.
  void Commit(int64_t tokens, absl::Time last_used, bool stored);
  // Ends the lease; the session is unchanged. No-op if not held.
  void Release();
  // Ends the lease; the session's state is unchanged but it was used at `last_used`
  // (export, fork source): restarts its idle clock.
  void ReleaseUsed(absl::Time last_used);
  // Ends the lease because the session was removed (nothing to release).
  void Forget();

 private:
  friend class SessionRegistry;
  SessionLease(SessionRegistry* registry, std::string id)
      : registry_(registry), id_(std::move(id)) {}

  SessionRegistry* registry_ = nullptr;
  std::string id_;
};

class SessionRegistry {
 public:
  // max_sessions bounds the sessions held (resident or only in the store).
  explicit SessionRegistry(int64_t max_sessions) : max_sessions_(max_sessions) {}

  // Adds a record (not busy). RESOURCE_EXHAUSTED (naming --max-sessions) when full.
  absl::Status Insert(SessionRecord record);
  // Adds a record and returns its lease (the session is busy until the lease ends).
  absl::StatusOr<SessionLease> InsertLeased(SessionRecord record);
  // RESOURCE_EXHAUSTED if one more session would not fit (a fast pre-check).
  absl::Status CheckCapacity() const;
  absl::StatusOr<SessionRecord> Get(const std::string& id) const;
  // Sorted by creation time; `model` empty = all.
  std::vector<SessionRecord> List(const std::string& model) const;
  // Takes the lease: NOT_FOUND if unknown, ABORTED if another request holds it,
  // UNAVAILABLE if unknown while the store is still being indexed. `field`: the request
  // field the errors name (a fork-and-generate's is fork_from).
  absl::StatusOr<SessionLease> Acquire(const std::string& id,
                                       absl::string_view field = "session_id");
  // `version`: of the resident copy (shared store only; 0 otherwise).
  void SetResident(const std::string& id, bool resident, int64_t version = 0);
  // Shared store: records what the store said of a session this replica is about to
  // serve and takes its lease, in one step. A new record is not resident; an existing
  // one keeps its residency and version (those describe this replica's copy) and its
  // later last-use time, and takes the rest from `record`. The registry is a cache
  // here: when full, an idle record without a resident copy makes room;
  // RESOURCE_EXHAUSTED (--max-sessions) only when every record is busy or resident.
  // ABORTED if a request of this replica holds the session.
  absl::StatusOr<SessionLease> AcquireFromStore(const SessionRecord& record,
                                                absl::string_view field = "session_id");
  void Erase(const std::string& id);
  // Erases `id` unless a request holds it; false if it is held (or unknown).
  bool EraseIfIdle(const std::string& id);
  // Removes and returns the ids of `model`'s sessions idle since before `idle_before`
  // that no request holds.
  std::vector<std::string> TakeExpired(const std::string& model, absl::Time idle_before);
  // Ids of `model`'s resident sessions that the store does not hold (failed writes)
  // and no request holds.
  std::vector<std::string> Unstored(const std::string& model) const;
  // Sessions of `model` whose state is only in the store.
  int64_t CountNotResident(const std::string& model) const;
  int64_t size() const;
  // Sessions held by `tenant` (resident or not).
  int64_t CountOfTenant(const std::string& tenant) const;

  // What a request for an unknown `id` gets: NOT_FOUND (UNAVAILABLE while indexing).
  // Also the answer for another tenant's session, so that the two cannot be told apart.
  absl::Status NotFoundError(const std::string& id, absl::string_view field = "session_id") const;

  // While indexing, an unknown id may still be in the store: UNAVAILABLE, not NOT_FOUND.
  void SetIndexing(bool indexing);
  bool indexing() const;

 private:
  friend class SessionLease;
  void Commit(const std::string& id, int64_t tokens, absl::Time last_used, bool stored);
  void ReleaseUnchanged(const std::string& id);
  void ReleaseUsed(const std::string& id, absl::Time last_used);
  absl::Status FullError() const;
  // Inserts or replaces, keeping sessions_of_tenant_ in step.
  void PutLocked(SessionRecord record) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(absl::flat_hash_map<std::string, SessionRecord>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static absl::Status Busy(const std::string& id, absl::string_view field);
  absl::Status Unknown(const std::string& id, absl::string_view field = "session_id") const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t max_sessions_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, SessionRecord> sessions_ ABSL_GUARDED_BY(mu_);
  // Sessions per owning tenant (entries of zero are removed).
  absl::flat_hash_map<std::string, int64_t> sessions_of_tenant_ ABSL_GUARDED_BY(mu_);
  bool indexing_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace fwserve
