// Metrics under real load: scrape /metrics over HTTP from an in-process server and check
// that the series agree with what the client actually saw; lint the scrape with promtool.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <thread>

#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "server/base/clock.h"
#include "tests/integration/harness.h"

namespace fwtest {
namespace {

namespace v1 = fwserve::v1;

// GET http://127.0.0.1:port/metrics; the body.
std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return "";
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return "";
  }
  std::string response;
  char buffer[8192];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0)
    response.append(buffer, static_cast<size_t>(n));
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

std::vector<Sample> Parse(const std::string& text) {
  std::vector<Sample> samples;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    Sample sample;
    const size_t brace = line.find('{');
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    if (brace != absl::string_view::npos && brace < space) {
      sample.name = std::string(line.substr(0, brace));
      const size_t close = line.rfind('}', space);
      for (absl::string_view pair :
           absl::StrSplit(line.substr(brace + 1, close - brace - 1), ',', absl::SkipEmpty())) {
        const size_t eq = pair.find('=');
        std::string value(pair.substr(eq + 1));
        sample.labels[std::string(pair.substr(0, eq))] = value.substr(1, value.size() - 2);
      }
    } else {
      sample.name = std::string(line.substr(0, space));
    }
    sample.value = std::stod(std::string(line.substr(space + 1)));
    samples.push_back(std::move(sample));
  }
  return samples;
}

// The value of the one sample of `name` whose labels include `labels`; -1 if none.
double Value(const std::vector<Sample>& samples, const std::string& name,
             const std::map<std::string, std::string>& labels = {}) {
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto it = s.labels.find(k);
      match &= it != s.labels.end() && it->second == v;
    }
    if (match) return s.value;
  }
  return -1;
}

TEST(MetricsTest, ScrapedSeriesAgreeWithTheLoadAndPassPromtool) {
  const std::string dir = MakeTempDir("metrics-model");
  WriteTinyCheckpoint(dir + "/aft", "aft", 3);
  fwserve::CoreOptions options;
  options.model_dirs = {dir + "/aft"};
  auto server = Harness::Start(options, {}, /*expose_metrics=*/true);
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();

  // Load: 6 throwaway generations of 1..6 tokens, two on a session, one bad request,
  // one score.
  int64_t streamed = 0, prompt_tokens = 0, ok_generates = 0;
  for (int i = 1; i <= 6; ++i) {
    v1::GenerateRequest request;
    request.set_prompt("prompt" + std::to_string(i));  // 7 bytes
    request.set_max_tokens(i);
    auto result = client.Generate(request);
    ASSERT_TRUE(result.ok());
    streamed += static_cast<int64_t>(result->token_ids.size());
    prompt_tokens += 7;
    ++ok_generates;
  }
  auto session = client.CreateSession("", "history!");  // 8 tokens
  ASSERT_TRUE(session.ok());
  prompt_tokens += 8;
  int64_t saved = 0;
  for (int i = 0; i < 2; ++i) {
    auto info = client.GetSession(session->session_id());
    saved += info->tokens();
    v1::GenerateRequest request;
    request.set_session_id(session->session_id());
    request.set_prompt("more");
    request.set_max_tokens(10);
    auto result = client.Generate(request);
    ASSERT_TRUE(result.ok());
    streamed += static_cast<int64_t>(result->token_ids.size());
    prompt_tokens += 4;
    ++ok_generates;
  }
  v1::GenerateRequest bad;
  bad.set_prompt("x");
  bad.set_max_tokens(-5);
  EXPECT_EQ(client.Generate(bad).status().code(), absl::StatusCode::kInvalidArgument);
  v1::ScoreRequest score;
  score.set_text("score me");
  ASSERT_TRUE(client.Score(score).ok());

  // Gauges are published once a second; wait for them to show the session.
  std::vector<Sample> samples;
  for (int i = 0; i < 40; ++i) {
    samples = Parse(Scrape(server->metrics_port()));
    if (Value(samples, "fwserve_sessions", {{"model", "aft"}, {"state", "resident"}}) == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const std::map<std::string, std::string> aft = {{"model", "aft"}};
  EXPECT_EQ(Value(samples, "fwserve_generated_tokens_total", aft), streamed);
  EXPECT_EQ(Value(samples, "fwserve_prompt_tokens_total", aft), prompt_tokens);
  EXPECT_EQ(Value(samples, "fwserve_prompt_tokens_saved_total", aft), saved);
  EXPECT_EQ(Value(samples, "fwserve_scored_tokens_total", aft), 8);
  EXPECT_EQ(Value(samples, "fwserve_requests_total",
                  {{"rpc", "Generate"}, {"model", "aft"}, {"code", "OK"}}),
            ok_generates);
  EXPECT_EQ(
      Value(samples, "fwserve_requests_total", {{"rpc", "Generate"}, {"code", "INVALID_ARGUMENT"}}),
      1);
  EXPECT_EQ(Value(samples, "fwserve_requests_total", {{"rpc", "CreateSession"}, {"code", "OK"}}),
            1);
  // Every generation streamed at least one token: one TTFT each, and one inter-token
  // gap per further token.
  EXPECT_EQ(Value(samples, "fwserve_time_to_first_token_seconds_count", aft), ok_generates);
  EXPECT_EQ(Value(samples, "fwserve_inter_token_latency_seconds_count", aft),
            streamed - ok_generates);
  EXPECT_EQ(Value(samples, "fwserve_generation_duration_seconds_count", aft), ok_generates);
  // Each streamed token was absorbed by exactly one batched step row.
  EXPECT_EQ(Value(samples, "fwserve_engine_batch_size_sum", aft), streamed);
  EXPECT_EQ(Value(samples, "fwserve_sessions", {{"model", "aft"}, {"state", "resident"}}), 1);
  // One resident session's state against the default budget (1 GiB).
  const double state_bytes = Value(samples, "fwserve_session_state_resident_bytes", aft);
  EXPECT_GT(state_bytes, 0);
  EXPECT_DOUBLE_EQ(Value(samples, "fwserve_state_memory_usage_ratio", aft),
                   state_bytes / static_cast<double>(options.engine.max_state_memory_bytes));
  EXPECT_EQ(
      Value(samples, "fwserve_session_operations_total", {{"model", "aft"}, {"op", "created"}}), 1);
  EXPECT_EQ(Value(samples, "fwserve_model_info", {{"model", "aft"}, {"architecture", "aft"}}), 1);
  EXPECT_GT(Value(samples, "process_resident_memory_bytes"), 0);

#ifdef FWSERVE_PROMTOOL
  const std::string path = dir + "/scrape.txt";
  std::ofstream(path) << Scrape(server->metrics_port());
  const std::string command = std::string(FWSERVE_PROMTOOL) + " check metrics < " + path + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[512];
  while (fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  EXPECT_EQ(pclose(pipe), 0) << output;
#endif
}

// A Score whose caller has gone is dropped between chunks instead of occupying the
// engine for the whole text.
TEST(MetricsTest, AbandonedScoreIsDroppedAsCancelled) {
  const std::string dir = MakeTempDir("abandoned-score");
  WriteTinyCheckpoint(dir + "/aft", "aft", 3);
  fwserve::CoreOptions options;
  options.model_dirs = {dir + "/aft"};
  options.engine.scheduler.prefill_chunk_tokens = 64;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  fwserve::ClientOptions client_options;
  client_options.target = server->target();
  client_options.deadline = absl::Milliseconds(100);
  client_options.max_retries = 0;
  auto impatient = fwserve::Client::Connect(client_options);
  ASSERT_TRUE(impatient.ok());
  v1::ScoreRequest request;
  request.set_text(std::string(1 << 20, 'a'));
  EXPECT_EQ((*impatient)->Score(request).status().code(), absl::StatusCode::kDeadlineExceeded);
  std::vector<Sample> samples;
  for (int i = 0; i < 100; ++i) {
    prometheus::TextSerializer serializer;
    samples = Parse(serializer.Serialize(server->metrics().registry()->Collect()));
    if (Value(samples, "fwserve_requests_total", {{"rpc", "Score"}, {"code", "CANCELLED"}}) == 1) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(Value(samples, "fwserve_requests_total", {{"rpc", "Score"}, {"code", "CANCELLED"}}), 1);
  EXPECT_LT(Value(samples, "fwserve_scored_tokens_total", {{"model", "aft"}}), 1 << 20);
}

// Scrapes until `done(samples)` holds (gauges and housekeeping run once a second); the
// last scrape. Fails the test after 30 s.
template <typename Predicate>
std::vector<Sample> ScrapeUntil(int port, Predicate done) {
  std::vector<Sample> samples;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (true) {
    samples = Parse(Scrape(port));
    if (done(samples)) return samples;
    if (absl::Now() > deadline) {
      ADD_FAILURE() << "the scrape never showed what the test waited for";
      return samples;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// docs/metrics.md: every session operation and removal reason, the spilled state, the
// per-RPC duration histogram, and the queued/active gauges, on a live server.
TEST(MetricsTest, SessionOperationsRemovalsAndGaugesOnALiveServer) {
  const std::string dir = MakeTempDir("metrics-ops");
  WriteTinyCheckpoint(dir + "/aft", "aft", 3);
  fwserve::CoreOptions options;
  options.model_dirs = {dir + "/aft"};
  int64_t state_bytes = 0;
  {
    auto probe = Harness::Start(options);
    ASSERT_NE(probe, nullptr);
    state_bytes = probe->client().DescribeModel()->state_bytes_per_session();
  }
  fwserve::FakeClock clock;
  options.clock = &clock;
  options.engine.session_ttl = absl::Hours(1);
  options.session_store = "dir:" + MakeTempDir("metrics-ops-store");
  options.engine.max_state_memory_bytes = 2 * state_bytes;
  options.engine.scheduler.max_active_streams = 1;
  options.max_tokens = 100000;
  // Each decode step takes at least 5 ms: a 100,000-token stream runs far longer than
  // the test looks at it.
  options.engine.before_decode_step_for_testing = [](const std::function<bool()>&) {
    absl::SleepFor(absl::Milliseconds(5));
  };
  auto server = Harness::Start(options, {}, /*expose_metrics=*/true);
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  const int port = server->metrics_port();
  const auto op = [](const char* name) {
    return std::map<std::string, std::string>{{"model", "aft"}, {"op", name}};
  };

  auto a = client.CreateSession("", "alpha");
  ASSERT_TRUE(a.ok());
  auto forked = client.ForkSession(a->session_id());
  ASSERT_TRUE(forked.ok());
  auto blob = client.ExportSession(a->session_id());
  ASSERT_TRUE(blob.ok());
  auto imported = client.ImportSession(blob->blob());  // a third session: one is spilled
  ASSERT_TRUE(imported.ok()) << imported.status();
  std::string spilled_id;
  for (const std::string& id :
       std::vector<std::string>{a->session_id(), forked->session_id(), imported->session_id()}) {
    auto info = client.GetSession(id);
    ASSERT_TRUE(info.ok());
    if (!info->resident()) spilled_id = id;
  }
  ASSERT_FALSE(spilled_id.empty()) << "no session was spilled";
  auto samples = ScrapeUntil(port, [](const std::vector<Sample>& s) {
    return Value(s, "fwserve_sessions", {{"model", "aft"}, {"state", "spilled"}}) == 1;
  });
  EXPECT_EQ(Value(samples, "fwserve_session_operations_total", op("forked")), 1);
  EXPECT_EQ(Value(samples, "fwserve_session_operations_total", op("exported")), 1);
  EXPECT_EQ(Value(samples, "fwserve_session_operations_total", op("imported")), 1);
  EXPECT_EQ(Value(samples, "fwserve_session_operations_total", op("spilled")), 1);
  EXPECT_EQ(Value(samples, "fwserve_sessions", {{"model", "aft"}, {"state", "resident"}}), 2);
  EXPECT_EQ(Value(samples, "fwserve_request_duration_seconds_count", {{"rpc", "ExportSession"}}),
            1);
  EXPECT_EQ(Value(samples, "fwserve_request_duration_seconds_count", {{"rpc", "ForkSession"}}), 1);

  // Using the spilled session restores it (and spills another to make room).
  ASSERT_TRUE(client.Generate(GreedyRequest("!", 1, spilled_id)).ok());
  ASSERT_TRUE(client.DeleteSession(spilled_id).ok());
  samples = Parse(Scrape(port));
  EXPECT_EQ(Value(samples, "fwserve_session_operations_total", op("restored")), 1);
  EXPECT_EQ(Value(samples, "fwserve_session_operations_total", op("deleted")), 1);

  // One stream runs (held at 5 ms a step) and one waits behind it (one active stream).
  auto running = client.StartGenerate(GreedyRequest("run", 100000));
  fwserve::v1::GenerateResponse message;
  ASSERT_TRUE(running->Next(&message));
  auto waiting = client.StartGenerate(GreedyRequest("wait", 5));
  samples = ScrapeUntil(port, [](const std::vector<Sample>& s) {
    return Value(s, "fwserve_engine_queued_requests", {{"model", "aft"}}) == 1 &&
           Value(s, "fwserve_engine_active_streams", {{"model", "aft"}}) == 1;
  });
  running->Cancel();
  while (running->Next(&message)) {
  }
  while (waiting->Next(&message)) {
  }
  EXPECT_TRUE(waiting->Finish().ok());

  // The two sessions left expire.
  clock.Advance(absl::Hours(2));
  samples = ScrapeUntil(port, [](const std::vector<Sample>& s) {
    return Value(s, "fwserve_session_removals_total", {{"model", "aft"}, {"reason", "expired"}}) ==
           2;
  });
  EXPECT_TRUE(client.ListAllSessions()->empty());
}

// --session-store=memory: over the memory budget the least recently used idle session
// is evicted, and counted.
TEST(MetricsTest, EvictedSessionsAreCounted) {
  const std::string dir = MakeTempDir("metrics-evict");
  WriteTinyCheckpoint(dir + "/aft", "aft", 3);
  fwserve::CoreOptions options;
  options.model_dirs = {dir + "/aft"};
  int64_t state_bytes = 0;
  {
    auto probe = Harness::Start(options);
    ASSERT_NE(probe, nullptr);
    state_bytes = probe->client().DescribeModel()->state_bytes_per_session();
  }
  options.engine.max_state_memory_bytes = 2 * state_bytes;
  auto server = Harness::Start(options, {}, /*expose_metrics=*/true);
  ASSERT_NE(server, nullptr);
  for (const char* prefix : {"one", "two", "three"}) {
    ASSERT_TRUE(server->client().CreateSession("", prefix).ok());
  }
  const auto samples = Parse(Scrape(server->metrics_port()));
  EXPECT_EQ(
      Value(samples, "fwserve_session_removals_total", {{"model", "aft"}, {"reason", "evicted"}}),
      1);
}

}  // namespace
}  // namespace fwtest
