// One engine's session keeping: which sessions are resident in the StatePool (and
// which one gives its slot up), loading a session's state from the store, write-through
// of changed sessions, the session operations (fork, export, import, delete, reading the
// last output), what a stream task holds of its session from admission to its end,
// housekeeping (TTL, memory reclaim, retrying failed writes), and the end of a request's
// claim on its session (BindClaim). LibTorch inside; internal to the core.
//
// Durability (docs/sessions.md): a request that changes a session answers its caller
// only after the session store holds the new state; the session's lease is held until
// then. Store I/O runs on the directory's store threads; its results come back to the
// engine thread as continuations (KeeperHost), so every session-state change happens
// on the engine thread.
//
// Thread-safety: BindClaim is thread-safe. Everything else runs on the engine thread;
// the store jobs it starts run on store threads with private copies of rows.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "models/architectures/model.h"
#include "models/checkpoints/state_codec.h"
#include "server/api/session_record.h"
#include "server/base/clock.h"
#include "server/engine/engine_options.h"
#include "server/engine/residency.h"
#include "server/engine/state_pool.h"
#include "server/engine/work_item.h"
#include "server/metrics/metrics.h"
#include "server/sessions/session_directory.h"
#include "server/sessions/session_labels.h"

namespace fwserve {

// What the keeper asks of its engine (Engine implements it).
class KeeperHost {
 public:
  virtual ~KeeperHost() = default;
  // Any thread: a store job starts. The engine counts it as work in flight (WaitIdle,
  // the loop's end) until StoreJobDone.
  virtual void StoreJobStarted() = 0;
  // Store thread: the job ended; `then` (may be null) runs on the engine thread in its
  // next iteration.
  virtual void StoreJobDone(std::function<void()> then) = 0;
  // Engine thread: admits `item` again, its state now loaded (WorkItem::loaded).
  virtual void Readmit(std::unique_ptr<WorkItem> item) = 0;
};

// What a keeper works with. Pointers are not owned and outlive the keeper.
struct KeeperContext {
  std::string name;  // the model's
  const fwmodel::Model* model = nullptr;
  std::string fingerprint;
  // session_ttl, max_state_memory_bytes, sealer.
  const EngineOptions* options = nullptr;
  SessionDirectory* directory = nullptr;
  StateMemoryBudget* budget = nullptr;
  const Clock* clock = nullptr;
  ModelMetrics* metrics = nullptr;  // never null
  StatePool* pool = nullptr;        // the engine's runner's
  KeeperHost* host = nullptr;
};

// What a stream task (Generate, Score, CreateSession) holds of its session from
// admission on (OpenStream).
struct StreamSession {
  std::string id;      // empty: a throwaway stream
  int slot = -1;       // the row the stream reads or advances; -1: a throwaway Score
  int64_t tokens = 0;  // the tokens the row holds
  // A session made for this stream (GenerateParams::fork_from, or a kept conversation):
  // removed if the stream keeps nothing.
  bool forked = false;
};

// How a stream task ended, for its session (CommitStream, FailStream).
struct StreamEnd {
  std::string id;  // StreamSession::id
  int slot = -1;
  int64_t tokens = 0;  // the tokens the row holds now
  bool forked = false;
  int64_t delivered = 0;     // tokens whose writes the client confirmed
  bool cut = false;          // cancelled or shut down
  bool rolled_back = false;  // the row was put back as it was before the request
  LastOutput output;         // what the client received (kept by a Generate that commits)
};

class SessionKeeper {
 public:
  explicit SessionKeeper(KeeperContext context);
  SessionKeeper(const SessionKeeper&) = delete;
  SessionKeeper& operator=(const SessionKeeper&) = delete;

  // Binds `claim` (SessionDirectory::Claim's answer for the item's session) to `item`:
  // the item takes the lease and the store ticket, and every answer to it first ends
  // the claim (SessionDirectory::EndClaimThen: a release of the store lease unless the
  // fenced write or delete ended it), then answers. Before the item is submitted, on
  // any thread.
  static void BindClaim(SessionDirectory& directory, SessionClaim& claim, WorkItem& item);

  // --- Admission.
  // Whether `item` needs its session's state read from the store (or its import blob
  // decoded) before it can run. With a shared store, first drops the resident copy of
  // the session unless its version is the one the item's lease was taken at.
  bool NeedsLoad(WorkItem& item);
  // Reads the session's state from the store (or decodes an import blob) on a store
  // thread, then admits the item again (KeeperHost::Readmit) with item->loaded set.
  void StartLoad(std::unique_ptr<WorkItem> item);
  // Runs a fork, export, import, delete or last-output read, and answers it (after the
  // store holds a change). `item` is taken unless the keeper throws.
  void RunSessionOperation(std::unique_ptr<WorkItem>& item);

  // --- Stream tasks.
  // The row a stream admitted for `item` runs on: a new session's (CreateSession; a
  // fork or a kept conversation, GenerateWork::fork_id, registered leased), the item's
  // session's (made resident; in use until the stream ends), or a throwaway's. A fork
  // releases its source unchanged (and ends its claim). On error nothing is held.
  absl::StatusOr<StreamSession> OpenStream(WorkItem& item);
  // The stream ended normally (or was cut): commits its session (written through) and
  // then calls `answer`; a new session that keeps nothing is removed, a throwaway's row
  // freed, a Score changes nothing. `answer` gets OK or the client's store error.
  void CommitStream(std::shared_ptr<WorkItem> item, StreamEnd end,
                    std::function<void(absl::Status)> answer);
  // The stream failed with `status`: tokens the client received stay committed (written
  // through), a new session is removed unless it keeps what was streamed; then the item
  // is answered with `status` (or the store's error).
  void FailStream(std::unique_ptr<WorkItem> item, StreamEnd end, absl::Status status);
  // The registry's record of session `id`.
  absl::StatusOr<SessionRecord> Record(const std::string& id) const;

  // --- Housekeeping: memory reclaim, TTL, retrying failed writes (not while `ending`),
  // the session gauges. Never throws.
  void Housekeeping(bool ending);
  // At the engine's exit: a last attempt to store sessions whose writes failed.
  void StoreUnstoredAtExit();

 private:
  // Shared store: drops the resident copy of the item's session unless its version is
  // the one the item's lease was taken at (then the item is served from the cache).
  void DropStaleCopy(WorkItem& item);
  // Ends `lease` after the write-through of a changed session: committed when
  // `written` is OK; otherwise kept in memory to retry (dir:), or forgotten (shared
  // store: the local copy was dropped and the store keeps the last committed state).
  void EndLeaseAfterWrite(SessionLease& lease, const std::string& id, int64_t tokens,
                          absl::Time now, const absl::Status& written);
  // The client's error for a failed write-through (details go to the log).
  absl::Status WriteFailure(const std::string& id, const absl::Status& written,
                            const char* what) const;
  // The session's slot; from item.loaded when it is not resident.
  absl::StatusOr<int> EnsureResident(WorkItem& item);
  // Write-through: copies the slot now, encodes and stores it on a store thread, then
  // runs `then(status)` on the engine thread. Without a store, `then(OK)` runs at once.
  // With a shared store, `ticket` fences the write (null: a new session, created at
  // version 1); on success the resident copy takes the new version, on failure it is
  // dropped (the store keeps the last committed state).
  void WriteThrough(const std::string& id, int slot, int64_t tokens, absl::Time created,
                    absl::Time last_used, std::shared_ptr<StoreTicket> ticket,
                    std::function<void(absl::Status)> then);
  // A new session made by fork or import, in `slot`, with the source's last output:
  // registered busy, stored, then answered through `done`.
  void CommitNewSession(std::unique_ptr<WorkItem> item, Callback<SessionRecord> done, int slot,
                        int64_t tokens, LastOutput last_output, const char* operation);
  // Store thread (or the engine thread at exit): encodes a session's row with its
  // `labels` (their model is this engine's) and puts it in the store, timing a success
  // and logging and counting a failure. Returns the stored version (shared store; 0
  // otherwise). `new_tag`: the tag a shared store gives a created session (a commit's
  // tag is its ticket's token).
  absl::StatusOr<int64_t> StoreRow(const StoredSessionLabels& labels, const fwmodel::State& row,
                                   const torch::Tensor& logits, int64_t tokens, StoreTicket* ticket,
                                   const std::string& new_tag = "");
  // The last output the labels of `item.loaded` carry (a stored state, or an import's
  // blob). A malformed label fails the item: INVALID_ARGUMENT for an import's blob,
  // DATA_LOSS (logged) for a stored state, as an unreadable state would.
  absl::StatusOr<LastOutput> LoadedLastOutput(const WorkItem& item) const;
  // Store thread: deletes `id` from the store (fenced by `ticket` with a shared
  // store), logging and counting a failure.
  absl::Status DeleteFromStore(const std::string& id, StoreTicket* ticket);
  // Runs `job` on a store thread; the function it returns runs on the engine thread.
  void RunStoreJob(std::function<std::function<void()>()> job);
  absl::StatusOr<int> AllocateSlot();
  void FreeSlot(int slot);
  // Registers a new session `id` of `tenant` holding `tokens` in `slot`, leased to the
  // caller; on failure frees `slot` and returns the registry's error.
  absl::StatusOr<SessionLease> LeaseNewSession(const std::string& id, const std::string& tenant,
                                               int64_t tokens, int slot, absl::Time now);
  // Frees the least recently used idle resident session's slot (dropped from memory
  // when the store holds it, else evicted with the memory backend). False if none.
  bool ReleaseOneIdle();
  void RemoveSession(const std::string& id);
  // Session `id` is gone: removed from memory (RemoveSession) and the registry, and its
  // `lease` ended with nothing to release. For a deleted session, and for a new one
  // that keeps nothing or whose first write failed.
  void EraseSession(const std::string& id, SessionLease& lease);
  void RetryUnstored();
  void PublishGauges();

  const std::string name_;
  const fwmodel::Model& model_;
  const std::string fingerprint_;
  const EngineOptions& options_;
  SessionDirectory* const directory_;
  SessionRegistry* const registry_;
  const SessionPolicy policy_;  // the directory's
  StoreExecutor* const executor_;
  StateMemoryBudget* const budget_;
  const Clock* const clock_;
  ModelMetrics* const metrics_;
  StatePool& pool_;
  KeeperHost* const host_;
  const int64_t state_bytes_;
  ResidentSessions resident_;
};

}  // namespace fwserve
