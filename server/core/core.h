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

namespace fwserve {

class Metrics;
class SessionSealer;
class Tenants;

struct CoreOptions {
  // Checkpoint directories; the first is the default model. A model's name is its
  // directory's base name.
  std::vector<std::string> model_dirs;
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
  // "cpu" or "cuda" / "cuda:N".
  std::string device = "cpu";
  // Longest prompt, prefix or scored text, in bytes.
  int64_t max_prompt_bytes = 1 << 20;
  // Largest max_tokens of one Generate.
  int32_t max_tokens = 4096;
  // Sessions held (resident plus spilled).
  int64_t max_sessions = 100000;
  // Bytes of recurrent state resident in memory, over all models (sessions in use and
  // idle; spilled ones do not count).
  int64_t max_state_memory_bytes = int64_t{1} << 30;
  // Work items waiting for each model's engine; beyond it RESOURCE_EXHAUSTED.
  int32_t max_queued_requests = 1024;
  // The longest a stream should wait in a model's queue: the queue holds only what its
  // measured drain rate starts within it (EngineOptions::max_queue_wait). 0 = no bound.
  absl::Duration max_queue_wait = absl::ZeroDuration();
  // EngineOptions::codel_target and codel_interval (--queue-codel-target,
  // --queue-codel-interval): CoDel with adaptive LIFO on each model's queue. 0 = off.
  absl::Duration queue_codel_target = absl::ZeroDuration();
  absl::Duration queue_codel_interval = absl::Milliseconds(100);
  // EngineOptions::preempt_for_fair_share (--preempt-for-fair-share).
  bool preempt_for_fair_share = false;
  // Generate/Score requests each engine serves at once; more wait in the queue.
  int32_t max_active_streams = 256;
  // Tokens of one prompt absorbed per engine iteration (sequence form); bounds how
  // long a long prompt can stall other streams.
  int32_t prefill_chunk_tokens = 256;
  // Tokens one prefill job absorbs over all the prompts it batches (prompts whose next
  // pieces have the same length go together); 0 = prefill_chunk_tokens. A GPU runs a
  // wide batch for about the time of one prompt (--prefill-batch-tokens).
  int32_t prefill_batch_tokens = 0;
  // Idle sessions are deleted after this long.
  absl::Duration session_ttl = absl::Hours(24);
  // How long a decode step may wait for more streams to become ready, to batch them.
  absl::Duration batch_wait = absl::Microseconds(300);
  // LibTorch intra-op threads; 0 = leave LibTorch's default.
  int32_t intra_op_threads = 0;
  // Threads one native prefill chunk may use (--prefill-threads); 0 = the CPUs this
  // process may run on.
  int32_t prefill_threads = 0;
  // The decode step: "native" (float32 CPU models, models/native_step.h: fused sgemm
  // projections, state updated in place in the pool; on a CUDA model it means
  // "graph"), "graph" (models/graphed_step.h: the step on per-batch-size buffers,
  // replayed as CUDA Graphs on CUDA and run eagerly on the CPU, with sampling on the
  // device) or "libtorch" (Model::Step on gathered rows, the reference). What a model
  // cannot use falls back to "libtorch" (float64 models always do).
  std::string decode_kernel = "native";
  // The native kernel's GEMMs (models/packed_linear.h): "libxsmm" (JIT kernels on
  // weights laid out at load, OpenBLAS where unavailable) or "openblas" (cblas_sgemm).
  std::string native_gemm = "libxsmm";
  // The graph kernel on a CUDA model (or with decode_kernel "graph") samples inside its
  // in-place step: one copy each way and one synchronisation per token
  // (--sample-in-step). False: the step only steps; sampling runs apart.
  bool sample_in_step = true;
  // Multi-step decode (--decode-steps-per-launch): with the in-place graph step and
  // sample_in_step, a launch may draw and absorb up to this many tokens per stream,
  // each fed back on the device, for streams without a session or a repetition penalty
  // (bounded by their max tokens and decode_lookahead; the others draw one). A stop
  // string stops the stream on the host; the tokens drawn past it are dropped with the
  // stream's state. 1 = one token per launch. In [1, 64].
  int32_t decode_steps_per_launch = 1;
  // Each decode step runs on a step thread of the model's runner, and the engine plans
  // the next prefill chunk while it runs (--overlap-steps): on a GPU the host work of a
  // step hides behind the device's. Off: the engine thread runs the step itself.
  bool overlap_steps = false;
  // Conversations of stateless chat and responses requests kept per tenant and model,
  // so that a replayed history continues from its state (GenerateParams::reuse_prefix;
  // --prefix-reuse-entries). Each is a session of the tenant; 0 = off.
  int32_t prefix_reuse_entries = 64;
  // Decode pipelining: tokens a stream may sample and absorb beyond the last one whose
  // write was confirmed. While a write is in flight the stream keeps decoding; what it
  // samples meanwhile goes out as one chunk when the write returns. 1 = the next token
  // is computed during the write of the previous one.
  int32_t decode_lookahead = 16;
  // How long a stream's tokens may wait to be written together (0: each goes out as
  // soon as the previous write returns). Fewer, fuller messages cost less CPU per token
  // in gRPC, the kernel and the client, for up to this much added latency on the first
  // token of each message. Bounded by decode_lookahead tokens per message.
  absl::Duration stream_flush_interval = absl::ZeroDuration();
  // Not owned; may be null (no metrics).
  Metrics* metrics = nullptr;
  // Tenants and their quotas (--api-keys-file). Null: an open server, one anonymous
  // tenant without quotas. Not owned; thread-safe, reloadable.
  const Tenants* tenants = nullptr;
  // Seals exported blobs and checks imported ones (--session-key-file). Null: blobs
  // are not signed, and signed ones are refused on import. Not owned.
  const SessionSealer* sealer = nullptr;
  // Test-only; null in production. Called on a model's engine thread before each decode
  // step; `ending()` is true once shutdown has asked the engine to end the remaining
  // work (EndAllWork). Tests block here to hold streams open without depending on how
  // fast the machine decodes (tests/integration/server_test.cc, StepGate).
  std::function<void(const std::function<bool()>& ending)> before_decode_step_for_testing;
  // Test-only; null in production. Called on a model's engine thread when a stream
  // (Generate, Score, CreateSession) is admitted, with its tenant: the server's own
  // admission order, which tests of the fair share read instead of racing client threads.
  std::function<void(const std::string& tenant)> stream_admitted_for_testing;
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
