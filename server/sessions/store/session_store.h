// Where sessions' states live durably: an interface with one implementation per
// backend, chosen by --session-store. Backends store opaque blobs (the engine encodes
// them; see models/checkpoints/state_codec.h) under session ids and know nothing of models, so a
// network store fits behind the same interface.
//
// Backends:
//   memory      nothing is stored (OpenSessionStore returns null): sessions live only
//               in the server's memory, and over the memory budget idle ones are evicted.
//   dir:PATH    one file per session in a local directory (DirectorySessionStore).
//   redis://HOST:PORT[/DB]
//               a Redis shared by several replicas (RedisSessionStore, a
//               SharedSessionStore: see shared_session_store.h).
//
// Thread-safety: every method is thread-safe and may block on I/O, so callers run them
// on store threads (StoreExecutor), never on an engine thread. Error messages may name
// paths or hosts: they are for the server log, not for clients.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace fwserve {

class SessionStore {
 public:
  virtual ~SessionStore() = default;
  // The backend as configured, e.g. "dir:/var/lib/fwserve/sessions" (for logs).
  virtual std::string Describe() const = 0;
  // Replaces the blob of session `id`. When it returns OK the blob survives a crash of
  // this process (and, for dir:, of the machine).
  virtual absl::Status Put(const std::string& id, const std::string& blob) = 0;
  // NOT_FOUND if the store holds no blob for `id`.
  virtual absl::StatusOr<std::string> Get(const std::string& id) = 0;
  // Removes `id`; OK if it was not there. Durable when it returns OK.
  virtual absl::Status Delete(const std::string& id) = 0;
  // Calls `visit` with every stored id, in no particular order, until it returns false.
  virtual absl::Status ForEachId(const std::function<bool(const std::string& id)>& visit) = 0;
};

// Settings of network backends (redis://); the others ignore them.
struct SessionStoreOptions {
  // A file holding the password (its first line), never the password itself: command
  // lines are visible to every user of the machine. Empty = no AUTH.
  std::string password_file;
  // Bound on connecting and on each command; past it, UNAVAILABLE.
  absl::Duration timeout = absl::Seconds(1);
  // Connections kept open (each serves one command at a time).
  int32_t pool_size = 4;
  // Idle sessions expire this long after their last use (a store-side expiry).
  absl::Duration session_ttl = absl::Hours(24);
  // Prefix of every key, so that several deployments can share one Redis.
  std::string key_prefix = "fws:";
  // Called after each store operation with its name ("acquire", "commit", ...), its
  // duration and its outcome; may be null. Called on the calling thread.
  std::function<void(const char* op, absl::Duration took, const absl::Status& status)> observer;
};

// Parses a --session-store value and opens the backend. "memory" gives null (no
// store). Errors name the flag and the bad value. A redis:// store that cannot be
// reached at start is still returned (it reconnects by itself); its problems are
// logged.
absl::StatusOr<std::unique_ptr<SessionStore>> OpenSessionStore(
    const std::string& spec, const SessionStoreOptions& options = {});

}  // namespace fwserve
