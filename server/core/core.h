// The serving core: the models, one engine per model, the session store. This is the
// only interface the transport layer uses. Torch-free.
//
// Calls never block on model work: each hands a work item to the model's engine and
// returns; results come back through callbacks on the engine thread, which must not
// block either (the transport only starts gRPC writes/finishes in them).
//
// Thread-safety: every method is thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/api/requests.h"
#include "server/base/clock.h"
#include "server/engine/engine_options.h"

namespace fwserve {

class Metrics;
class Tenants;

struct CoreOptions {
  // Checkpoint directories; the first is the default model. A model's name is its
  // directory's base name.
  std::vector<std::string> model_dirs;
  // "cpu" or "cuda" / "cuda:N" (--device).
  std::string device = "cpu";
  // "float32" or "bf16" (--gpu-matrices; ModelEngineSpec::gpu_matrices).
  std::string gpu_matrices = "float32";
  // TF32 tensor cores for float32 cuBLAS products (--gpu-tf32; ModelEngineSpec::gpu_tf32).
  bool gpu_tf32 = false;
  // What each model's engine is told, as it is: its queue, its scheduler, its kernels,
  // the session and state-memory limits it shares with the core (engine_options.h).
  EngineOptions engine;
  // Where sessions live durably (session_store.h): "memory" (nothing is stored; over
  // the memory budget idle sessions are evicted) or "dir:PATH". With a store, every
  // change is written through before the request is answered (docs/sessions.md).
  std::string session_store = "memory";
  // Threads doing session-store I/O (shared by all models). With redis:// they also
  // take and release sessions' leases, so they bound the session requests in flight
  // to the store at once.
  int32_t store_threads = 2;
  // redis:// only. A file whose first line is the store's password (empty = none).
  std::string session_store_password_file;
  // redis:// only. Bound on connecting and on each store command; a request that needs
  // the store gets UNAVAILABLE "session store unavailable" past it.
  absl::Duration session_store_timeout = absl::Seconds(1);
  // redis:// only. A request's lease on its session expires this long after it was
  // taken or last renewed (renewed every third of it while the request runs). A
  // replica that stalls longer loses the lease, and its late write is refused.
  absl::Duration session_lease_ttl = absl::Seconds(10);
  // Time source for session creation/use times and the TTL; null = the real clock.
  // Not owned.
  const Clock* clock = nullptr;
  // Longest prompt, prefix or scored text, in bytes (--max-prompt-bytes; > 0).
  int64_t max_prompt_bytes = 1 << 20;
  // Largest max_tokens of one Generate (--max-tokens; > 0).
  int32_t max_tokens = 4096;
  // Conversations of stateless chat and responses requests kept per tenant and model,
  // so that a replayed history continues from its state (GenerateParams::reuse_prefix;
  // --prefix-reuse-entries). Each is a session of the tenant; 0 = off.
  int32_t prefix_reuse_entries = 64;
  // Not owned; may be null (no metrics).
  Metrics* metrics = nullptr;
  // Tenants and their quotas (--api-keys-file). Null: an open server, one anonymous
  // tenant without quotas. Not owned; thread-safe, reloadable.
  const Tenants* tenants = nullptr;
};

class Core {
 public:
  // Checks the options (errors name the flag, e.g. --max-tokens, and the bad value),
  // opens the session store, loads every model and starts the engines. Sessions stored
  // by an earlier run are indexed in the background: until that ends, a request naming
  // one not indexed yet gets UNAVAILABLE.
  static absl::StatusOr<std::unique_ptr<Core>> Create(const CoreOptions& options);
  virtual ~Core() = default;

  virtual std::vector<ModelDescription> ListModels() const = 0;
  virtual absl::StatusOr<ModelDescription> DescribeModel(const std::string& model) const = 0;

  // OK: accepted; the observer gets OnStart, then chunks, then OnFinish exactly once.
  // An error is returned at once (and OnChunk/OnFinish never come) for invalid input,
  // an unknown model or session, a busy session, a full queue, or shutdown.
  // RESOURCE_EXHAUSTED names the tenant quota (max_streams, tokens_per_second) when
  // the caller's tenant is over it.
  virtual absl::Status StartGenerate(const Caller& caller, GenerateParams params,
                                     GenerateObserver* observer) = 0;

  // Each calls `done` exactly once, on the engine thread or (for immediate errors) on
  // the calling thread.
  virtual void Score(const Caller& caller, ScoreParams params, Callback<ScoreResult> done) = 0;
  // `is_cancelled` as in ScoreParams: a cancelled create leaves no session behind. The
  // new session (also of Fork and Import) belongs to the caller's tenant, and counts
  // against its max_sessions quota.
  virtual void CreateSession(const Caller& caller, const std::string& model, std::string prefix,
                             Callback<SessionRecord> done,
                             std::function<bool()> is_cancelled = nullptr) = 0;
  virtual void ForkSession(const Caller& caller, const std::string& session_id,
                           Callback<SessionRecord> done) = 0;
  virtual void ExportSession(const Caller& caller, const std::string& session_id,
                             Callback<ExportResult> done) = 0;
  // With a sealer, the blob's signature is checked before anything in it is parsed.
  // Ownership written in a blob is never trusted.
  virtual void ImportSession(const Caller& caller, const std::string& model, std::string blob,
                             Callback<SessionRecord> done) = 0;
  virtual void DeleteSession(const Caller& caller, const std::string& session_id,
                             Callback<bool> done) = 0;
  // With a shared store (redis://) these read the store, so they answer through
  // `done` like the rest (on a store thread, or at once on the calling thread).
  virtual void GetSession(const Caller& caller, const std::string& session_id,
                          Callback<SessionRecord> done) = 0;
  // The session and the text its last committed Generate produced (LastOutput in
  // server/api/session_record.h), with every store: a session that is not resident is
  // read from the store (not made resident). It takes the session's lease while it
  // reads, like ExportSession: ABORTED while a request holds the session; NOT_FOUND
  // for an unknown session or another tenant's.
  virtual void GetSessionOutput(const Caller& caller, const std::string& session_id,
                                Callback<SessionOutput> done) = 0;
  // The caller's sessions only. INVALID_ARGUMENT for a negative page_size or a
  // malformed page_token.
  virtual void ListSessions(const Caller& caller, ListSessionsParams params,
                            Callback<SessionList> done) = 0;

  // Whether new work can be served in full: OK once every model is loaded (always, once
  // the core exists) and the session store's index is complete; UNAVAILABLE while a
  // local store is still being indexed at start-up (a request for a session not indexed
  // yet would get UNAVAILABLE). For readiness probes. Thread-safe, never blocks.
  virtual absl::Status Readiness() const = 0;

  // Graceful shutdown, in this order (the transport interleaves its own steps):
  // 1. BeginShutdown: new work is refused with UNAVAILABLE; accepted work goes on.
  virtual void BeginShutdown() = 0;
  // 2. Waits until no work is queued or running, or until `deadline`. True if idle.
  virtual bool WaitIdle(absl::Time deadline) = 0;
  // 3. Ends what still runs: streams finish (reason SHUTDOWN) once their current write
  //    completes; queued work fails with UNAVAILABLE. Returns at once.
  virtual void EndAllWork() = 0;
  // 4. After the transport stopped (no callbacks in flight): stops the engines (a last
  //    attempt to store sessions whose writes failed). Idempotent.
  virtual void Stop() = 0;
};

}  // namespace fwserve
