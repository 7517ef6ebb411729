// Prometheus metrics of the server. Torch-free; names follow Prometheus conventions
// (prefix fwserve_, base units, _total counters, _seconds histograms). The full list,
// with the meaning of each series, is in docs/metrics.md.
//
// Thread-safety: every method may be called from any thread (prometheus-cpp metrics are
// atomic). ModelMetrics pointers stay valid for the life of the Metrics object.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace fwserve {

// Series of one model, resolved once so that per-token updates are lock-free.
class ModelMetrics {
 public:
  virtual ~ModelMetrics() = default;
  // Generate: seconds from the request's arrival to its first streamed token.
  virtual void ObserveTimeToFirstToken(double seconds) = 0;
  // Generate: seconds between consecutive streamed tokens of one stream, observed
  // `count` times (the tokens of one message share the wait since the previous one).
  virtual void ObserveInterTokenLatency(double seconds, int64_t count) = 0;
  void ObserveInterTokenLatency(double seconds) { ObserveInterTokenLatency(seconds, 1); }
  // Generate: seconds from arrival to the final message.
  virtual void ObserveGenerationDuration(double seconds) = 0;
  // Tokens absorbed by prefill (prompts, session prefixes).
  virtual void AddPromptTokens(int64_t tokens) = 0;
  // Tokens streamed to clients.
  virtual void AddGeneratedTokens(int64_t tokens) = 0;
  // Tokens a request did not have to re-read because its session already held them.
  virtual void AddPromptTokensSaved(int64_t tokens) = 0;
  // Tokens scored by Score.
  virtual void AddScoredTokens(int64_t tokens) = 0;
  // A running stream parked for another tenant's fair share (--preempt-for-fair-share).
  virtual void CountPreempted() = 0;
  // A queued stream refused by CoDel (--queue-codel-target) after it waited.
  virtual void CountShed() = 0;
  // One batched recurrent step over `batch_size` streams.
  virtual void ObserveDecodeStep(int64_t batch_size, double seconds) = 0;
  // One prefill chunk (sequence form) of `tokens` tokens.
  virtual void ObservePrefillChunk(int64_t tokens, double seconds) = 0;
  // Work items waiting in the engine queue / streams being served.
  virtual void SetQueuedRequests(int64_t count) = 0;
  // How long a stream queued now is expected to wait before it starts (the retry hint
  // and deadline admission use it; docs/serving.md "Overload").
  virtual void SetExpectedQueueWait(double seconds) = 0;
  // How long an admitted stream waited in the queue.
  virtual void ObserveQueueWait(double seconds) = 0;
  virtual void SetActiveStreams(int64_t count) = 0;
  // Sessions of this model with state in the pool / only in the session store, and the bytes of
  // resident state (sessions in the pool, including throwaway ones in use).
  virtual void SetSessions(int64_t resident, int64_t spilled, int64_t resident_state_bytes) = 0;
  // Bytes of state resident over all models, against --max-state-memory-bytes (the
  // same value for every model: the budget is shared).
  virtual void SetStateMemoryUsage(int64_t used_bytes, int64_t limit_bytes) = 0;
  // op: "created", "deleted", "forked", "imported", "exported", "spilled", "restored".
  virtual void CountSessionOperation(std::string_view op) = 0;
  // reason: "expired" (idle TTL), "evicted" (memory budget, --session-store=memory).
  virtual void CountSessionRemoval(std::string_view reason) = 0;
  // op: "write", "read", "delete": a session-store operation that failed.
  virtual void CountSessionStoreError(std::string_view op) = 0;
  // One successful write-through of a session's state (encode + store), in seconds.
  virtual void ObserveSessionStoreWrite(double seconds) = 0;
  // Shared store: a request found this replica's resident copy of its session current
  // (hit) or had to load the state from the store (miss).
  virtual void CountSessionCacheLookup(bool hit) = 0;
};

struct ModelInfoLabels {
  std::string model;
  std::string architecture;
  int64_t parameters = 0;
  int64_t state_bytes_per_session = 0;
};

class Metrics {
 public:
  virtual ~Metrics() = default;
  // A registry-backed implementation (prometheus-cpp), with build info and process
  // CPU/RSS collectors registered.
  static std::shared_ptr<Metrics> Create();
  // An implementation that records nothing: what every layer gets when metrics are
  // off, so that no caller checks for null. Process-wide, never destroyed.
  static Metrics* Null();
  // `metrics`, or Null() when it is null: what each layer keeps, so that none checks.
  static Metrics* OrNull(Metrics* metrics) { return metrics != nullptr ? metrics : Null(); }
  // Registers a model: sets fwserve_model_info and returns its series. Never nullptr.
  // Registering a name again returns its existing series unchanged.
  virtual ModelMetrics* AddModel(const ModelInfoLabels& info) = 0;
  // The series of a model registered with AddModel, or nullptr.
  virtual ModelMetrics* ForModel(std::string_view model) = 0;
  // One finished RPC. `code` is the numeric gRPC status code. `model` becomes the model
  // label only if it was registered with AddModel; otherwise the label is "" (client
  // input never becomes a label value).
  virtual void ObserveRequest(std::string_view rpc, std::string_view model, int code,
                              double seconds) = 0;
  // One session-store operation (op: "acquire", "commit", "create", ... as the store
  // names them) and its outcome: "ok", "not_found", "conflict" (a busy session or a
  // lost lease), "unavailable" (unreachable or too slow) or "error" (anything else).
  virtual void ObserveSessionStoreOperation(std::string_view op, std::string_view outcome,
                                            double seconds) = 0;
  // A request refused before it reached a model, by `reason`: "unauthenticated" (no
  // or a wrong API key), "quota_sessions", "quota_streams", "quota_tokens" (the
  // tenant's quotas).
  virtual void CountRefused(std::string_view reason) = 0;
  // A stateless chat or response looked for a kept conversation its history begins
  // with (--prefix-reuse-entries): outcome "hit", "miss" or "skipped" (reuse not possible
  // for this request: a vocabulary other than bytes, or no room for another session).
  virtual void CountPrefixReuse(std::string_view model, std::string_view outcome) = 0;
  // Per-tenant series. `tenant` must be a configured tenant name (the API-keys file
  // bounds the label values); "" (an open server) records nothing.
  virtual void ObserveTenantRequest(std::string_view tenant, std::string_view rpc, int code) = 0;
  virtual void AddTenantGeneratedTokens(std::string_view tenant, int64_t tokens) = 0;
  virtual void SetTenantActiveStreams(std::string_view tenant, int64_t streams) = 0;
  // The registry to expose (nullptr for implementations without one).
  virtual std::shared_ptr<prometheus::Registry> registry() = 0;
};

// Canonical name of a numeric gRPC status code ("OK", "INVALID_ARGUMENT", ...); codes
// outside 0..16 are "UNKNOWN", as gRPC itself reports them.
const char* GrpcCodeName(int code);

}  // namespace fwserve
