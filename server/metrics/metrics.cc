#include "server/metrics/metrics.h"

#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

#ifndef FWSERVE_VERSION
#define FWSERVE_VERSION "unknown"
#endif

namespace fwserve {
namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;

// Bucket boundaries, in the unit of the series. The rationale for each set is in
// docs/metrics.md; keep the two in sync.
template <size_t N>
Histogram::BucketBoundaries Buckets(const double (&bounds)[N]) {
  return Histogram::BucketBoundaries(bounds, bounds + N);
}

// One recurrent step / the gap between two streamed tokens: ~0.1 ms to ~50 ms, with a
// tail up to 1 s for steps that stall behind prefill or a large batch.
constexpr double kStepBuckets[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                   0.025,  0.05,    0.1,    0.25,  0.5,    1};
// Time to first token: prefill of the prompt plus queueing, ~1 ms to ~10 s; 30 s catches
// requests that waited behind a full engine.
constexpr double kTtftBuckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                   0.25,  0.5,    1,     2.5,  5,     10,   30};
// A prefill chunk (sequence form over up to a few thousand tokens): ~0.5 ms to a few s.
constexpr double kPrefillChunkBuckets[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                           0.1,    0.25,  0.5,    1,     2.5,  5,     10};
// A whole RPC or generation: 1 ms (a metadata RPC) up to 10 minutes (long generations).
constexpr double kRequestBuckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                      1,     2.5,    5,     10,   30,    60,   120, 300,  600};
// Streams in one batched step: powers of two up to 256.
constexpr double kBatchSizeBuckets[] = {1, 2, 4, 8, 16, 32, 64, 128, 256};
// Tokens in one prefill chunk: powers of four up to 4096.
constexpr double kPrefillTokensBuckets[] = {1, 4, 16, 64, 256, 1024, 4096};

// Session operations and removal reasons named in metrics.h. They are created at AddModel
// so that they are exported (at 0) before the first event.
constexpr std::array<const char*, 7> kSessionOps = {"created",  "deleted", "forked",  "imported",
                                                    "exported", "spilled", "restored"};
constexpr std::array<const char*, 2> kRemovalReasons = {"expired", "evicted"};
constexpr std::array<const char*, 3> kStoreOps = {"write", "read", "delete"};
// One session-store write (encode, write, fsync, rename, fsync): ~0.1 ms on tmpfs to
// ~100 ms on a busy disk; 1 s catches a stalled one.
constexpr double kStoreWriteBuckets[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                         0.01,   0.025,   0.05,   0.1,   0.25,   1};

// Canonical gRPC status code names, indexed by the numeric code.
constexpr std::array<const char*, 17> kGrpcCodeNames = {
    "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
    "DATA_LOSS", "UNAUTHENTICATED"};

// A fixed set of label values resolved to their series once, plus a fallback through the
// family (internally locked) for values outside that set.
class LabeledCounters {
 public:
  template <size_t N>
  LabeledCounters(Family<Counter>& family, const std::string& model, const char* label,
                  const std::array<const char*, N>& known)
      : family_(family), model_(model), label_(label) {
    for (const char* value : known) {
      known_.emplace_back(value, &family.Add({{"model", model}, {label, value}}));
    }
  }

  void Increment(std::string_view value) {
    for (auto& [name, counter] : known_) {
      if (name == value) {
        counter->Increment();
        return;
      }
    }
    try {
      family_.Add({{"model", model_}, {label_, std::string(value)}}).Increment();
    } catch (const std::exception&) {
      // A metric update must never fail the caller.
    }
  }

 private:
  Family<Counter>& family_;
  const std::string model_;
  const std::string label_;
  std::vector<std::pair<std::string_view, Counter*>> known_;
};

// The per-model families; owned by the registry.
struct ModelFamilies {
  Family<Histogram>& ttft;
  Family<Histogram>& inter_token;
  Family<Histogram>& generation;
  Family<Counter>& prompt_tokens;
  Family<Counter>& generated_tokens;
  Family<Counter>& prompt_tokens_saved;
  Family<Counter>& scored_tokens;
  Family<Counter>& preempted;
  Family<Counter>& shed;
  Family<Histogram>& batch_size;
  Family<Histogram>& step_duration;
  Family<Histogram>& prefill_chunk_duration;
  Family<Histogram>& prefill_chunk_tokens;
  Family<Gauge>& queued;
  Family<Gauge>& expected_queue_wait;
  Family<Histogram>& queue_wait;
  Family<Gauge>& active_streams;
  Family<Gauge>& sessions;
  Family<Gauge>& state_bytes;
  Family<Gauge>& state_memory_usage;
  Family<Counter>& session_ops;
  Family<Counter>& session_removals;
  Family<Gauge>& model_info;
  Family<Counter>& store_errors;
  Family<Histogram>& store_write_duration;
  Family<Counter>& cache_lookups;
};

class PrometheusModelMetrics final : public ModelMetrics {
 public:
  PrometheusModelMetrics(ModelFamilies& f, const std::string& model)
      : ttft_(f.ttft.Add({{"model", model}}, Buckets(kTtftBuckets))),
        inter_token_(f.inter_token.Add({{"model", model}}, Buckets(kStepBuckets))),
        generation_(f.generation.Add({{"model", model}}, Buckets(kRequestBuckets))),
        prompt_tokens_(f.prompt_tokens.Add({{"model", model}})),
        generated_tokens_(f.generated_tokens.Add({{"model", model}})),
        prompt_tokens_saved_(f.prompt_tokens_saved.Add({{"model", model}})),
        scored_tokens_(f.scored_tokens.Add({{"model", model}})),
        preempted_(f.preempted.Add({{"model", model}})),
        shed_(f.shed.Add({{"model", model}})),
        batch_size_(f.batch_size.Add({{"model", model}}, Buckets(kBatchSizeBuckets))),
        step_duration_(f.step_duration.Add({{"model", model}}, Buckets(kStepBuckets))),
        prefill_chunk_duration_(
            f.prefill_chunk_duration.Add({{"model", model}}, Buckets(kPrefillChunkBuckets))),
        prefill_chunk_tokens_(
            f.prefill_chunk_tokens.Add({{"model", model}}, Buckets(kPrefillTokensBuckets))),
        queued_(f.queued.Add({{"model", model}})),
        expected_queue_wait_(f.expected_queue_wait.Add({{"model", model}})),
        queue_wait_(f.queue_wait.Add({{"model", model}}, Buckets(kTtftBuckets))),
        active_streams_(f.active_streams.Add({{"model", model}})),
        sessions_resident_(f.sessions.Add({{"model", model}, {"state", "resident"}})),
        sessions_spilled_(f.sessions.Add({{"model", model}, {"state", "spilled"}})),
        state_bytes_(f.state_bytes.Add({{"model", model}})),
        state_memory_usage_(f.state_memory_usage.Add({{"model", model}})),
        session_ops_(f.session_ops, model, "op", kSessionOps),
        session_removals_(f.session_removals, model, "reason", kRemovalReasons),
        store_errors_(f.store_errors, model, "op", kStoreOps),
        store_write_duration_(
            f.store_write_duration.Add({{"model", model}}, Buckets(kStoreWriteBuckets))),
        cache_hits_(f.cache_lookups.Add({{"model", model}, {"result", "hit"}})),
        cache_misses_(f.cache_lookups.Add({{"model", model}, {"result", "miss"}})) {}

  void ObserveTimeToFirstToken(double seconds) override { ttft_.Observe(seconds); }
  void ObserveInterTokenLatency(double seconds, int64_t count) override {
    if (count == 1) return inter_token_.Observe(seconds);
    if (count <= 0) return;
    // One update for the message: `count` observations of `seconds` in its bucket (the
    // first bound >= seconds, as Observe picks it).
    std::vector<double> increments(std::size(kStepBuckets) + 1, 0.0);
    increments[static_cast<size_t>(
        std::lower_bound(std::begin(kStepBuckets), std::end(kStepBuckets), seconds) -
        std::begin(kStepBuckets))] = static_cast<double>(count);
    inter_token_.ObserveMultiple(increments, seconds * static_cast<double>(count));
  }
  void ObserveGenerationDuration(double seconds) override { generation_.Observe(seconds); }
  void AddPromptTokens(int64_t tokens) override { Add(prompt_tokens_, tokens); }
  void AddGeneratedTokens(int64_t tokens) override { Add(generated_tokens_, tokens); }
  void AddPromptTokensSaved(int64_t tokens) override { Add(prompt_tokens_saved_, tokens); }
  void AddScoredTokens(int64_t tokens) override { Add(scored_tokens_, tokens); }
  void CountPreempted() override { preempted_.Increment(); }
  void CountShed() override { shed_.Increment(); }
  void ObserveDecodeStep(int64_t batch_size, double seconds) override {
    batch_size_.Observe(static_cast<double>(batch_size));
    step_duration_.Observe(seconds);
  }
  void ObservePrefillChunk(int64_t tokens, double seconds) override {
    prefill_chunk_tokens_.Observe(static_cast<double>(tokens));
    prefill_chunk_duration_.Observe(seconds);
  }
  void SetQueuedRequests(int64_t count) override { queued_.Set(static_cast<double>(count)); }
  void SetExpectedQueueWait(double seconds) override { expected_queue_wait_.Set(seconds); }
  void ObserveQueueWait(double seconds) override { queue_wait_.Observe(seconds); }
  void SetActiveStreams(int64_t count) override { active_streams_.Set(static_cast<double>(count)); }
  void SetSessions(int64_t resident, int64_t spilled, int64_t resident_state_bytes) override {
    sessions_resident_.Set(static_cast<double>(resident));
    sessions_spilled_.Set(static_cast<double>(spilled));
    state_bytes_.Set(static_cast<double>(resident_state_bytes));
  }
  void SetStateMemoryUsage(int64_t used_bytes, int64_t limit_bytes) override {
    state_memory_usage_.Set(
        limit_bytes > 0 ? static_cast<double>(used_bytes) / static_cast<double>(limit_bytes) : 0.0);
  }
  void CountSessionOperation(std::string_view op) override { session_ops_.Increment(op); }
  void CountSessionRemoval(std::string_view reason) override {
    session_removals_.Increment(reason);
  }
  void CountSessionStoreError(std::string_view op) override { store_errors_.Increment(op); }
  void ObserveSessionStoreWrite(double seconds) override { store_write_duration_.Observe(seconds); }
  void CountSessionCacheLookup(bool hit) override {
    (hit ? cache_hits_ : cache_misses_).Increment();
  }

 private:
  // Counters only go up: negative amounts (a caller bug) are dropped.
  static void Add(Counter& counter, int64_t amount) {
    if (amount > 0) counter.Increment(static_cast<double>(amount));
  }

  Histogram& ttft_;
  Histogram& inter_token_;
  Histogram& generation_;
  Counter& prompt_tokens_;
  Counter& generated_tokens_;
  Counter& prompt_tokens_saved_;
  Counter& scored_tokens_;
  Counter& preempted_;
  Counter& shed_;
  Histogram& batch_size_;
  Histogram& step_duration_;
  Histogram& prefill_chunk_duration_;
  Histogram& prefill_chunk_tokens_;
  Gauge& queued_;
  Gauge& expected_queue_wait_;
  Histogram& queue_wait_;
  Gauge& active_streams_;
  Gauge& sessions_resident_;
  Gauge& sessions_spilled_;
  Gauge& state_bytes_;
  Gauge& state_memory_usage_;
  LabeledCounters session_ops_;
  LabeledCounters session_removals_;
  LabeledCounters store_errors_;
  Histogram& store_write_duration_;
  Counter& cache_hits_;
  Counter& cache_misses_;
};

// Stands in for a model whose series could not be created, so callers never get nullptr
// from AddModel.
class NullModelMetrics final : public ModelMetrics {
 public:
  void ObserveTimeToFirstToken(double) override {}
  void ObserveInterTokenLatency(double, int64_t) override {}
  void ObserveGenerationDuration(double) override {}
  void AddPromptTokens(int64_t) override {}
  void AddGeneratedTokens(int64_t) override {}
  void AddPromptTokensSaved(int64_t) override {}
  void AddScoredTokens(int64_t) override {}
  void CountPreempted() override {}
  void CountShed() override {}
  void ObserveDecodeStep(int64_t, double) override {}
  void ObservePrefillChunk(int64_t, double) override {}
  void SetQueuedRequests(int64_t) override {}
  void SetExpectedQueueWait(double) override {}
  void ObserveQueueWait(double) override {}
  void SetActiveStreams(int64_t) override {}
  void SetSessions(int64_t, int64_t, int64_t) override {}
  void SetStateMemoryUsage(int64_t, int64_t) override {}
  void CountSessionOperation(std::string_view) override {}
  void CountSessionRemoval(std::string_view) override {}
  void CountSessionStoreError(std::string_view) override {}
  void ObserveSessionStoreWrite(double) override {}
  void CountSessionCacheLookup(bool) override {}
};

// The standard process_* series (as in the Prometheus client libraries), read from /proc
// at every collection. A series whose source cannot be read is left out.
class ProcessCollector final : public prometheus::Collectable {
 public:
  ProcessCollector()
      : ticks_per_second_(static_cast<double>(sysconf(_SC_CLK_TCK))),
        page_bytes_(static_cast<double>(sysconf(_SC_PAGESIZE))) {
    std::optional<Stat> stat = ReadStat();
    std::optional<double> boot_time = ReadBootTime();
    if (stat && boot_time && ticks_per_second_ > 0) {
      start_time_seconds_ = *boot_time + stat->start_ticks / ticks_per_second_;
    }
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> families;
    if (std::optional<Stat> stat = ReadStat(); stat && ticks_per_second_ > 0) {
      families.push_back(CounterFamily(
          "process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
          (stat->utime_ticks + stat->stime_ticks) / ticks_per_second_));
    }
    if (std::optional<std::pair<double, double>> statm = ReadStatm(); statm && page_bytes_ > 0) {
      families.push_back(GaugeFamily("process_virtual_memory_bytes",
                                     "Virtual memory size in bytes.", statm->first * page_bytes_));
      families.push_back(GaugeFamily("process_resident_memory_bytes",
                                     "Resident memory size in bytes.",
                                     statm->second * page_bytes_));
    }
    if (start_time_seconds_) {
      families.push_back(GaugeFamily("process_start_time_seconds",
                                     "Start time of the process since unix epoch in seconds.",
                                     *start_time_seconds_));
    }
    if (std::optional<double> fds = CountOpenFds()) {
      families.push_back(GaugeFamily("process_open_fds", "Number of open file descriptors.", *fds));
    }
    return families;
  }

 private:
  struct Stat {
    double utime_ticks = 0;
    double stime_ticks = 0;
    double start_ticks = 0;
  };

  static prometheus::MetricFamily CounterFamily(const char* name, const char* help, double value) {
    prometheus::MetricFamily family{name, help, prometheus::MetricType::Counter, {}};
    family.metric.emplace_back();
    family.metric.back().counter.value = value;
    return family;
  }

  static prometheus::MetricFamily GaugeFamily(const char* name, const char* help, double value) {
    prometheus::MetricFamily family{name, help, prometheus::MetricType::Gauge, {}};
    family.metric.emplace_back();
    family.metric.back().gauge.value = value;
    return family;
  }

  // utime, stime and starttime (fields 14, 15, 22 of proc(5) /proc/self/stat). The fields
  // are counted after the command name, which is parenthesized and may hold spaces.
  static std::optional<Stat> ReadStat() {
    std::ifstream in("/proc/self/stat");
    std::string line;
    if (!std::getline(in, line)) return std::nullopt;
    const size_t close = line.rfind(')');
    if (close == std::string::npos) return std::nullopt;
    std::istringstream fields(line.substr(close + 1));
    std::vector<std::string> values;
    for (std::string v; fields >> v;) values.push_back(v);
    // values[0] is field 3 (state).
    constexpr size_t kUtime = 14 - 3, kStime = 15 - 3, kStart = 22 - 3;
    if (values.size() <= kStart) return std::nullopt;
    try {
      return Stat{std::stod(values[kUtime]), std::stod(values[kStime]), std::stod(values[kStart])};
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }

  // Total program size and resident set size, in pages.
  static std::optional<std::pair<double, double>> ReadStatm() {
    std::ifstream in("/proc/self/statm");
    double size = 0, resident = 0;
    if (!(in >> size >> resident)) return std::nullopt;
    return std::make_pair(size, resident);
  }

  // Boot time (seconds since the epoch) from the "btime" line of /proc/stat.
  static std::optional<double> ReadBootTime() {
    std::ifstream in("/proc/stat");
    for (std::string key; in >> key;) {
      if (key == "btime") {
        double value = 0;
        if (in >> value) return value;
        return std::nullopt;
      }
      in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
    }
    return std::nullopt;
  }

  static std::optional<double> CountOpenFds() {
    std::error_code error;
    std::filesystem::directory_iterator it("/proc/self/fd", error);
    double count = 0;
    for (; !error && it != std::filesystem::directory_iterator(); it.increment(error)) ++count;
    if (error) return std::nullopt;
    // The iterator's own descriptor was counted too.
    return count > 0 ? count - 1 : 0;
  }

  const double ticks_per_second_;
  const double page_bytes_;
  std::optional<double> start_time_seconds_;
};

// A registry that also reports the process collector, so that everything exposing it (an
// Exposer, a test's Collect()) gets fresh process_* series on every scrape. prometheus-cpp
// 1.0 has no way to register a Collectable inside a Registry.
class ProcessRegistry final : public prometheus::Registry {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> families = prometheus::Registry::Collect();
    try {
      std::vector<prometheus::MetricFamily> process = process_.Collect();
      families.insert(families.end(), std::make_move_iterator(process.begin()),
                      std::make_move_iterator(process.end()));
    } catch (const std::exception&) {
      // A scrape without process_* series beats a failed scrape.
    }
    return families;
  }

 private:
  ProcessCollector process_;
};

class PrometheusMetrics final : public Metrics {
 public:
  PrometheusMetrics()
      : registry_(std::make_shared<ProcessRegistry>()),
        requests_(prometheus::BuildCounter()
                      .Name("fwserve_requests_total")
                      .Help("Finished RPCs by method, model and gRPC status code.")
                      .Register(*registry_)),
        request_duration_(prometheus::BuildHistogram()
                              .Name("fwserve_request_duration_seconds")
                              .Help("Duration of finished RPCs, from arrival to status.")
                              .Register(*registry_)),
        families_{
            prometheus::BuildHistogram()
                .Name("fwserve_time_to_first_token_seconds")
                .Help("Generate: seconds from the request's arrival to its first token.")
                .Register(*registry_),
            prometheus::BuildHistogram()
                .Name("fwserve_inter_token_latency_seconds")
                .Help("Generate: seconds between consecutive tokens of one stream.")
                .Register(*registry_),
            prometheus::BuildHistogram()
                .Name("fwserve_generation_duration_seconds")
                .Help("Generate: seconds from the request's arrival to its final message.")
                .Register(*registry_),
            prometheus::BuildCounter()
                .Name("fwserve_prompt_tokens_total")
                .Help("Tokens absorbed by prefill (prompts, session prefixes).")
                .Register(*registry_),
            prometheus::BuildCounter()
                .Name("fwserve_generated_tokens_total")
                .Help("Tokens streamed to clients.")
                .Register(*registry_),
            prometheus::BuildCounter()
                .Name("fwserve_prompt_tokens_saved_total")
                .Help("Prompt tokens not re-read because the session already held them.")
                .Register(*registry_),
            prometheus::BuildCounter()
                .Name("fwserve_scored_tokens_total")
                .Help("Tokens scored by Score.")
                .Register(*registry_),
            prometheus::BuildCounter()
                .Name("fwserve_streams_preempted_total")
                .Help("Streams parked so that a tenant below its fair share of the stream "
                      "slots could start (they resume when a slot frees).")
                .Register(*registry_),
            prometheus::BuildCounter()
                .Name("fwserve_queue_shed_total")
                .Help("Queued streams refused by CoDel (--queue-codel-target): they waited "
                      "past the target in a standing queue, and got a retry hint.")
                .Register(*registry_),
            prometheus::BuildHistogram()
                .Name("fwserve_engine_batch_size")
                .Help("Streams in one batched decode step.")
                .Register(*registry_),
            prometheus::BuildHistogram()
                .Name("fwserve_engine_step_duration_seconds")
                .Help("Duration of one batched decode step.")
                .Register(*registry_),
            prometheus::BuildHistogram()
                .Name("fwserve_engine_prefill_chunk_duration_seconds")
                .Help("Duration of one prefill chunk.")
                .Register(*registry_),
            prometheus::BuildHistogram()
                .Name("fwserve_engine_prefill_chunk_tokens")
                .Help("Tokens in one prefill chunk.")
                .Register(*registry_),
            prometheus::BuildGauge()
                .Name("fwserve_engine_queued_requests")
                .Help("Work items waiting in the engine queue.")
                .Register(*registry_),
            prometheus::BuildGauge()
                .Name("fwserve_engine_expected_queue_wait_seconds")
                .Help("How long a stream queued now is expected to wait before it starts (from "
                      "how fast streams end while every slot is taken); the basis of retry hints "
                      "and deadline admission.")
                .Register(*registry_),
            prometheus::BuildHistogram()
                .Name("fwserve_engine_queue_wait_seconds")
                .Help("How long each admitted stream waited in the engine queue.")
                .Register(*registry_),
            prometheus::BuildGauge()
                .Name("fwserve_engine_active_streams")
                .Help("Streams being served by the engine.")
                .Register(*registry_),
            prometheus::BuildGauge()
                .Name("fwserve_sessions")
                .Help("Sessions by where their state is: resident (pool) or spilled (only in the "
                      "session store).")
                .Register(*registry_),
            prometheus::BuildGauge()
                .Name("fwserve_session_state_resident_bytes")
                .Help("Bytes of recurrent state resident in the pool.")
                .Register(*registry_),
            prometheus::BuildGauge()
                .Name("fwserve_state_memory_usage_ratio")
                .Help("Share of --max-state-memory-bytes in use, over all models (the "
                      "cache usage of an inference gateway).")
                .Register(*registry_),
            prometheus::BuildCounter()
                .Name("fwserve_session_operations_total")
                .Help("Session operations by kind.")
                .Register(*registry_),
            prometheus::BuildCounter()
                .Name("fwserve_session_removals_total")
                .Help("Sessions removed by the server, by reason.")
                .Register(*registry_),
            prometheus::BuildGauge()
                .Name("fwserve_model_info")
                .Help("Served model (value 1), with its architecture and size as labels.")
                .Register(*registry_),
            prometheus::BuildCounter()
                .Name("fwserve_session_store_errors_total")
                .Help("Failed session-store operations (write, read, delete).")
                .Register(*registry_),
            prometheus::BuildHistogram()
                .Name("fwserve_session_store_write_duration_seconds")
                .Help("Duration of one successful session-store write (write-through).")
                .Register(*registry_),
            prometheus::BuildCounter()
                .Name("fwserve_session_cache_lookups_total")
                .Help("Shared store: requests that found the resident copy of their session "
                      "current (hit) or loaded it from the store (miss).")
                .Register(*registry_),
        },
        store_operation_duration_(
            prometheus::BuildHistogram()
                .Name("fwserve_session_store_operation_duration_seconds")
                .Help("Duration of session-store operations (redis://), by operation.")
                .Register(*registry_)),
        store_operation_errors_(
            prometheus::BuildCounter()
                .Name("fwserve_session_store_operation_errors_total")
                .Help("Failed session-store operations (redis://), by operation and kind "
                      "(unavailable, error).")
                .Register(*registry_)),
        lease_conflicts_(prometheus::BuildCounter()
                             .Name("fwserve_session_lease_conflicts_total")
                             .Help("Shared store: a session's lease was held by another request "
                                   "(op=acquire) or was lost before a write (commit, delete, "
                                   "renew).")
                             .Register(*registry_)),
        prefix_reuse_(prometheus::BuildCounter()
                          .Name("fwserve_prefix_reuse_total")
                          .Help("Stateless chats and responses that looked for a kept "
                                "conversation their history begins with: hit (started from its "
                                "state), miss (full prefill), skipped (not possible for the "
                                "request). Tokens not prefilled: "
                                "fwserve_prompt_tokens_saved_total.")
                          .Register(*registry_)),
        refused_(
            prometheus::BuildCounter()
                .Name("fwserve_requests_refused_total")
                .Help("Requests refused before they reached a model, by reason: "
                      "unauthenticated, quota_sessions, quota_streams, quota_tokens, queue_full, "
                      "queue_wait, tenant_queue_share, deadline.")
                .Register(*registry_)),
        tenant_requests_(prometheus::BuildCounter()
                             .Name("fwserve_tenant_requests_total")
                             .Help("Finished RPCs by tenant (configured names only), method "
                                   "and gRPC status code.")
                             .Register(*registry_)),
        tenant_tokens_(prometheus::BuildCounter()
                           .Name("fwserve_tenant_generated_tokens_total")
                           .Help("Tokens streamed to each tenant's clients.")
                           .Register(*registry_)),
        tenant_streams_(prometheus::BuildGauge()
                            .Name("fwserve_tenant_active_streams")
                            .Help("Generate streams of each tenant, running or queued.")
                            .Register(*registry_)) {
    for (const char* reason : {"unauthenticated", "quota_sessions", "quota_streams", "quota_tokens",
                               "queue_full", "queue_wait", "tenant_queue_share", "deadline"}) {
      refused_.Add({{"reason", reason}});
    }
    prometheus::BuildGauge()
        .Name("fwserve_build_info")
        .Help("Server build (value 1), with its version as a label.")
        .Register(*registry_)
        .Add({{"version", FWSERVE_VERSION}})
        .Set(1);
  }

  ModelMetrics* AddModel(const ModelInfoLabels& info) override {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(info.model);
    if (it != models_.end()) return it->second.get();
    try {
      auto series = std::make_unique<PrometheusModelMetrics>(families_, info.model);
      families_.model_info
          .Add({{"model", info.model},
                {"architecture", info.architecture},
                {"parameters", std::to_string(info.parameters)},
                {"state_bytes_per_session", std::to_string(info.state_bytes_per_session)}})
          .Set(1);
      return models_.emplace(info.model, std::move(series)).first->second.get();
    } catch (const std::exception&) {
      return &null_model_;
    }
  }

  ModelMetrics* ForModel(std::string_view model) override {
    absl::ReaderMutexLock lock(&mu_);
    auto it = models_.find(model);
    return it == models_.end() ? nullptr : it->second.get();
  }

  void ObserveRequest(std::string_view rpc, std::string_view model, int code,
                      double seconds) override {
    try {
      // Only registered model names become label values: a client cannot grow the
      // series set by naming models that do not exist.
      std::string model_label;
      {
        absl::ReaderMutexLock lock(&mu_);
        if (models_.count(model) != 0) model_label = std::string(model);
      }
      requests_
          .Add({{"rpc", std::string(rpc)}, {"model", model_label}, {"code", GrpcCodeName(code)}})
          .Increment();
      RequestDuration(rpc).Observe(seconds);
    } catch (const std::exception&) {
      // A metric update must never fail the RPC.
    }
  }

  void ObserveSessionStoreOperation(std::string_view op, std::string_view outcome,
                                    double seconds) override {
    try {
      absl::MutexLock lock(&store_mu_);
      const std::string op_label(op);
      auto it = store_durations_.find(op_label);
      if (it == store_durations_.end()) {
        it = store_durations_
                 .emplace(op_label, &store_operation_duration_.Add({{"op", op_label}},
                                                                   Buckets(kStoreWriteBuckets)))
                 .first;
      }
      it->second->Observe(seconds);
      if (outcome == "conflict") {
        lease_conflicts_.Add({{"op", op_label}}).Increment();
      } else if (outcome == "unavailable" || outcome == "error") {
        store_operation_errors_.Add({{"op", op_label}, {"kind", std::string(outcome)}}).Increment();
      }
    } catch (const std::exception&) {
      // A metric update must never fail the caller.
    }
  }

  void CountPrefixReuse(std::string_view model, std::string_view outcome) override {
    try {
      prefix_reuse_.Add({{"model", std::string(model)}, {"outcome", std::string(outcome)}})
          .Increment();
    } catch (const std::exception&) {
    }
  }

  void CountRefused(std::string_view reason) override {
    try {
      refused_.Add({{"reason", std::string(reason)}}).Increment();
    } catch (const std::exception&) {
    }
  }

  void ObserveTenantRequest(std::string_view tenant, std::string_view rpc, int code) override {
    if (tenant.empty()) return;
    try {
      tenant_requests_
          .Add({{"tenant", std::string(tenant)},
                {"rpc", std::string(rpc)},
                {"code", GrpcCodeName(code)}})
          .Increment();
    } catch (const std::exception&) {
    }
  }

  void AddTenantGeneratedTokens(std::string_view tenant, int64_t tokens) override {
    if (tenant.empty() || tokens <= 0) return;
    try {
      tenant_tokens_.Add({{"tenant", std::string(tenant)}}).Increment(static_cast<double>(tokens));
    } catch (const std::exception&) {
    }
  }

  void SetTenantActiveStreams(std::string_view tenant, int64_t streams) override {
    if (tenant.empty()) return;
    try {
      tenant_streams_.Add({{"tenant", std::string(tenant)}}).Set(static_cast<double>(streams));
    } catch (const std::exception&) {
    }
  }

  std::shared_ptr<prometheus::Registry> registry() override { return registry_; }

 private:
  Histogram& RequestDuration(std::string_view rpc) {
    absl::MutexLock lock(&durations_mu_);
    auto it = request_durations_.find(rpc);
    if (it != request_durations_.end()) return *it->second;
    Histogram& histogram =
        request_duration_.Add({{"rpc", std::string(rpc)}}, Buckets(kRequestBuckets));
    request_durations_.emplace(std::string(rpc), &histogram);
    return histogram;
  }

  const std::shared_ptr<ProcessRegistry> registry_;
  Family<Counter>& requests_;
  Family<Histogram>& request_duration_;
  ModelFamilies families_;
  Family<Histogram>& store_operation_duration_;
  Family<Counter>& store_operation_errors_;
  Family<Counter>& lease_conflicts_;
  Family<Counter>& prefix_reuse_;
  Family<Counter>& refused_;
  Family<Counter>& tenant_requests_;
  Family<Counter>& tenant_tokens_;
  Family<Gauge>& tenant_streams_;
  NullModelMetrics null_model_;

  absl::Mutex store_mu_;
  std::map<std::string, Histogram*, std::less<>> store_durations_ ABSL_GUARDED_BY(store_mu_);

  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<PrometheusModelMetrics>, std::less<>> models_
      ABSL_GUARDED_BY(mu_);

  absl::Mutex durations_mu_;
  std::map<std::string, Histogram*, std::less<>> request_durations_ ABSL_GUARDED_BY(durations_mu_);
};

// Records nothing (Metrics::Null()).
class NullMetrics final : public Metrics {
 public:
  ModelMetrics* AddModel(const ModelInfoLabels&) override { return &null_model_; }
  ModelMetrics* ForModel(std::string_view) override { return &null_model_; }
  void ObserveRequest(std::string_view, std::string_view, int, double) override {}
  void ObserveSessionStoreOperation(std::string_view, std::string_view, double) override {}
  void CountRefused(std::string_view) override {}
  void CountPrefixReuse(std::string_view, std::string_view) override {}
  void ObserveTenantRequest(std::string_view, std::string_view, int) override {}
  void AddTenantGeneratedTokens(std::string_view, int64_t) override {}
  void SetTenantActiveStreams(std::string_view, int64_t) override {}
  std::shared_ptr<prometheus::Registry> registry() override { return nullptr; }

 private:
  NullModelMetrics null_model_;
};

}  // namespace

std::shared_ptr<Metrics> Metrics::Create() { return std::make_shared<PrometheusMetrics>(); }

Metrics* Metrics::Null() {
  static NullMetrics* const null_metrics = new NullMetrics();
  return null_metrics;
}

const char* GrpcCodeName(int code) {
  if (code < 0 || code >= static_cast<int>(kGrpcCodeNames.size())) return "UNKNOWN";
  return kGrpcCodeNames[static_cast<size_t>(code)];
}

}  // namespace fwserve

// prometheus-cpp's Exposer runs civetweb, which Debian builds with a fixed 100 KiB
// thread stack (USE_STACK_SIZE). LibTorch, OpenBLAS and glog together put over 100 KiB
// of static TLS into every thread, so civetweb's worker threads could not start
// ("Cannot create first worker thread") in any process linking LibTorch. This
// interposes the libc call for the whole process and raises requested stacks below
// 1 MiB to 1 MiB; larger requests pass through unchanged. It lives in the object
// that defines Metrics::Create so that every binary with an exposer links it.
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t stack_size) {
  using Fn = int (*)(pthread_attr_t*, size_t);
  static const Fn libc_setstacksize =
      reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  constexpr size_t kMinimumStack = size_t{1} << 20;
  return libc_setstacksize(attr, stack_size < kMinimumStack ? kMinimumStack : stack_size);
}
