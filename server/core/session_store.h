// Metadata of every session (resident or spilled) and the per-session lease that keeps
// two requests off one session. Torch-free: the state tensors themselves live in the
// owning model's engine.
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
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace fwserve {

struct SessionRecord {
  std::string id;
  std::string model;
  // Tokens the state has absorbed (== the history's length in tokens).
  int64_t tokens = 0;
  int64_t state_bytes = 0;
  absl::Time created;
  absl::Time last_used;
  // True while one request holds the session's lease.
  bool busy = false;
  // False while the state is spilled to the session directory.
  bool resident = true;
};

class SessionStore {
 public:
  // max_sessions bounds resident plus spilled sessions.
  explicit SessionStore(int64_t max_sessions) : max_sessions_(max_sessions) {}

  // 128 random bits from the OS CSPRNG as 32 lowercase hex digits. Safe as a file name.
  static std::string NewSessionId();
  // True if `id` has the shape NewSessionId() produces.
  static bool IsWellFormedId(const std::string& id);

  // Adds a record. RESOURCE_EXHAUSTED (naming --max-sessions) when full.
  absl::Status Insert(SessionRecord record);
  // RESOURCE_EXHAUSTED if one more session would not fit (a fast pre-check).
  absl::Status CheckCapacity() const;
  absl::StatusOr<SessionRecord> Get(const std::string& id) const;
  // Sorted by creation time; `model` empty = all.
  std::vector<SessionRecord> List(const std::string& model) const;
  // Takes the lease: NOT_FOUND if unknown, ABORTED if another request holds it.
  absl::StatusOr<SessionRecord> Acquire(const std::string& id);
  // Returns the lease, recording the new token count and use time.
  void Release(const std::string& id, int64_t tokens, absl::Time used);
  // Returns the lease without changes (the request had no effect).
  void ReleaseUnchanged(const std::string& id);
  void SetResident(const std::string& id, bool resident);
  void Erase(const std::string& id);
  // Erases `id` unless a request holds it; false if it is held (or unknown).
  bool EraseIfIdle(const std::string& id);
  // Removes and returns the ids of `model`'s sessions idle since before `idle_before`
  // that no request holds.
  std::vector<std::string> TakeExpired(const std::string& model, absl::Time idle_before);
  // Sessions of `model` whose state is spilled to disk.
  int64_t CountSpilled(const std::string& model) const;
  int64_t size() const;

 private:
  absl::Status FullError() const;

  const int64_t max_sessions_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, SessionRecord> sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fwserve
