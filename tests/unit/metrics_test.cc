#include "server/metrics/metrics.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <ctime>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace {

using fwserve::Metrics;
using fwserve::ModelInfoLabels;
using fwserve::ModelMetrics;
using Labels = std::map<std::string, std::string>;

std::vector<prometheus::MetricFamily> Collect(Metrics& metrics) {
  return metrics.registry()->Collect();
}

std::string Scrape(Metrics& metrics) {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, Collect(metrics));
  return out.str();
}

const prometheus::MetricFamily* FindFamily(const std::vector<prometheus::MetricFamily>& families,
                                           const std::string& name) {
  for (const auto& family : families) {
    if (family.name == name) return &family;
  }
  return nullptr;
}

// The series of `name` whose labels are exactly `labels`, or nullptr.
const prometheus::ClientMetric* FindSeries(const std::vector<prometheus::MetricFamily>& families,
                                           const std::string& name, const Labels& labels) {
  const prometheus::MetricFamily* family = FindFamily(families, name);
  if (family == nullptr) return nullptr;
  for (const auto& metric : family->metric) {
    Labels got;
    for (const auto& label : metric.label) got[label.name] = label.value;
    if (got == labels) return &metric;
  }
  return nullptr;
}

// Cumulative count of the bucket with upper bound `le`; -1 if there is no such bucket.
int64_t BucketCount(const prometheus::ClientMetric& metric, double le) {
  for (const auto& bucket : metric.histogram.bucket) {
    if (bucket.upper_bound == le) return static_cast<int64_t>(bucket.cumulative_count);
  }
  return -1;
}

ModelInfoLabels Info(const std::string& model) {
  ModelInfoLabels info;
  info.model = model;
  info.architecture = "fast_weight";
  info.parameters = 1234567;
  info.state_bytes_per_session = 65536;
  return info;
}

TEST(MetricsTest, CountersAccumulateInTextExposition) {
  auto metrics = Metrics::Create();
  ModelMetrics* m = metrics->AddModel(Info("m"));
  ASSERT_NE(m, nullptr);
  m->AddGeneratedTokens(5);
  m->AddGeneratedTokens(2);
  m->AddPromptTokens(100);
  m->AddPromptTokensSaved(40);
  m->AddScoredTokens(9);
  const std::string text = Scrape(*metrics);
  EXPECT_NE(text.find("fwserve_generated_tokens_total{model=\"m\"} 7\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("fwserve_prompt_tokens_total{model=\"m\"} 100\n"), std::string::npos);
  EXPECT_NE(text.find("fwserve_prompt_tokens_saved_total{model=\"m\"} 40\n"), std::string::npos);
  EXPECT_NE(text.find("fwserve_scored_tokens_total{model=\"m\"} 9\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE fwserve_generated_tokens_total counter"), std::string::npos);
}

TEST(MetricsTest, NegativeCounterAmountsAreIgnored) {
  auto metrics = Metrics::Create();
  ModelMetrics* m = metrics->AddModel(Info("m"));
  m->AddGeneratedTokens(3);
  m->AddGeneratedTokens(-10);
  m->AddGeneratedTokens(0);
  const auto families = Collect(*metrics);
  const auto* s = FindSeries(families, "fwserve_generated_tokens_total", {{"model", "m"}});
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->counter.value, 3);
}

TEST(MetricsTest, SeriesExistAtZeroRightAfterAddModel) {
  auto metrics = Metrics::Create();
  metrics->AddModel(Info("m"));
  const auto families = Collect(*metrics);
  for (const char* name :
       {"fwserve_prompt_tokens_total", "fwserve_generated_tokens_total",
        "fwserve_prompt_tokens_saved_total", "fwserve_scored_tokens_total",
        "fwserve_streams_preempted_total", "fwserve_engine_queued_requests",
        "fwserve_engine_active_streams", "fwserve_session_state_resident_bytes",
        "fwserve_time_to_first_token_seconds", "fwserve_inter_token_latency_seconds",
        "fwserve_generation_duration_seconds", "fwserve_engine_batch_size",
        "fwserve_engine_step_duration_seconds", "fwserve_engine_prefill_chunk_duration_seconds",
        "fwserve_engine_prefill_chunk_tokens"}) {
    EXPECT_NE(FindSeries(families, name, {{"model", "m"}}), nullptr) << name;
  }
  for (const char* op :
       {"created", "deleted", "forked", "imported", "exported", "spilled", "restored"}) {
    const auto* s =
        FindSeries(families, "fwserve_session_operations_total", {{"model", "m"}, {"op", op}});
    ASSERT_NE(s, nullptr) << op;
    EXPECT_EQ(s->counter.value, 0) << op;
  }
  for (const char* reason : {"expired", "evicted"}) {
    const auto* s = FindSeries(families, "fwserve_session_removals_total",
                               {{"model", "m"}, {"reason", reason}});
    ASSERT_NE(s, nullptr) << reason;
    EXPECT_EQ(s->counter.value, 0) << reason;
  }
}

TEST(MetricsTest, HistogramBucketPlacement) {
  auto metrics = Metrics::Create();
  ModelMetrics* m = metrics->AddModel(Info("m"));
  m->ObserveTimeToFirstToken(0.003);  // (0.0025, 0.005]
  m->ObserveTimeToFirstToken(0.005);  // upper bounds are inclusive
  m->ObserveTimeToFirstToken(2.0);    // (1, 2.5]
  m->ObserveTimeToFirstToken(100.0);  // +Inf only
  const auto families = Collect(*metrics);
  const auto* s = FindSeries(families, "fwserve_time_to_first_token_seconds", {{"model", "m"}});
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->histogram.sample_count, 4u);
  EXPECT_DOUBLE_EQ(s->histogram.sample_sum, 0.003 + 0.005 + 2.0 + 100.0);
  EXPECT_EQ(BucketCount(*s, 0.001), 0);
  EXPECT_EQ(BucketCount(*s, 0.0025), 0);
  EXPECT_EQ(BucketCount(*s, 0.005), 2);
  EXPECT_EQ(BucketCount(*s, 1), 2);
  EXPECT_EQ(BucketCount(*s, 2.5), 3);
  EXPECT_EQ(BucketCount(*s, 10), 3);
  EXPECT_EQ(BucketCount(*s, std::numeric_limits<double>::infinity()), 4);
}

TEST(MetricsTest, BucketsFitWhatTheyMeasure) {
  auto metrics = Metrics::Create();
  ModelMetrics* m = metrics->AddModel(Info("m"));
  m->ObserveInterTokenLatency(0.0002);
  m->ObserveGenerationDuration(90);
  m->ObservePrefillChunk(300, 0.04);
  const auto families = Collect(*metrics);
  // A 0.2 ms token gap lands in a sub-millisecond bucket, not the first one.
  const auto* itl = FindSeries(families, "fwserve_inter_token_latency_seconds", {{"model", "m"}});
  ASSERT_NE(itl, nullptr);
  EXPECT_EQ(BucketCount(*itl, 0.0001), 0);
  EXPECT_EQ(BucketCount(*itl, 0.00025), 1);
  // A 90 s generation is resolved below +Inf.
  const auto* gen = FindSeries(families, "fwserve_generation_duration_seconds", {{"model", "m"}});
  ASSERT_NE(gen, nullptr);
  EXPECT_EQ(BucketCount(*gen, 60), 0);
  EXPECT_EQ(BucketCount(*gen, 120), 1);
  const auto* chunk_tokens =
      FindSeries(families, "fwserve_engine_prefill_chunk_tokens", {{"model", "m"}});
  ASSERT_NE(chunk_tokens, nullptr);
  EXPECT_EQ(BucketCount(*chunk_tokens, 256), 0);
  EXPECT_EQ(BucketCount(*chunk_tokens, 1024), 1);
  const auto* chunk_seconds =
      FindSeries(families, "fwserve_engine_prefill_chunk_duration_seconds", {{"model", "m"}});
  ASSERT_NE(chunk_seconds, nullptr);
  EXPECT_EQ(chunk_seconds->histogram.sample_count, 1u);
  EXPECT_EQ(BucketCount(*chunk_seconds, 0.025), 0);
  EXPECT_EQ(BucketCount(*chunk_seconds, 0.05), 1);
}

// A message of n tokens is n observations of the same gap, in one update; a gap equal to
// a bound counts in that bound's bucket, as one observation does.
TEST(MetricsTest, AMessageOfSeveralTokensObservesEachOfThem) {
  auto metrics = Metrics::Create();
  ModelMetrics* m = metrics->AddModel(Info("m"));
  m->ObserveInterTokenLatency(0.0002, 3);
  m->ObserveInterTokenLatency(0.001, 2);
  m->ObserveInterTokenLatency(5.0, 4);  // beyond every bound: +Inf only
  m->ObserveInterTokenLatency(0.001, 0);
  const auto families = Collect(*metrics);
  const auto* itl = FindSeries(families, "fwserve_inter_token_latency_seconds", {{"model", "m"}});
  ASSERT_NE(itl, nullptr);
  EXPECT_EQ(itl->histogram.sample_count, 9u);
  EXPECT_NEAR(itl->histogram.sample_sum, 0.0006 + 0.002 + 20.0, 1e-12);
  EXPECT_EQ(BucketCount(*itl, 0.0001), 0);
  EXPECT_EQ(BucketCount(*itl, 0.00025), 3);
  EXPECT_EQ(BucketCount(*itl, 0.0005), 3);
  EXPECT_EQ(BucketCount(*itl, 0.001), 5);
  EXPECT_EQ(BucketCount(*itl, std::numeric_limits<double>::infinity()), 9);
}

TEST(MetricsTest, DecodeStepObservesBatchSizeAndDuration) {
  auto metrics = Metrics::Create();
  ModelMetrics* m = metrics->AddModel(Info("m"));
  m->ObserveDecodeStep(1, 0.001);
  m->ObserveDecodeStep(3, 0.002);
  m->ObserveDecodeStep(256, 0.02);
  const auto families = Collect(*metrics);
  const auto* batch = FindSeries(families, "fwserve_engine_batch_size", {{"model", "m"}});
  ASSERT_NE(batch, nullptr);
  std::vector<double> bounds;
  for (const auto& bucket : batch->histogram.bucket) bounds.push_back(bucket.upper_bound);
  EXPECT_EQ(bounds, (std::vector<double>{1, 2, 4, 8, 16, 32, 64, 128, 256,
                                         std::numeric_limits<double>::infinity()}));
  EXPECT_EQ(BucketCount(*batch, 1), 1);
  EXPECT_EQ(BucketCount(*batch, 2), 1);
  EXPECT_EQ(BucketCount(*batch, 4), 2);
  EXPECT_EQ(BucketCount(*batch, 128), 2);
  EXPECT_EQ(BucketCount(*batch, 256), 3);
  EXPECT_DOUBLE_EQ(batch->histogram.sample_sum, 260);
  const auto* step = FindSeries(families, "fwserve_engine_step_duration_seconds", {{"model", "m"}});
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->histogram.sample_count, 3u);
  EXPECT_DOUBLE_EQ(step->histogram.sample_sum, 0.023);
}

TEST(MetricsTest, RequestCounterIsLabelledByCodeName) {
  auto metrics = Metrics::Create();
  metrics->AddModel(Info("m"));
  metrics->ObserveRequest("Generate", "m", 0, 0.5);
  metrics->ObserveRequest("Generate", "m", 0, 1.5);
  metrics->ObserveRequest("Generate", "m", 3, 0.001);
  metrics->ObserveRequest("Generate", "m", 8, 0.001);
  metrics->ObserveRequest("Score", "m", 16, 0.001);
  metrics->ObserveRequest("Score", "m", 42, 0.001);  // not a gRPC code
  const auto families = Collect(*metrics);
  auto count = [&](const std::string& rpc, const std::string& code) {
    const auto* s = FindSeries(families, "fwserve_requests_total",
                               {{"rpc", rpc}, {"model", "m"}, {"code", code}});
    return s == nullptr ? -1.0 : s->counter.value;
  };
  EXPECT_EQ(count("Generate", "OK"), 2);
  EXPECT_EQ(count("Generate", "INVALID_ARGUMENT"), 1);
  EXPECT_EQ(count("Generate", "RESOURCE_EXHAUSTED"), 1);
  EXPECT_EQ(count("Score", "UNAUTHENTICATED"), 1);
  EXPECT_EQ(count("Score", "UNKNOWN"), 1);

  const auto* generate =
      FindSeries(families, "fwserve_request_duration_seconds", {{"rpc", "Generate"}});
  ASSERT_NE(generate, nullptr);
  EXPECT_EQ(generate->histogram.sample_count, 4u);
  EXPECT_EQ(BucketCount(*generate, 1), 3);
  EXPECT_EQ(BucketCount(*generate, 2.5), 4);
  const auto* score = FindSeries(families, "fwserve_request_duration_seconds", {{"rpc", "Score"}});
  ASSERT_NE(score, nullptr);
  EXPECT_EQ(score->histogram.sample_count, 2u);

  EXPECT_NE(Scrape(*metrics).find("fwserve_requests_total{code=\"RESOURCE_EXHAUSTED\",model="
                                  "\"m\",rpc=\"Generate\"} 1\n"),
            std::string::npos);
}

TEST(MetricsTest, AllGrpcCodesHaveCanonicalNames) {
  auto metrics = Metrics::Create();
  for (int code = 0; code <= 16; ++code) metrics->ObserveRequest("Health", "", code, 0.001);
  const auto families = Collect(*metrics);
  const std::vector<std::string> names = {"OK",
                                          "CANCELLED",
                                          "UNKNOWN",
                                          "INVALID_ARGUMENT",
                                          "DEADLINE_EXCEEDED",
                                          "NOT_FOUND",
                                          "ALREADY_EXISTS",
                                          "PERMISSION_DENIED",
                                          "RESOURCE_EXHAUSTED",
                                          "FAILED_PRECONDITION",
                                          "ABORTED",
                                          "OUT_OF_RANGE",
                                          "UNIMPLEMENTED",
                                          "INTERNAL",
                                          "UNAVAILABLE",
                                          "DATA_LOSS",
                                          "UNAUTHENTICATED"};
  for (const auto& name : names) {
    const auto* s = FindSeries(families, "fwserve_requests_total",
                               {{"rpc", "Health"}, {"model", ""}, {"code", name}});
    ASSERT_NE(s, nullptr) << name;
    EXPECT_EQ(s->counter.value, 1) << name;
  }
}

TEST(MetricsTest, UnregisteredModelNamesDoNotBecomeLabels) {
  auto metrics = Metrics::Create();
  metrics->AddModel(Info("m"));
  metrics->ObserveRequest("Generate", "no-such-model-1", 5, 0.001);
  metrics->ObserveRequest("Generate", "no-such-model-2", 5, 0.001);
  const auto families = Collect(*metrics);
  const auto* s = FindSeries(families, "fwserve_requests_total",
                             {{"rpc", "Generate"}, {"model", ""}, {"code", "NOT_FOUND"}});
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->counter.value, 2);
  EXPECT_EQ(Scrape(*metrics).find("no-such-model"), std::string::npos);
}

TEST(MetricsTest, GaugesTakeTheLatestValue) {
  auto metrics = Metrics::Create();
  ModelMetrics* m = metrics->AddModel(Info("m"));
  m->SetQueuedRequests(4);
  m->SetQueuedRequests(2);
  m->SetActiveStreams(7);
  m->SetSessions(3, 11, 3 * 65536);
  m->SetStateMemoryUsage(1 << 20, 4 << 20);
  const auto families = Collect(*metrics);
  auto gauge = [&](const std::string& name, const Labels& labels) {
    const auto* s = FindSeries(families, name, labels);
    return s == nullptr ? -1.0 : s->gauge.value;
  };
  EXPECT_EQ(gauge("fwserve_engine_queued_requests", {{"model", "m"}}), 2);
  EXPECT_EQ(gauge("fwserve_engine_active_streams", {{"model", "m"}}), 7);
  EXPECT_EQ(gauge("fwserve_sessions", {{"model", "m"}, {"state", "resident"}}), 3);
  EXPECT_EQ(gauge("fwserve_sessions", {{"model", "m"}, {"state", "spilled"}}), 11);
  EXPECT_EQ(gauge("fwserve_session_state_resident_bytes", {{"model", "m"}}), 3 * 65536);
  EXPECT_EQ(gauge("fwserve_state_memory_usage_ratio", {{"model", "m"}}), 0.25);
}

TEST(MetricsTest, SessionOperationsAndRemovalsIncludingUnknownValues) {
  auto metrics = Metrics::Create();
  ModelMetrics* m = metrics->AddModel(Info("m"));
  m->CountSessionOperation("created");
  m->CountSessionOperation("created");
  m->CountSessionOperation("spilled");
  m->CountSessionOperation("renamed");  // not a known op: still counted
  m->CountSessionOperation("renamed");
  m->CountSessionRemoval("expired");
  m->CountSessionRemoval("evicted");
  m->CountSessionRemoval("evicted");
  const auto families = Collect(*metrics);
  auto count = [&](const std::string& name, const std::string& key, const std::string& value) {
    const auto* s = FindSeries(families, name, {{"model", "m"}, {key, value}});
    return s == nullptr ? -1.0 : s->counter.value;
  };
  EXPECT_EQ(count("fwserve_session_operations_total", "op", "created"), 2);
  EXPECT_EQ(count("fwserve_session_operations_total", "op", "spilled"), 1);
  EXPECT_EQ(count("fwserve_session_operations_total", "op", "deleted"), 0);
  EXPECT_EQ(count("fwserve_session_operations_total", "op", "renamed"), 2);
  EXPECT_EQ(count("fwserve_session_removals_total", "reason", "expired"), 1);
  EXPECT_EQ(count("fwserve_session_removals_total", "reason", "evicted"), 2);
}

TEST(MetricsTest, ModelInfoAndBuildInfo) {
  auto metrics = Metrics::Create();
  metrics->AddModel(Info("m"));
  const auto families = Collect(*metrics);
  const auto* info = FindSeries(families, "fwserve_model_info",
                                {{"model", "m"},
                                 {"architecture", "fast_weight"},
                                 {"parameters", "1234567"},
                                 {"state_bytes_per_session", "65536"}});
  ASSERT_NE(info, nullptr);
  EXPECT_EQ(info->gauge.value, 1);
  const auto* build = FindFamily(families, "fwserve_build_info");
  ASSERT_NE(build, nullptr);
  ASSERT_EQ(build->metric.size(), 1u);
  ASSERT_EQ(build->metric[0].label.size(), 1u);
  EXPECT_EQ(build->metric[0].label[0].name, "version");
  EXPECT_FALSE(build->metric[0].label[0].value.empty());
  EXPECT_EQ(build->metric[0].gauge.value, 1);
}

TEST(MetricsTest, TwoModelsAreIndependent) {
  auto metrics = Metrics::Create();
  ModelMetrics* a = metrics->AddModel(Info("a"));
  ModelMetrics* b = metrics->AddModel(Info("b"));
  ASSERT_NE(a, b);
  a->AddGeneratedTokens(10);
  b->AddGeneratedTokens(1);
  a->SetActiveStreams(5);
  b->ObserveTimeToFirstToken(0.1);
  const auto families = Collect(*metrics);
  EXPECT_EQ(FindSeries(families, "fwserve_generated_tokens_total", {{"model", "a"}})->counter.value,
            10);
  EXPECT_EQ(FindSeries(families, "fwserve_generated_tokens_total", {{"model", "b"}})->counter.value,
            1);
  EXPECT_EQ(FindSeries(families, "fwserve_engine_active_streams", {{"model", "a"}})->gauge.value,
            5);
  EXPECT_EQ(FindSeries(families, "fwserve_engine_active_streams", {{"model", "b"}})->gauge.value,
            0);
  EXPECT_EQ(FindSeries(families, "fwserve_time_to_first_token_seconds", {{"model", "a"}})
                ->histogram.sample_count,
            0u);
  EXPECT_EQ(FindSeries(families, "fwserve_time_to_first_token_seconds", {{"model", "b"}})
                ->histogram.sample_count,
            1u);
  EXPECT_EQ(FindFamily(families, "fwserve_model_info")->metric.size(), 2u);
}

TEST(MetricsTest, ForModelAndRepeatedAddModel) {
  auto metrics = Metrics::Create();
  EXPECT_EQ(metrics->ForModel("m"), nullptr);
  ModelMetrics* m = metrics->AddModel(Info("m"));
  EXPECT_EQ(metrics->ForModel("m"), m);
  EXPECT_EQ(metrics->ForModel("other"), nullptr);
  ModelInfoLabels changed = Info("m");
  changed.parameters = 1;
  EXPECT_EQ(metrics->AddModel(changed), m);
  // The second registration does not add a second model_info series.
  EXPECT_EQ(FindFamily(Collect(*metrics), "fwserve_model_info")->metric.size(), 1u);
}

TEST(MetricsTest, ConcurrentUpdatesAreNotLost) {
  auto metrics = Metrics::Create();
  ModelMetrics* m = metrics->AddModel(Info("m"));
  constexpr int kThreads = 4, kIterations = 5000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kIterations; ++i) {
        m->AddGeneratedTokens(1);
        m->ObserveInterTokenLatency(0.001);
        m->CountSessionOperation("forked");
        metrics->ObserveRequest("Generate", "m", 0, 0.01);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  const auto families = Collect(*metrics);
  constexpr double kTotal = kThreads * kIterations;
  EXPECT_EQ(FindSeries(families, "fwserve_generated_tokens_total", {{"model", "m"}})->counter.value,
            kTotal);
  EXPECT_EQ(FindSeries(families, "fwserve_inter_token_latency_seconds", {{"model", "m"}})
                ->histogram.sample_count,
            static_cast<uint64_t>(kTotal));
  EXPECT_EQ(
      FindSeries(families, "fwserve_session_operations_total", {{"model", "m"}, {"op", "forked"}})
          ->counter.value,
      kTotal);
  EXPECT_EQ(FindSeries(families, "fwserve_requests_total",
                       {{"rpc", "Generate"}, {"model", "m"}, {"code", "OK"}})
                ->counter.value,
            kTotal);
}

TEST(MetricsTest, ProcessMetricsArePresentAndFresh) {
  auto metrics = Metrics::Create();
  const auto before = Collect(*metrics);
  for (const char* name :
       {"process_cpu_seconds_total", "process_resident_memory_bytes",
        "process_virtual_memory_bytes", "process_start_time_seconds", "process_open_fds"}) {
    ASSERT_NE(FindFamily(before, name), nullptr) << name;
    ASSERT_EQ(FindFamily(before, name)->metric.size(), 1u) << name;
  }
  const double cpu_before =
      FindFamily(before, "process_cpu_seconds_total")->metric[0].counter.value;
  const double rss = FindFamily(before, "process_resident_memory_bytes")->metric[0].gauge.value;
  const double start = FindFamily(before, "process_start_time_seconds")->metric[0].gauge.value;
  EXPECT_GE(cpu_before, 0);
  EXPECT_GT(rss, 1 << 20);  // a running gtest binary holds at least 1 MiB
  EXPECT_GT(FindFamily(before, "process_virtual_memory_bytes")->metric[0].gauge.value, rss);
  EXPECT_GT(FindFamily(before, "process_open_fds")->metric[0].gauge.value, 0);
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_GT(start, now - 3600);
  EXPECT_LE(start, now + 1);

  // Burn CPU and touch memory: the next scrape reflects it (values are read at collect time).
  std::vector<char> block(64 << 20, 1);
  volatile double sink = 0;
  for (int i = 0; i < 50000000; ++i) sink = sink + i * 0.5;
  const auto after = Collect(*metrics);
  EXPECT_GT(FindFamily(after, "process_cpu_seconds_total")->metric[0].counter.value, cpu_before);
  EXPECT_GT(FindFamily(after, "process_resident_memory_bytes")->metric[0].gauge.value,
            rss + (32 << 20));
  EXPECT_EQ(block[12345], 1);

  const std::string text = Scrape(*metrics);
  EXPECT_NE(text.find("# TYPE process_cpu_seconds_total counter"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE process_resident_memory_bytes gauge"), std::string::npos);
}

}  // namespace
