// Where sessions are found, claimed and kept: one interface over the three ways a
// server holds sessions, so that neither the core nor the engine branches on which one
// it has (docs/sessions.md):
//
//   memory          (--session-store=memory) nothing is stored; over the memory budget
//                   idle sessions are evicted. LocalSessionDirectory without a store.
//   dir:PATH        every change is written through to files; this replica's registry is
//                   the index (rebuilt from the files at start); a failed write keeps
//                   the state in memory and is retried. LocalSessionDirectory.
//   redis://...     the store is the truth, shared by replicas: a request claims its
//                   session with a lease in the store (renewed while it runs, fenced at
//                   commit); the resident pool is only a cache. SharedSessionDirectory.
//
// The core claims sessions (Claim, EndClaimThen) and answers reads (Get, List); the
// engine asks what to do with a session it changed (the policy accessors) and does its
// store I/O through WriteState / ReadState / DeleteState on store threads.
//
// Thread-safety: every method is thread-safe. Claim, Get and List answer on the calling
// thread or on a store thread; WriteState, ReadState and DeleteState block on I/O and
// are called on store threads only.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/api/requests.h"
#include "server/sessions/session_registry.h"
#include "server/sessions/store/session_store.h"
#include "server/sessions/store_errors.h"
#include "server/sessions/store_executor.h"

namespace fwserve {

// A request's lease on its session in a shared store. Created by the directory when the
// lease is taken, renewed by its renewal thread, and ended exactly once: by the fenced
// write or delete (on a store thread), or by a release when the request is answered
// without one (EndClaimThen). Thread-safe.
struct StoreTicket {
  StoreTicket(std::string id, std::string token, int64_t version, std::string tag)
      : id(std::move(id)), token(std::move(token)), version(version), tag(std::move(tag)) {}
  const std::string id;
  const std::string token;
  const int64_t version;  // the session's version when the lease was taken (the fence)
  const std::string tag;  // and the tag of that version
  // Set once the lease needs no release (committed, deleted, refused, or released).
  std::atomic<bool> ended{false};
  // Set by the renewal thread when the lease was found taken by someone else.
  std::atomic<bool> lost{false};
  // Set just before the fenced write or delete is sent: from then on the lease may
  // vanish because it ended, not because it was lost.
  std::atomic<bool> ending{false};
};

// One request's hold on an existing session, as Claim hands it over.
struct SessionClaim {
  // This replica's lease (at most one request per session here).
  SessionLease lease;
  // The session's model and owner.
  std::string model;
  // Shared store: the lease in the store (null with a local directory).
  std::shared_ptr<StoreTicket> ticket;
  // Shared store: the stored state, when this replica's cached copy is not current.
  std::optional<std::string> stored_state;
};

// A session's state on its way to the store (WriteState).
struct SessionWrite {
  std::string id;
  std::string model;
  std::string tenant;
  std::string blob;  // the encoded state, labels included
  int64_t tokens = 0;
  absl::Time created;
  absl::Time last_used;
  // The request's store lease (shared store, an existing session); null for a new
  // session and with a local directory.
  StoreTicket* ticket = nullptr;
  // The tag the written version gets (shared store; NewVersionTag()).
  std::string tag;
};

// What the engine does with the sessions it holds, by directory.
struct SessionPolicy {
  // Changes are written through to a store (dir:, redis://); false: memory only.
  bool durable = false;
  // A failed write keeps the changed state in memory, unstored, and is retried
  // (dir:); false: the resident copy is dropped and the store keeps the last
  // committed state (redis://).
  bool keeps_unstored = false;
  // Resident copies are a cache of a store other replicas write (redis://): each
  // stored version is tracked, a stale copy is dropped at admission, and a session
  // dropped from memory is forgotten here (the store is the index).
  bool shared = false;
  // The engine deletes expired sessions from the store (dir:); the store expires them
  // itself (redis://) or there is none (memory).
  bool engine_expires_stored = false;
};

// A session the indexer found in a local store: its record, or nullopt to skip it
// (with the reason logged by the describer). Called on the indexing thread.
using DescribeStoredSession =
    std::function<absl::StatusOr<SessionRecord>(const std::string& id, std::string blob)>;

class SessionDirectory {
 public:
  virtual ~SessionDirectory() = default;

  // --- The core's side.

  // Starts background work: indexing a local store's sessions with `describe` (until
  // it ends, a request naming one not indexed yet gets UNAVAILABLE), or renewing a
  // shared store's leases.
  virtual void Start(DescribeStoredSession describe) = 0;
  // Claims session `id` for one request of `tenant`, and answers `done` with the claim
  // or the client's error: INVALID_ARGUMENT for a session of another model than
  // `model` (empty: any), NOT_FOUND for an unknown session or another tenant's,
  // ABORTED while another request holds it, UNAVAILABLE when the store cannot be
  // reached. Local: at once, on the calling thread. Shared: on a store thread.
  void Claim(const std::string& tenant, const std::string& id, const std::string& model,
             std::function<void(absl::StatusOr<SessionClaim>)> done) {
    ClaimNamed(tenant, id, model, "session_id", std::move(done));
  }
  // Claim, with errors naming the request field `field` that gave the id (a
  // fork-and-generate's is fork_from).
  virtual void ClaimNamed(const std::string& tenant, const std::string& id,
                          const std::string& model, const std::string& field,
                          std::function<void(absl::StatusOr<SessionClaim>)> done) = 0;
  // Ends the store lease `ticket` (a release, unless a write or delete ended it), then
  // runs `answer`: on a store thread, or at once. Null `ticket`: `answer` at once.
  virtual void EndClaimThen(const std::shared_ptr<StoreTicket>& ticket,
                            std::function<void()> answer) = 0;
  // The record of a session of `tenant`.
  virtual void Get(const std::string& tenant, const std::string& id,
                   Callback<SessionRecord> done) = 0;
  // A page of `tenant`'s sessions (of `model`, if not empty), oldest first.
  // INVALID_ARGUMENT for a malformed page_token.
  virtual void List(const std::string& tenant, const std::string& model, int page_size,
                    const std::string& page_token, Callback<SessionList> done) = 0;
  // Waits for the directory's own store jobs, until `deadline`. True if none is left.
  virtual bool WaitIdle(absl::Time deadline) = 0;
  // Stops the background work and waits for the directory's store jobs. The engines
  // may still answer requests (and end claims) after it: call AwaitJobs after them.
  virtual void StopBackground() = 0;
  virtual void AwaitJobs() = 0;

  // --- The engine's side.

  virtual const SessionPolicy& policy() const = 0;
  // The tag a new version written by `ticket`'s request (null: a new session) gets.
  virtual std::string NewVersionTag(const StoreTicket* ticket) const = 0;
  // Store thread: puts the state; returns the stored version (shared store; 0 else).
  // A fenced write whose lease was lost is ABORTED, and nothing is written.
  virtual absl::StatusOr<int64_t> WriteState(const SessionWrite& write) = 0;
  // Store thread: the stored state of `id`.
  virtual absl::StatusOr<std::string> ReadState(const std::string& id) = 0;
  // Store thread: deletes `id` (fenced by `ticket` in a shared store).
  virtual absl::Status DeleteState(const std::string& id, StoreTicket* ticket) = 0;
  // The client's error for a failed store call (store_errors.h).
  virtual absl::Status ClientError(StoreCall call, const std::string& id,
                                   const absl::Status& store_status,
                                   const char* what = "") const = 0;

  // The registry this directory keeps its sessions in.
  virtual SessionRegistry& registry() = 0;
  virtual StoreExecutor& executor() = 0;
};

struct SessionDirectoryOptions {
  // The store; null = memory only. Owned by the directory.
  std::unique_ptr<SessionStore> store;
  // Threads doing store I/O (ignored without a store: one thread).
  int32_t store_threads = 2;
  // Sessions held (resident plus spilled) (--max-sessions).
  int64_t max_sessions = 100000;
  // Shared store: a request's lease expires this long after it was taken or renewed
  // (--session-lease-ttl); renewed every third of it.
  absl::Duration lease_ttl = absl::Seconds(10);
  // --session-store-timeout (quoted by UNAVAILABLE errors).
  absl::Duration store_timeout = absl::Seconds(1);
  // Model names to state bytes per session, for records read from a shared store.
  std::function<int64_t(const std::string& model)> state_bytes_of;
  // Whether this server serves `model`: a claim of a session of another model is
  // FAILED_PRECONDITION (a shared store may hold other deployments' models).
  std::function<bool(const std::string& model)> is_served;
};

// The directory for `options.store`: shared when the store is a SharedSessionStore,
// else local (with or without a store).
std::unique_ptr<SessionDirectory> MakeSessionDirectory(SessionDirectoryOptions options);

}  // namespace fwserve
