// End-to-end behaviour of fwserve: a real server in-process on port 0, driven through
// the real client library over a real gRPC channel. Models are small random
// checkpoints written by the test, except where the shipped model is named.
#include <gtest/gtest.h>

#include <prometheus/registry.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "server/base/utf8.h"
#include "tests/integration/harness.h"

namespace fwtest {
namespace {

namespace v1 = fwserve::v1;
using absl::StatusCode;

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    models_dir_ = new std::string(MakeTempDir("models"));
    for (const char* arch : {"aft", "fast_weight", "linear_attention"}) {
      WriteTinyCheckpoint(*models_dir_ + "/" + arch, arch, 7);
    }
  }
  static std::string ModelDir(const std::string& arch) { return *models_dir_ + "/" + arch; }

  fwserve::CoreOptions Options(const std::string& arch = "aft") {
    fwserve::CoreOptions options;
    options.model_dirs = {ModelDir(arch)};
    options.max_tokens = 2000;
    return options;
  }

  // Starts a server with `options` (into *variant) and one with the defaults (into
  // *reference), and expects the same greedy continuation from both. Callers return on
  // HasFatalFailure().
  void StartBesideTheDefault(const fwserve::CoreOptions& options, std::unique_ptr<Harness>* variant,
                             std::unique_ptr<Harness>* reference) {
    *variant = Harness::Start(options);
    ASSERT_NE(*variant, nullptr);
    *reference = Harness::Start(Options());
    ASSERT_NE(*reference, nullptr);
    ExpectTheSameGreedyContinuation(**variant, **reference);
  }

  // `server` gives `native`'s greedy continuation of "Hello, world": 50 tokens (prefill
  // and 49 decode steps), the same ids and text, each logprob within 1e-4.
  static void ExpectTheSameGreedyContinuation(Harness& server, Harness& native) {
    v1::GenerateRequest request = Greedy("Hello, world", 50);
    request.set_logprobs(true);
    auto got = server.client().Generate(request);
    auto expected = native.client().Generate(request);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(expected.ok()) << expected.status();
    EXPECT_EQ(got->usage.generated_tokens(), 50);
    EXPECT_EQ(got->usage.session_tokens(), 62);
    ASSERT_EQ(got->token_ids.size(), 50u);
    EXPECT_EQ(got->token_ids, expected->token_ids);
    EXPECT_EQ(got->text, expected->text);
    ASSERT_EQ(got->logprobs.size(), expected->logprobs.size());
    for (size_t i = 0; i < got->logprobs.size(); ++i) {
      EXPECT_NEAR(got->logprobs[i], expected->logprobs[i], 1e-4) << "token " << i;
    }
  }

  static v1::GenerateRequest Greedy(const std::string& prompt, int max_tokens,
                                    const std::string& session_id = "") {
    return fwtest::GreedyRequest(prompt, max_tokens, session_id);
  }

  // Runs `requests` at once, each on a client thread of its own, then 10 greedy tokens on
  // `session_id`; returns every result in order, the continuation's last. A failed call
  // fails the test and leaves its result empty.
  // Every request at once, one thread each; the results in the requests' order.
  static std::vector<fwserve::GenerateResult> GenerateAtOnce(
      Harness& server, const std::vector<v1::GenerateRequest>& requests) {
    std::vector<fwserve::GenerateResult> results(requests.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] {
        auto result = server.client().Generate(requests[i]);
        EXPECT_TRUE(result.ok()) << result.status();
        if (result.ok()) results[i] = *result;
      });
    }
    for (std::thread& t : threads) t.join();
    return results;
  }

  static std::vector<fwserve::GenerateResult> GenerateAtOnceThenContinue(
      Harness& server, const std::vector<v1::GenerateRequest>& requests,
      const std::string& session_id) {
    std::vector<fwserve::GenerateResult> results = GenerateAtOnce(server, requests);
    auto more = server.client().Generate(Greedy("", 10, session_id));
    EXPECT_TRUE(more.ok()) << more.status();
    results.push_back(more.ok() ? *more : fwserve::GenerateResult{});
    return results;
  }

  void ExpectCancellationMidStreamKeepsAStreamedPrefix(fwserve::GrpcServerOptions server_options);

  static std::string* models_dir_;
};

std::string* ServerTest::models_dir_ = nullptr;

// True once a request holds session `id` (polled for up to 10 s).
bool WaitUntilBusy(fwserve::Client& client, const std::string& id) {
  for (int i = 0; i < 2000; ++i) {
    auto info = client.GetSession(id);
    if (info.ok() && info->busy()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// Polls `done` every 10 ms for up to `limit` (real time: the engine's housekeeping
// runs once a second). True as soon as it holds.
template <typename Predicate>
bool Eventually(Predicate done, absl::Duration limit = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + limit;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// Holds every engine of a server before its decode steps, so that a stream stays open
// for as long as a test needs, however fast the machine decodes: lets `free_steps` steps
// through, then holds each step until Open() or, with `until_ending`, until shutdown
// asks the engine to end the remaining work (EngineOptions::before_decode_step_for_testing).
// Declare it before the server it is installed in, and Open() it before the server stops.
class StepGate {
 public:
  explicit StepGate(int free_steps, bool until_ending = false)
      : free_steps_(free_steps), until_ending_(until_ending) {}

  void Install(fwserve::CoreOptions& options) {
    options.engine.before_decode_step_for_testing = [this](const std::function<bool()>& ending) {
      absl::MutexLock lock(&mu_);
      if (steps_ < free_steps_ || open_) {
        ++steps_;
        return;
      }
      held_ = true;
      // `ending` is the engine's state, not ours: look at it every millisecond.
      while (!open_ && !(until_ending_ && ending())) {
        mu_.AwaitWithTimeout(absl::Condition(&open_), absl::Milliseconds(1));
      }
      held_ = false;
      ++steps_;
    };
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }
  // True once a step is held at the gate (false after 30 s: the test failed).
  bool WaitHeld() {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&held_), absl::Seconds(30));
  }

 private:
  absl::Mutex mu_;
  const int free_steps_;
  const bool until_ending_;
  int steps_ ABSL_GUARDED_BY(mu_) = 0;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
};

// How many `rpc` requests the server has finished (fwserve_requests_total), with status
// `code` ("OK", "CANCELLED", ...) or with any code if `code` is empty.
double FinishedRequests(fwserve::Metrics& metrics, const std::string& rpc,
                        const std::string& code = "") {
  double count = 0;
  for (const auto& family : metrics.registry()->Collect()) {
    if (family.name != "fwserve_requests_total") continue;
    for (const auto& metric : family.metric) {
      bool match = true;
      for (const auto& label : metric.label) {
        if (label.name == "rpc") match &= label.value == rpc;
        if (label.name == "code" && !code.empty()) match &= label.value == code;
      }
      if (match) count += metric.counter.value;
    }
  }
  return count;
}

// ----------------------------------------------------------------------------------
// Streaming.

// With --decode-lookahead 1 a stream never runs ahead of its last write: one message
// per token.
TEST_F(ServerTest, StreamsValidUtf8TokenByTokenWithUsage) {
  fwserve::CoreOptions options = Options();
  options.engine.decode_lookahead = 1;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  v1::GenerateRequest request = Greedy("Hello, world", 40);
  request.set_logprobs(true);
  int messages = 0;
  auto result = server->client().Generate(request, [&](const v1::GenerateResponse& m) {
    ++messages;
    EXPECT_EQ(fwserve::FirstInvalidUtf8Offset(m.text()), -1);
    EXPECT_EQ(m.logprobs_size(), m.token_ids_size());
    return true;
  });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->token_ids.size(), 40u);
  EXPECT_EQ(messages, 41);  // one per token, then the final message
  EXPECT_EQ(result->finish_reason, v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(result->usage.prompt_tokens(), 12);
  EXPECT_EQ(result->usage.generated_tokens(), 40);
  EXPECT_EQ(result->usage.session_tokens(), 52);
  EXPECT_EQ(fwserve::FirstInvalidUtf8Offset(result->text), -1);
  for (float logprob : result->logprobs) EXPECT_LE(logprob, 0.0f);
}

// With the default lookahead, tokens sampled while a write is in flight come as one
// message: a client that falls behind gets fewer, fuller messages, and the same tokens,
// text and logprobs as one that reads every token (the greedy output is fixed).
// The same tokens, text, and logprobs to 1e-5, however they were split into messages.
void ExpectSameGeneration(const fwserve::GenerateResult& result,
                          const fwserve::GenerateResult& reference, const std::string& what) {
  EXPECT_EQ(result.token_ids, reference.token_ids) << what;
  EXPECT_EQ(result.text, reference.text) << what;
  ASSERT_EQ(result.logprobs.size(), reference.logprobs.size()) << what;
  for (size_t i = 0; i < result.logprobs.size(); ++i) {
    EXPECT_NEAR(result.logprobs[i], reference.logprobs[i], 1e-5) << what << ", token " << i;
  }
}

TEST_F(ServerTest, TokensDecodedDuringAWriteArriveTogetherAndAddUp) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  v1::GenerateRequest request = Greedy("Hello, world", 300);
  request.set_logprobs(true);
  int messages = 0, streamed_tokens = 0;
  std::vector<int> tokens_per_message;
  std::string streamed_text;
  auto result = server->client().Generate(request, [&](const v1::GenerateResponse& m) {
    ++messages;
    tokens_per_message.push_back(m.token_ids_size());
    streamed_tokens += m.token_ids_size();
    streamed_text += m.text();
    EXPECT_EQ(m.logprobs_size(), m.token_ids_size());
    EXPECT_EQ(fwserve::FirstInvalidUtf8Offset(m.text()), -1);
    if (messages == 2) absl::SleepFor(absl::Milliseconds(200));  // fall behind once
    return true;
  });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(streamed_tokens, 300);
  EXPECT_EQ(streamed_text, result->text);
  EXPECT_EQ(result->usage.generated_tokens(), 300);
  EXPECT_EQ(result->usage.session_tokens(), 312);
  // Every message but the last (finish_reason and usage only) carries 1 to
  // decode_lookahead tokens: so 300 / 16 rounded up, plus one, to 300 + 1 messages.
  const int lookahead = Options().engine.decode_lookahead;
  ASSERT_EQ(lookahead, 16);
  ASSERT_FALSE(tokens_per_message.empty());
  EXPECT_EQ(tokens_per_message.back(), 0);
  for (size_t i = 0; i + 1 < tokens_per_message.size(); ++i) {
    EXPECT_GE(tokens_per_message[i], 1) << "message " << i;
    EXPECT_LE(tokens_per_message[i], lookahead) << "message " << i;
  }
  EXPECT_GE(messages, (300 + lookahead - 1) / lookahead + 1);
  EXPECT_LE(messages, 301);

  fwserve::CoreOptions one_by_one = Options();
  one_by_one.engine.decode_lookahead = 1;
  auto reference_server = Harness::Start(one_by_one);
  ASSERT_NE(reference_server, nullptr);
  auto reference = reference_server->client().Generate(request);
  ASSERT_TRUE(reference.ok()) << reference.status();
  ExpectSameGeneration(*result, *reference, "");
}

// Voluntary context switches of each of this process's "fwserve-writerN" threads (each
// sleeps after a batch of writes), by thread id.
std::map<std::string, int64_t> WriterThreadSleepsByThread() {
  std::map<std::string, int64_t> sleeps;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    if (!std::getline(comm, name) || name.rfind("fwserve-writer", 0) != 0) continue;
    std::ifstream status(task.path() / "status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("voluntary_ctxt_switches:", 0) == 0) {
        sleeps[task.path().filename().string()] = std::stoll(line.substr(line.find(':') + 1));
      }
    }
  }
  return sleeps;
}

// Their sum, or -1 without one.
int64_t WriterThreadSleeps() {
  const std::map<std::string, int64_t> sleeps = WriterThreadSleepsByThread();
  if (sleeps.empty()) return -1;
  int64_t sum = 0;
  for (const auto& [thread, count] : sleeps) sum += count;
  return sum;
}

// With every message started on the writer thread (from the first stream on), the
// engine samples ahead while writes are out: messages may carry several tokens, and
// they add up to the tokens, text and logprobs of one message per token sent by the
// engine thread. Eight streams at once, so the writer thread serves several.
TEST_F(ServerTest, WritesOnTheWriterThreadCarryTheSameTokens) {
  fwserve::GrpcServerOptions writer_thread;
  writer_thread.writer_thread_from_streams = 1;
  auto server = Harness::Start(Options(), writer_thread);
  ASSERT_NE(server, nullptr);
  fwserve::CoreOptions one_by_one = Options();
  one_by_one.engine.decode_lookahead = 1;
  fwserve::GrpcServerOptions engine_writes;
  engine_writes.writer_thread_from_streams = 0;
  auto reference_server = Harness::Start(one_by_one, engine_writes);
  ASSERT_NE(reference_server, nullptr);

  const int64_t sleeps_before = WriterThreadSleeps();
  ASSERT_GE(sleeps_before, 0) << "no fwserve-writer thread";

  constexpr int kStreams = 8;
  std::vector<v1::GenerateRequest> requests;
  std::vector<absl::StatusOr<fwserve::GenerateResult>> results(kStreams);
  std::vector<int> streamed(kStreams, 0), messages(kStreams, 0);
  for (int i = 0; i < kStreams; ++i) {
    requests.push_back(Greedy(absl::StrCat("Stream ", i, ": "), 200));
    requests.back().set_logprobs(true);
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      results[i] = server->client().Generate(requests[i], [&, i](const v1::GenerateResponse& m) {
        ++messages[i];
        streamed[i] += m.token_ids_size();
        if (messages[i] == 2) absl::SleepFor(absl::Milliseconds(100));  // fall behind once
        return true;
      });
    });
  }
  for (auto& t : threads) t.join();
  // The writer thread did the writes: it woke (and went back to sleep) for them.
  EXPECT_GT(WriterThreadSleeps(), sleeps_before);
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_EQ(streamed[i], 200);
    EXPECT_EQ(results[i]->usage.generated_tokens(), 200);
    auto reference = reference_server->client().Generate(requests[i]);
    ASSERT_TRUE(reference.ok()) << reference.status();
    ExpectSameGeneration(*results[i], *reference, absl::StrCat("stream ", i));
  }
}

// --writer-threads 3: sixteen streams' sends spread over the three writer threads (each
// stream on one), and every stream gets the tokens, text and logprobs of one message
// per token sent by the engine thread.
TEST_F(ServerTest, WritesShardedOverWriterThreadsCarryTheSameTokens) {
  fwserve::GrpcServerOptions sharded;
  sharded.writer_thread_from_streams = 1;
  sharded.writer_threads = 3;
  auto server = Harness::Start(Options(), sharded);
  ASSERT_NE(server, nullptr);
  fwserve::CoreOptions one_by_one = Options();
  one_by_one.engine.decode_lookahead = 1;
  fwserve::GrpcServerOptions engine_writes;
  engine_writes.writer_thread_from_streams = 0;
  auto reference_server = Harness::Start(one_by_one, engine_writes);
  ASSERT_NE(reference_server, nullptr);
  const std::map<std::string, int64_t> before = WriterThreadSleepsByThread();
  ASSERT_EQ(before.size(), 3u) << "want 3 fwserve-writerN threads";

  constexpr int kStreams = 16;
  std::vector<v1::GenerateRequest> requests;
  std::vector<absl::StatusOr<fwserve::GenerateResult>> results(kStreams);
  for (int i = 0; i < kStreams; ++i) {
    requests.push_back(Greedy(absl::StrCat("Shard ", i, ": "), 60));
    requests.back().set_logprobs(true);
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] { results[i] = server->client().Generate(requests[i]); });
  }
  for (auto& t : threads) t.join();
  int used = 0;
  for (const auto& [thread, count] : WriterThreadSleepsByThread()) {
    if (before.count(thread) != 0 && count > before.at(thread)) ++used;
  }
  EXPECT_GE(used, 2) << "sixteen streams' writes ran on " << used << " of 3 writer threads";
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(results[i].ok()) << results[i].status();
    EXPECT_EQ(results[i]->usage.generated_tokens(), 60);
    auto reference = reference_server->client().Generate(requests[i]);
    ASSERT_TRUE(reference.ok()) << reference.status();
    ExpectSameGeneration(*results[i], *reference, absl::StrCat("stream ", i));
  }
}

// --stream-flush-interval holds a stream's tokens back until the message is full
// (--decode-lookahead tokens) or the stream ends: 40 tokens go out as 16 + 16 + 8, and
// they are the tokens an unbatched stream gets.
TEST_F(ServerTest, AFlushIntervalSendsFullMessages) {
  fwserve::CoreOptions options = Options();
  options.engine.stream_flush_interval = absl::Seconds(1);
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  v1::GenerateRequest request = Greedy("Hello, world", 40);
  std::vector<int> sizes;
  auto result = server->client().Generate(request, [&](const v1::GenerateResponse& m) {
    if (m.token_ids_size() > 0) sizes.push_back(m.token_ids_size());
    return true;
  });
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(sizes, (std::vector<int>{16, 16, 8}));
  EXPECT_EQ(result->usage.session_tokens(), 52);
  auto plain_server = Harness::Start(Options());
  ASSERT_NE(plain_server, nullptr);
  auto plain = plain_server->client().Generate(request);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(result->token_ids, plain->token_ids);
}

// A request's StreamOptions: min_tokens_per_message 6 sends 40 tokens in messages of at
// least 6 (at most --decode-lookahead, 16), the last one excepted, and they are the
// tokens a plain request gets. Out-of-range values are refused and name the field.
TEST_F(ServerTest, AMinimumOfTokensPerMessageIsHonoured) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  v1::GenerateRequest request = Greedy("Hello, world", 40);
  request.mutable_stream()->set_min_tokens_per_message(6);
  std::vector<int> sizes;
  auto result = server->client().Generate(request, [&](const v1::GenerateResponse& m) {
    if (m.token_ids_size() > 0) sizes.push_back(m.token_ids_size());
    return true;
  });
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_GE(sizes.size(), 2u);
  int total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    total += sizes[i];
    EXPECT_LE(sizes[i], 16) << "message " << i;
    if (i + 1 < sizes.size()) {
      EXPECT_GE(sizes[i], 6) << "message " << i;
    }
  }
  EXPECT_EQ(total, 40);
  auto plain = server->client().Generate(Greedy("Hello, world", 40));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(result->token_ids, plain->token_ids);
  for (auto [min_tokens, delay_ms, message] :
       {std::tuple{17, 0,
                   "stream.min_tokens_per_message must be in [0, 16] "
                   "(--decode-lookahead), got 17"},
        std::tuple{-1, 0, "stream.min_tokens_per_message must be in [0, 16]"},
        std::tuple{4, 60001, "stream.max_message_delay_ms must be in [0, 60000], got 60001"}}) {
    v1::GenerateRequest bad = Greedy("Hello", 4);
    bad.mutable_stream()->set_min_tokens_per_message(min_tokens);
    bad.mutable_stream()->set_max_message_delay_ms(delay_ms);
    auto refused = server->client().Generate(bad);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_NE(refused.status().message().find(message), std::string::npos) << refused.status();
  }
}

// --stream-min-tokens-per-message 16 (= --decode-lookahead), the server's token
// interval: 40 tokens go out as 16 + 16 + 8, the plain server's tokens. A request's own
// stream options replace it: min_tokens_per_message 8 sends exactly 8 at a time (a
// message waits for 8, and with 8 in flight no more than 8 more can be decoded). A value
// above --decode-lookahead is refused at start, naming the flag.
TEST_F(ServerTest, TheServersTokenIntervalGroupsMessages) {
  fwserve::CoreOptions options = Options();
  options.engine.stream_min_tokens_per_message = 16;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto sizes_of = [&](const v1::GenerateRequest& request, std::vector<int64_t>* tokens) {
    std::vector<int> sizes;
    auto result = server->client().Generate(request, [&](const v1::GenerateResponse& m) {
      if (m.token_ids_size() > 0) sizes.push_back(m.token_ids_size());
      return true;
    });
    EXPECT_TRUE(result.ok()) << result.status();
    if (result.ok()) *tokens = result->token_ids;
    return sizes;
  };
  std::vector<int64_t> grouped_tokens;
  EXPECT_EQ(sizes_of(Greedy("Hello, world", 40), &grouped_tokens), (std::vector<int>{16, 16, 8}));
  auto plain_server = Harness::Start(Options());
  ASSERT_NE(plain_server, nullptr);
  auto plain = plain_server->client().Generate(Greedy("Hello, world", 40));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(grouped_tokens, plain->token_ids);

  v1::GenerateRequest own = Greedy("Hello, world", 40);
  own.mutable_stream()->set_min_tokens_per_message(8);
  std::vector<int64_t> own_tokens;
  EXPECT_EQ(sizes_of(own, &own_tokens), (std::vector<int>{8, 8, 8, 8, 8}))
      << "the request's interval did not replace the server's";
  EXPECT_EQ(own_tokens, plain->token_ids);

  fwserve::CoreOptions bad = Options();
  bad.engine.stream_min_tokens_per_message = 17;
  auto refused = fwserve::Core::Create(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(
                "--stream-min-tokens-per-message must be in [0, 16] (--decode-lookahead), got 17"),
            std::string::npos)
      << refused.status();
}

// --decode-kernel libtorch (Model::Step on gathered rows, the LibTorch sequence form
// for prompts) still serves, with pipelining, and gives the native kernel's tokens'
// probabilities to float rounding: the same greedy continuation of 50 tokens (prefill
// and 49 decode steps), each token's logprob to 1e-4.
TEST_F(ServerTest, TheLibTorchDecodeKernelServesTheSameModel) {
  fwserve::CoreOptions options = Options();
  options.engine.decode_kernel = "libtorch";
  std::unique_ptr<Harness> libtorch_server, native_server;
  StartBesideTheDefault(options, &libtorch_server, &native_server);
}

// --native-gemm openblas (cblas_sgemm on every call, the baseline of the default
// libxsmm kernels) serves the same model: the same greedy continuation, logprobs to 1e-4.
TEST_F(ServerTest, TheOpenBlasGemmServesTheSameModel) {
  fwserve::CoreOptions options = Options();
  options.engine.native_gemm = "openblas";
  std::unique_ptr<Harness> openblas_server, default_server;
  StartBesideTheDefault(options, &openblas_server, &default_server);
}

// --decode-kernel graph (models/kernels/graphed_step.h: the CUDA path's bucketed step, eager on
// the CPU, and its batched sampler) serves the native kernel's model: the same greedy
// tokens with logprobs to 1e-4, and, for the same seeds, the same sampled tokens under
// temperature, top-k, top-p, min-p and a repetition penalty, on 5 concurrent streams
// (batches of several rows, padded to buckets), one of them on a session that then
// goes on for 10 more tokens.
TEST_F(ServerTest, TheGraphDecodeKernelServesTheSameModel) {
  fwserve::CoreOptions options = Options();
  options.engine.decode_kernel = "graph";
  std::unique_ptr<Harness> graph_server, native_server;
  StartBesideTheDefault(options, &graph_server, &native_server);
  if (HasFatalFailure()) return;
  auto sampled_on = [&](Harness& server, const std::string& session_id) {
    std::vector<v1::GenerateRequest> requests;
    for (int i = 0; i < 5; ++i) {
      v1::GenerateRequest r = Greedy(absl::StrCat("abc", i), 40, i == 0 ? session_id : "");
      r.mutable_sampling()->set_temperature(0.6f + 0.2f * static_cast<float>(i));
      r.mutable_sampling()->set_seed(100 + static_cast<uint64_t>(i));
      if (i % 2 == 0) r.mutable_sampling()->set_top_k(20);
      if (i >= 2) r.mutable_sampling()->set_top_p(0.9f);
      if (i == 3) r.mutable_sampling()->set_min_p(0.05f);
      if (i == 4) r.mutable_sampling()->set_repetition_penalty(1.3f);
      requests.push_back(r);
    }
    std::vector<std::vector<int64_t>> tokens;
    for (const fwserve::GenerateResult& r :
         GenerateAtOnceThenContinue(server, requests, session_id)) {
      tokens.push_back(r.token_ids);
    }
    return tokens;
  };
  auto graph_session = graph_server->client().CreateSession("", "");
  auto native_session = native_server->client().CreateSession("", "");
  ASSERT_TRUE(graph_session.ok() && native_session.ok());
  auto graph_tokens = sampled_on(*graph_server, graph_session->session_id());
  auto native_tokens = sampled_on(*native_server, native_session->session_id());
  ASSERT_EQ(graph_tokens.size(), 6u);
  for (size_t i = 0; i < graph_tokens.size(); ++i) {
    EXPECT_EQ(graph_tokens[i].size(), i < 5 ? 40u : 10u) << "stream " << i;
    EXPECT_EQ(graph_tokens[i], native_tokens[i]) << "stream " << i;
  }
  EXPECT_NE(graph_tokens[1], graph_tokens[3]);
}

// Constrained streams on the in-place graph step (eager on the CPU; issue 51): each draws
// under its mask inside the step, beside unconstrained streams, with multi-step decode
// on. The same tokens as the native kernel for the same seeds, and every document valid.
TEST_F(ServerTest, ConstrainedStreamsDrawInsideTheGraphStep) {
  fwserve::CoreOptions options = Options();
  options.engine.decode_kernel = "graph";
  options.engine.decode_steps_per_launch = 4;
  std::unique_ptr<Harness> graph_server, native_server;
  StartBesideTheDefault(options, &graph_server, &native_server);
  if (HasFatalFailure()) return;
  const std::string schema =
      R"({"type": "object", "properties": {"who": {"enum": ["ROMEO", "JULIET"]},
          "lines": {"type": "integer", "minimum": 1, "maximum": 99}},
          "required": ["who", "lines"], "additionalProperties": false})";
  auto run = [&](Harness& server) {
    std::vector<v1::GenerateRequest> requests;
    for (int i = 0; i < 5; ++i) {
      v1::GenerateRequest r = Greedy(absl::StrCat("ROMEO", i), 60);
      r.mutable_sampling()->set_temperature(0.7f + 0.2f * static_cast<float>(i));
      r.mutable_sampling()->set_seed(500 + static_cast<uint64_t>(i));
      if (i != 2) r.mutable_response_format()->set_json_schema(schema);
      requests.push_back(r);
    }
    return GenerateAtOnce(server, requests);
  };
  const std::vector<fwserve::GenerateResult> graph = run(*graph_server);
  const std::vector<fwserve::GenerateResult> native = run(*native_server);
  for (size_t i = 0; i < graph.size(); ++i) {
    EXPECT_EQ(graph[i].token_ids, native[i].token_ids) << "stream " << i;
    if (i == 2) continue;
    EXPECT_EQ(graph[i].finish_reason, v1::FINISH_REASON_STOP) << graph[i].text;
    const nlohmann::json doc = nlohmann::json::parse(graph[i].text, nullptr, false);
    ASSERT_TRUE(doc.is_object()) << graph[i].text;
    EXPECT_TRUE(doc.at("who") == "ROMEO" || doc.at("who") == "JULIET") << graph[i].text;
  }
}

// --decode-steps-per-launch 4 (multi-step decode on the in-place graph step, eager on
// the CPU): streams without a session draw up to 4 tokens per launch, fed back inside
// it. Against the native kernel drawing one per step: the same tokens for the same
// seeds on 4 concurrent throwaway streams (greedy; temperature with top-k, top-p,
// min-p), one of which ends on a stop string the host finds mid-launch, and on a
// session's stream (which draws ahead only behind a write in flight:
// MultiStepDecodeDrawsAheadOnASessionBehindASlowWrite), which then goes on for 10 more
// greedy tokens from exactly what it kept. A lone stream takes about a quarter of the
// launches.
TEST_F(ServerTest, MultiStepDecodeServesTheSameTokens) {
  fwserve::CoreOptions options = Options();
  options.engine.decode_kernel = "graph";
  options.engine.decode_steps_per_launch = 4;
  std::unique_ptr<Harness> multi_server, native_server;
  StartBesideTheDefault(options, &multi_server, &native_server);
  if (HasFatalFailure()) return;
  auto request = [](int i, const std::string& session_id) {
    v1::GenerateRequest r = Greedy(absl::StrCat("abc", i), 37, session_id);
    if (i > 0) {
      r.mutable_sampling()->set_temperature(0.6f + 0.2f * static_cast<float>(i));
      r.mutable_sampling()->set_seed(300 + static_cast<uint64_t>(i));
    }
    if (i == 1) r.mutable_sampling()->set_top_k(20);
    if (i == 2) r.mutable_sampling()->set_top_p(0.9f);
    if (i == 3) r.mutable_sampling()->set_min_p(0.05f);
    return r;
  };
  // Stream 2's stop string: an ASCII byte it draws after its fifth token.
  auto free_run = native_server->client().Generate(request(2, ""));
  ASSERT_TRUE(free_run.ok()) << free_run.status();
  std::string stop;
  for (size_t i = 5; i < free_run->token_ids.size() && stop.empty(); ++i) {
    const int64_t id = free_run->token_ids[i];
    if (id >= 'a' && id <= 'z') stop = std::string(1, static_cast<char>(id));
  }
  ASSERT_FALSE(stop.empty()) << "stream 2 drew no lower-case letter after its fifth token";
  auto served_on = [&](Harness& server, const std::string& session_id) {
    std::vector<v1::GenerateRequest> requests;
    for (int i = 0; i < 5; ++i) requests.push_back(request(i, i == 4 ? session_id : ""));
    requests[2].add_stop(stop);
    return GenerateAtOnceThenContinue(server, requests, session_id);
  };
  auto multi_session = multi_server->client().CreateSession("", "");
  auto native_session = native_server->client().CreateSession("", "");
  ASSERT_TRUE(multi_session.ok() && native_session.ok());
  auto multi = served_on(*multi_server, multi_session->session_id());
  auto native = served_on(*native_server, native_session->session_id());
  ASSERT_EQ(multi.size(), 6u);
  ASSERT_EQ(native.size(), 6u);
  for (size_t i = 0; i < multi.size(); ++i) {
    EXPECT_EQ(multi[i].token_ids, native[i].token_ids) << "stream " << i;
    EXPECT_EQ(multi[i].text, native[i].text) << "stream " << i;
    EXPECT_EQ(multi[i].finish_reason, native[i].finish_reason) << "stream " << i;
  }
  EXPECT_EQ(multi[0].token_ids.size(), 37u);
  EXPECT_EQ(multi[2].finish_reason, v1::FINISH_REASON_STOP);
  EXPECT_LT(multi[2].token_ids.size(), 37u);
  EXPECT_EQ(multi[5].token_ids.size(), 10u);
  // A lone throwaway stream of 37 tokens: the prefill gives the first, then 36 more take
  // 36 launches one at a time, 9 at four (more when a write holds the lookahead back).
  const uint64_t launches_before =
      HistogramCount(*multi_server, "fwserve_engine_step_duration_seconds");
  auto alone = multi_server->client().Generate(request(1, ""));
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ(alone->token_ids, multi[1].token_ids);
  const uint64_t launches =
      HistogramCount(*multi_server, "fwserve_engine_step_duration_seconds") - launches_before;
  EXPECT_LT(launches, 18u) << "multi-step decode drew about one token per launch";
  EXPECT_GE(launches, 9u);
}

// Multi-step decode on a session: a session stream draws ahead only while its write is
// in flight and its pending token already waits in the unsent chunk, so no rollback
// point falls inside a launch. A transport that confirms each message 30 ms late (an
// observer on the core) keeps it there: a 37-token greedy stream on a session then
// takes far fewer launches than tokens, and it and the 10 greedy tokens that continue
// the session equal the native kernel's, one token per step.
TEST_F(ServerTest, MultiStepDecodeDrawsAheadOnASessionBehindASlowWrite) {
  fwserve::CoreOptions options = Options();
  options.engine.decode_kernel = "graph";
  options.engine.decode_steps_per_launch = 4;
  std::unique_ptr<Harness> multi_server, native_server;
  StartBesideTheDefault(options, &multi_server, &native_server);
  if (HasFatalFailure()) return;

  // Confirms each message from a thread of its own, 30 ms after it came.
  class SlowWrites : public fwserve::GenerateObserver {
   public:
    void OnStart(std::shared_ptr<fwserve::GenerateControl> stream) override {
      control_ = std::move(stream);
    }
    void OnChunk(fwserve::GenerateChunk chunk) override {
      tokens_.insert(tokens_.end(), chunk.token_ids.begin(), chunk.token_ids.end());
      acks_.emplace_back([control = control_] {
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        control->WriteDone(true);
      });
    }
    void OnFinish(absl::Status status, fwserve::GenerateSummary) override {
      absl::MutexLock lock(&mu_);
      status_ = std::move(status);
      finished_ = true;
    }
    // The tokens and the final status, once the stream finished.
    std::pair<std::vector<int64_t>, absl::Status> Wait() {
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(&finished_));
      }
      for (std::thread& ack : acks_) ack.join();
      return {tokens_, status_};
    }

   private:
    std::shared_ptr<fwserve::GenerateControl> control_;
    std::vector<int64_t> tokens_;    // engine thread until OnFinish
    std::vector<std::thread> acks_;  // engine thread until OnFinish
    absl::Mutex mu_;
    bool finished_ ABSL_GUARDED_BY(mu_) = false;
    absl::Status status_ ABSL_GUARDED_BY(mu_);
  };

  struct Served {
    std::vector<int64_t> tokens, more;
    uint64_t launches = 0;
  };
  auto served_on = [&](Harness& server) {
    Served served;
    auto session = server.client().CreateSession("", "");
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return served;
    const uint64_t launches_before = HistogramCount(server, "fwserve_engine_step_duration_seconds");
    fwserve::GenerateParams params;
    params.session_id = session->session_id();
    params.prompt = "abc";
    params.max_tokens = 37;
    params.sampling.temperature = 0;
    SlowWrites observer;
    const absl::Status started = server.core().StartGenerate(fwserve::Caller{}, params, &observer);
    EXPECT_TRUE(started.ok()) << started;
    if (!started.ok()) return served;
    auto [tokens, status] = observer.Wait();
    EXPECT_TRUE(status.ok()) << status;
    served.tokens = tokens;
    served.launches =
        HistogramCount(server, "fwserve_engine_step_duration_seconds") - launches_before;
    auto more = server.client().Generate(Greedy("", 10, session->session_id()));
    EXPECT_TRUE(more.ok()) << more.status();
    if (more.ok()) served.more = more->token_ids;
    return served;
  };
  const Served multi = served_on(*multi_server);
  const Served native = served_on(*native_server);
  ASSERT_EQ(multi.tokens.size(), 37u);
  EXPECT_EQ(multi.tokens, native.tokens);
  EXPECT_EQ(multi.more.size(), 10u);
  EXPECT_EQ(multi.more, native.more) << "the session kept other tokens than it streamed";
  // One token per step would be 36 launches after the prefill's first token.
  EXPECT_GE(native.launches, 36u);
  EXPECT_LT(multi.launches, 24u) << "the session stream drew about one token per launch";
}

TEST_F(ServerTest, SameSeedSameOutputAndSeedsDiffer) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  auto sample = [&](uint64_t seed) {
    v1::GenerateRequest request = Greedy("abc", 50);
    request.mutable_sampling()->set_temperature(1.0f);
    request.mutable_sampling()->set_seed(seed);
    request.mutable_sampling()->set_top_k(50);
    auto result = server->client().Generate(request);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? result->token_ids : std::vector<int64_t>{};
  };
  EXPECT_EQ(sample(7), sample(7));
  EXPECT_NE(sample(7), sample(8));
}

TEST_F(ServerTest, StopStringEndsGenerationAndIsIncluded) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  auto free_run = server->client().Generate(Greedy("To be", 60));
  ASSERT_TRUE(free_run.ok());
  // The first ASCII byte generated after position 3 becomes the stop string.
  size_t stop_at = 0;
  for (size_t i = 3; i < free_run->token_ids.size(); ++i) {
    if (free_run->token_ids[i] > 0 && free_run->token_ids[i] < 128) {
      stop_at = i;
      break;
    }
  }
  ASSERT_GT(stop_at, 0u) << "the random model generated no ASCII byte";
  const std::string stop(1, static_cast<char>(free_run->token_ids[stop_at]));
  size_t first = 0;
  while (free_run->token_ids[first] != free_run->token_ids[stop_at]) ++first;

  v1::GenerateRequest request = Greedy("To be", 60);
  request.add_stop(stop);
  auto stopped = server->client().Generate(request);
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->finish_reason, v1::FINISH_REASON_STOP);
  EXPECT_EQ(stopped->token_ids, std::vector<int64_t>(free_run->token_ids.begin(),
                                                     free_run->token_ids.begin() + first + 1));

  // The stop string is in the session too (docs/serving.md): the session holds the
  // prompt and every token up to and including the stop, and goes on from there.
  ASSERT_LE(first + 6, free_run->token_ids.size());
  auto session = server->client().CreateSession("", "");
  ASSERT_TRUE(session.ok());
  v1::GenerateRequest on_session = Greedy("To be", 60, session->session_id());
  on_session.add_stop(stop);
  auto stopped_in_session = server->client().Generate(on_session);
  ASSERT_TRUE(stopped_in_session.ok());
  EXPECT_EQ(stopped_in_session->token_ids, stopped->token_ids);
  EXPECT_EQ(server->client().GetSession(session->session_id())->tokens(),
            static_cast<int64_t>(5 + first + 1));
  auto next = server->client().Generate(Greedy("", 5, session->session_id()));
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->token_ids, std::vector<int64_t>(free_run->token_ids.begin() + first + 1,
                                                  free_run->token_ids.begin() + first + 6));
}

// ----------------------------------------------------------------------------------
// Sessions.

TEST_F(ServerTest, OneRequestEqualsSeveralOnTheSameSession) {
  for (const char* arch : {"aft", "fast_weight", "linear_attention"}) {
    SCOPED_TRACE(arch);
    auto server = Harness::Start(Options(arch));
    ASSERT_NE(server, nullptr);
    auto whole = server->client().CreateSession("", "Once upon");
    auto split = server->client().CreateSession("", "Once upon");
    ASSERT_TRUE(whole.ok() && split.ok());
    auto all = server->client().Generate(Greedy(" a time", 30, whole->session_id()));
    ASSERT_TRUE(all.ok()) << all.status();
    std::vector<int64_t> pieces;
    for (int i = 0; i < 3; ++i) {
      auto part =
          server->client().Generate(Greedy(i == 0 ? " a time" : "", 10, split->session_id()));
      ASSERT_TRUE(part.ok()) << part.status();
      pieces.insert(pieces.end(), part->token_ids.begin(), part->token_ids.end());
    }
    EXPECT_EQ(all->token_ids, pieces);
    // The session holds exactly its history: prefix + prompt + generated.
    auto info = server->client().GetSession(split->session_id());
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->tokens(), 9 + 7 + 30);
    // And a throwaway request over the same text continues identically.
    auto throwaway = server->client().Generate(Greedy("Once upon a time", 30));
    ASSERT_TRUE(throwaway.ok());
    EXPECT_EQ(throwaway->token_ids, all->token_ids);
  }
}

TEST_F(ServerTest, SessionInfoListAndDelete) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  const int64_t before_ms = absl::ToUnixMillis(absl::Now());
  auto a = server->client().CreateSession("", "prefix");
  auto b = server->client().CreateSession("aft", "");
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(a->session_id().size(), 32u);
  EXPECT_NE(a->session_id(), b->session_id());
  EXPECT_EQ(a->model(), "aft");
  EXPECT_EQ(a->tokens(), 6);
  EXPECT_GT(a->state_bytes(), 0);
  EXPECT_GE(a->created_unix_ms(), before_ms);
  auto listed = server->client().ListAllSessions();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 2u);
  ASSERT_TRUE(server->client().DeleteSession(a->session_id()).ok());
  EXPECT_EQ(server->client().GetSession(a->session_id()).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(server->client().DeleteSession(a->session_id()).code(), StatusCode::kNotFound);
  EXPECT_EQ(server->client().ListAllSessions()->size(), 1u);
}

TEST_F(ServerTest, ForkIsIndependent) {
  auto server = Harness::Start(Options("fast_weight"));
  ASSERT_NE(server, nullptr);
  auto source = server->client().CreateSession("", "The king");
  ASSERT_TRUE(source.ok());
  auto fork = server->client().ForkSession(source->session_id());
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_NE(fork->session_id(), source->session_id());
  EXPECT_EQ(fork->tokens(), source->tokens());
  // Advancing the fork leaves the source as it was, and vice versa.
  auto on_fork = server->client().Generate(Greedy(" said", 25, fork->session_id()));
  ASSERT_TRUE(on_fork.ok());
  EXPECT_EQ(server->client().GetSession(source->session_id())->tokens(), 8);
  auto on_source = server->client().Generate(Greedy(" said", 25, source->session_id()));
  ASSERT_TRUE(on_source.ok());
  EXPECT_EQ(on_source->token_ids, on_fork->token_ids);
  EXPECT_EQ(server->client().GetSession(fork->session_id())->tokens(), 8 + 5 + 25);
}

TEST_F(ServerTest, ForkAndGenerateIsOneCallWithOneStoreWrite) {
  fwserve::CoreOptions options = Options("fast_weight");
  options.session_store = "dir:" + MakeTempDir("fork-generate");
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto source = server->client().CreateSession("", "The king");
  ASSERT_TRUE(source.ok()) << source.status();
  const std::string kWrites = "fwserve_session_store_write_duration_seconds";
  const uint64_t writes_before = HistogramCount(*server, kWrites);
  auto request = Greedy(" said", 25);
  request.set_fork_from(source->session_id());
  auto forked = server->client().Generate(request);
  ASSERT_TRUE(forked.ok()) << forked.status();
  // One write: the new session's, once the request is done; the source is not written.
  EXPECT_EQ(HistogramCount(*server, kWrites), writes_before + 1);
  ASSERT_EQ(forked->session_id.size(), 32u);
  EXPECT_NE(forked->session_id, source->session_id());
  EXPECT_EQ(forked->usage.session_tokens(), 8 + 5 + 25);
  EXPECT_EQ(server->client().GetSession(source->session_id())->tokens(), 8);
  auto fork = server->client().GetSession(forked->session_id);
  ASSERT_TRUE(fork.ok()) << fork.status();
  EXPECT_EQ(fork->tokens(), 8 + 5 + 25);
  // The same tokens as ForkSession then Generate on the fork.
  auto two_step = server->client().ForkSession(source->session_id());
  ASSERT_TRUE(two_step.ok());
  auto on_two_step = server->client().Generate(Greedy(" said", 25, two_step->session_id()));
  ASSERT_TRUE(on_two_step.ok());
  EXPECT_EQ(on_two_step->token_ids, forked->token_ids);
  // The new session continues like any other.
  auto next = server->client().Generate(Greedy(" and", 5, forked->session_id));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->usage.session_tokens(), 8 + 5 + 25 + 4 + 5);
}

TEST_F(ServerTest, ForkAndGenerateWithoutStoreKeepsNothing) {
  fwserve::CoreOptions options = Options();
  options.session_store = "dir:" + MakeTempDir("fork-nostore");
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto source = server->client().CreateSession("", "To be");
  ASSERT_TRUE(source.ok()) << source.status();
  const uint64_t writes_before =
      HistogramCount(*server, "fwserve_session_store_write_duration_seconds");
  auto request = Greedy(", or", 12);
  request.set_fork_from(source->session_id());
  request.set_store(false);
  auto once = server->client().Generate(request);
  ASSERT_TRUE(once.ok()) << once.status();
  EXPECT_EQ(once->token_ids.size(), 12u);
  EXPECT_TRUE(once->session_id.empty());  // no session to name
  EXPECT_EQ(HistogramCount(*server, "fwserve_session_store_write_duration_seconds"), writes_before);
  auto listed = server->client().ListAllSessions();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);  // the source alone
  EXPECT_EQ((*listed)[0].session_id(), source->session_id());
  EXPECT_EQ((*listed)[0].tokens(), 5);
  // The same continuation as a stored fork gives.
  request.set_store(true);
  auto stored = server->client().Generate(request);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->token_ids, once->token_ids);
}

// logit_bias through gRPC (issue 51): a +100 bias forces its token on a session's stream,
// the session holds what was streamed, and ids outside the vocabulary or values outside
// [-100, 100] are INVALID_ARGUMENT naming logit_bias.
TEST_F(ServerTest, LogitBiasForcesItsTokenAndBadEntriesAreRefused) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  auto session = server->client().CreateSession("", "To be");
  ASSERT_TRUE(session.ok()) << session.status();
  auto biased = Greedy(",", 6, session->session_id());
  biased.mutable_sampling()->set_temperature(0.9f);
  (*biased.mutable_sampling()->mutable_logit_bias())[120] = 100.0f;  // 'x'
  auto result = server->client().Generate(biased);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->text, "xxxxxx");
  auto after = server->client().GetSession(session->session_id());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->tokens(), 5 + 1 + 6);
  for (const auto& [id, value] : std::vector<std::pair<int64_t, float>>{{256, 1.0f}, {3, 100.5f}}) {
    auto bad = Greedy("y", 3);
    (*bad.mutable_sampling()->mutable_logit_bias())[id] = value;
    auto refused = server->client().Generate(bad);
    EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << id;
    EXPECT_NE(refused.status().message().find("logit_bias"), std::string::npos) << refused.status();
  }
}

// Structured output over gRPC: a session's constrained reply at temperature 1 is JSON
// of the schema, ends with FINISH_REASON_STOP as soon as it is whole, and the session
// holds exactly it; a keyword outside the subset is INVALID_ARGUMENT naming it; with
// top_logprobs each token carries its alternatives, the greedy one first.
// GenerateRequest.n (issue 51) through the client library: each choice streams under its
// index and ends on its own; the prompt is counted once; choice 0 is the n = 1 reply; a
// seed repeats them all; with a constraint every choice is a valid document; a session
// request is refused.
TEST_F(ServerTest, SeveralChoicesShareOnePrefillAndEndOnTheirOwn) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  auto request = Greedy("ROMEO:\nWhat light through yonder window breaks?\n", 9);
  request.mutable_sampling()->set_temperature(1.0f);
  request.mutable_sampling()->set_seed(11);
  request.set_logprobs(true);
  request.set_n(3);
  auto result = server->client().Generate(request);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->choices.size(), 3u);
  request.set_n(1);
  auto single = server->client().Generate(request);
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_EQ(result->usage.prompt_tokens(), single->usage.prompt_tokens());
  int64_t generated = 0;
  for (const auto& choice : result->choices) {
    EXPECT_EQ(choice.token_ids.size(), 9u);
    EXPECT_EQ(choice.logprobs.size(), 9u);
    EXPECT_EQ(choice.finish_reason, fwserve::v1::FINISH_REASON_LENGTH);
    generated += static_cast<int64_t>(choice.token_ids.size());
  }
  EXPECT_EQ(result->usage.generated_tokens(), generated);
  EXPECT_EQ(result->choices[0].token_ids, single->token_ids);
  EXPECT_EQ(result->text, result->choices[0].text);
  EXPECT_FALSE(result->choices[1].token_ids == result->choices[2].token_ids &&
               result->choices[0].token_ids == result->choices[1].token_ids);
  request.set_n(3);
  auto again = server->client().Generate(request);
  ASSERT_TRUE(again.ok()) << again.status();
  for (size_t i = 0; i < 3; ++i)
    EXPECT_EQ(again->choices[i].token_ids, result->choices[i].token_ids);
  // Greedy: every choice starts from choice 0's state and logits, so all are its reply.
  auto greedy = Greedy("ROMEO:\nWhat light through yonder window breaks?\n", 9);
  auto greedy_single = server->client().Generate(greedy);
  ASSERT_TRUE(greedy_single.ok()) << greedy_single.status();
  greedy.set_n(3);
  auto greedy_choices = server->client().Generate(greedy);
  ASSERT_TRUE(greedy_choices.ok()) << greedy_choices.status();
  for (const auto& choice : greedy_choices->choices) {
    EXPECT_EQ(choice.token_ids, greedy_single->token_ids);
  }
  greedy.set_max_tokens(0);
  EXPECT_EQ(server->client().Generate(greedy).status().code(), StatusCode::kInvalidArgument);

  // Each choice of a constrained request is a whole document, ending when it is.
  auto constrained = Greedy("ROMEO:", 120);
  constrained.mutable_sampling()->set_temperature(1.0f);
  constrained.mutable_sampling()->set_seed(2);
  constrained.set_n(4);
  constrained.mutable_response_format()->set_json_schema(
      R"({"type": "object", "properties": {"act": {"type": "integer", "minimum": 1,
          "maximum": 5}}, "required": ["act"], "additionalProperties": false})");
  auto documents = server->client().Generate(constrained);
  ASSERT_TRUE(documents.ok()) << documents.status();
  ASSERT_EQ(documents->choices.size(), 4u);
  for (const auto& choice : documents->choices) {
    EXPECT_EQ(choice.finish_reason, fwserve::v1::FINISH_REASON_STOP) << choice.text;
    const nlohmann::json doc = nlohmann::json::parse(choice.text, nullptr, false);
    ASSERT_TRUE(doc.is_object()) << choice.text;
    EXPECT_GE(doc.at("act").get<int>(), 1);
    EXPECT_LE(doc.at("act").get<int>(), 5);
  }

  auto session = server->client().CreateSession("", "ROMEO:");
  ASSERT_TRUE(session.ok()) << session.status();
  auto on_session = Greedy(" ", 3, session->session_id());
  on_session.set_n(2);
  auto refused = server->client().Generate(on_session);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("n:"), std::string::npos) << refused.status();
  on_session.set_session_id("");
  on_session.set_n(17);
  refused = server->client().Generate(on_session);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
}

TEST_F(ServerTest, AResponseFormatConstrainsTheReplyAndTopLogprobsComeWithIt) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  auto session = server->client().CreateSession("", "ROMEO:");
  ASSERT_TRUE(session.ok()) << session.status();
  const std::string schema =
      R"({"type": "object", "properties": {"who": {"type": "string", "maxLength": 6},
          "act": {"type": "integer", "minimum": 1, "maximum": 5},
          "mood": {"enum": ["merry", "sad"]}},
          "required": ["who", "act", "mood"], "additionalProperties": false})";
  auto request = Greedy(" ", 200, session->session_id());
  request.mutable_sampling()->set_temperature(1.0f);
  request.mutable_sampling()->set_seed(5);
  request.mutable_response_format()->set_json_schema(schema);
  auto result = server->client().Generate(request);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->finish_reason, fwserve::v1::FINISH_REASON_STOP) << result->text;
  const nlohmann::json reply = nlohmann::json::parse(result->text, nullptr, false);
  ASSERT_TRUE(reply.is_object()) << result->text;
  const std::string who = reply.at("who").get<std::string>();
  // maxLength counts code points: UTF-8 bytes that do not continue a character.
  EXPECT_LE(std::count_if(who.begin(), who.end(),
                          [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }),
            6)
      << result->text;
  EXPECT_GE(reply.at("act").get<int>(), 1);
  EXPECT_LE(reply.at("act").get<int>(), 5);
  EXPECT_TRUE(reply.at("mood") == "merry" || reply.at("mood") == "sad") << result->text;
  auto after = server->client().GetSession(session->session_id());
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->tokens(), 6 + 1 + static_cast<int64_t>(result->token_ids.size()));

  auto bad = Greedy("y", 3);
  bad.mutable_response_format()->set_json_schema(R"({"type": "string", "not": {}})");
  auto refused = server->client().Generate(bad);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("'not'"), std::string::npos) << refused.status();
  bad.mutable_response_format()->set_json_schema("{not json");
  refused = server->client().Generate(bad);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("response_format"), std::string::npos);

  auto top = Greedy("To be", 5);
  top.set_logprobs(true);
  top.set_top_logprobs(4);
  auto listed = server->client().Generate(top);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->top_logprobs.size(), listed->token_ids.size());
  for (size_t i = 0; i < listed->token_ids.size(); ++i) {
    const auto& alternatives = listed->top_logprobs[i].alternatives();
    ASSERT_EQ(alternatives.size(), 4);
    EXPECT_EQ(alternatives[0].token_id(), listed->token_ids[i]);  // greedy
    EXPECT_NEAR(alternatives[0].logprob(), listed->logprobs[i], 1e-6);
    EXPECT_EQ(alternatives[0].bytes(), std::string(1, static_cast<char>(listed->token_ids[i])));
  }
}

TEST_F(ServerTest, ForkAndGenerateRefusesBadCombinations) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  auto source = server->client().CreateSession("", "x");
  ASSERT_TRUE(source.ok());
  auto both = Greedy("y", 3, source->session_id());
  both.set_fork_from(source->session_id());
  auto refused = server->client().Generate(both);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("fork_from"), std::string::npos) << refused.status();
  auto unstored = Greedy("y", 3, source->session_id());
  unstored.set_store(false);
  refused = server->client().Generate(unstored);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("store"), std::string::npos) << refused.status();
  auto malformed = Greedy("y", 3);
  malformed.set_fork_from("not-a-session");
  refused = server->client().Generate(malformed);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("fork_from 'not-a-session'"), std::string::npos);
  auto unknown = Greedy("y", 3);
  unknown.set_fork_from(std::string(32, 'a'));
  refused = server->client().Generate(unknown);
  EXPECT_EQ(refused.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(refused.status().message(), "fork_from '" + std::string(32, 'a') + "' not found");
  // Nothing was created by the refusals.
  EXPECT_EQ(server->client().ListAllSessions()->size(), 1u);
}

TEST_F(ServerTest, ExportImportRoundTripAndIntoARestartedServer) {
  std::string blob;
  std::vector<int64_t> expected;
  {
    auto server = Harness::Start(Options());
    ASSERT_NE(server, nullptr);
    auto session = server->client().CreateSession("", "Exported state");
    ASSERT_TRUE(session.ok());
    auto exported = server->client().ExportSession(session->session_id());
    ASSERT_TRUE(exported.ok()) << exported.status();
    EXPECT_EQ(exported->tokens(), 14);
    EXPECT_EQ(exported->model(), "aft");
    blob = exported->blob();
    auto imported = server->client().ImportSession(blob);
    ASSERT_TRUE(imported.ok()) << imported.status();
    EXPECT_EQ(imported->tokens(), 14);
    auto a = server->client().Generate(Greedy("!", 20, session->session_id()));
    auto b = server->client().Generate(Greedy("!", 20, imported->session_id()));
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->token_ids, b->token_ids);
    expected = a->token_ids;
  }
  // A new server process-equivalent (fresh core, same checkpoint) accepts the blob.
  auto restarted = Harness::Start(Options());
  ASSERT_NE(restarted, nullptr);
  auto imported = restarted->client().ImportSession(blob, "aft");
  ASSERT_TRUE(imported.ok()) << imported.status();
  auto c = restarted->client().Generate(Greedy("!", 20, imported->session_id()));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->token_ids, expected);
}

TEST_F(ServerTest, ImportRejectsOtherModelsTruncatedAndAlteredBlobsAndChangesNothing) {
  fwserve::CoreOptions options = Options();
  options.model_dirs.push_back(ModelDir("fast_weight"));
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto session = server->client().CreateSession("aft", "some text");
  ASSERT_TRUE(session.ok());
  auto exported = server->client().ExportSession(session->session_id());
  ASSERT_TRUE(exported.ok());
  const std::string blob = exported->blob();
  std::string altered = blob;
  altered[altered.size() - 10] ^= 0x01;
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"fast_weight", blob},                     // another model
      {"aft", blob.substr(0, blob.size() / 2)},  // truncated
      {"aft", altered},                          // altered data
      {"aft", "not a blob at all"},              // garbage
  };
  for (const auto& [model, bytes] : bad) {
    auto imported = server->client().ImportSession(bytes, model);
    EXPECT_EQ(imported.status().code(), StatusCode::kInvalidArgument)
        << model << " " << imported.status();
  }
  EXPECT_EQ(server->client().ListAllSessions()->size(), 1u);
}

// A Generate cancelled after 20 tokens leaves exactly a prefix of the greedy run in its
// session, whichever thread starts the writes.
void ServerTest::ExpectCancellationMidStreamKeepsAStreamedPrefix(
    fwserve::GrpcServerOptions server_options) {
  // The stream cannot finish before the cancel. The gate holds the engine thread, so
  // tokens sampled while a write was in flight (at most decode_lookahead = 16) are not
  // sent until it opens: 20 + 16 + 4 free steps make sure 20 tokens reach the client.
  StepGate gate(/*free_steps=*/40);
  fwserve::CoreOptions options = Options();
  gate.Install(options);
  auto server = Harness::Start(options, server_options);
  ASSERT_NE(server, nullptr);
  auto session = server->client().CreateSession("", "");
  ASSERT_TRUE(session.ok());
  std::unique_ptr<fwserve::GenerateStream> stream =
      server->client().StartGenerate(Greedy("Cancel me", 1500, session->session_id()));
  v1::GenerateResponse message;
  int received = 0;
  while (received < 20 && stream->Next(&message)) received += message.token_ids_size();
  stream->Cancel();
  gate.Open();
  while (stream->Next(&message)) received += message.token_ids_size();
  EXPECT_EQ(stream->Finish().code(), StatusCode::kCancelled);

  // The server must have let go of the session; its state holds the prompt and the
  // first g greedy tokens, for some g >= what this client read.
  absl::StatusOr<v1::SessionInfo> info;
  for (int i = 0; i < 100; ++i) {
    auto next = server->client().Generate(Greedy("", 0, session->session_id()));
    if (next.status().code() != StatusCode::kAborted) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  info = server->client().GetSession(session->session_id());
  ASSERT_TRUE(info.ok());
  const int64_t g = info->tokens() - 9;
  EXPECT_GE(g, received);
  EXPECT_LT(g, 1500);
  // Continuing from the cancelled session equals an uninterrupted run of g + 15 tokens.
  auto continued = server->client().Generate(Greedy("", 15, session->session_id()));
  ASSERT_TRUE(continued.ok()) << continued.status();
  auto reference = server->client().Generate(Greedy("Cancel me", static_cast<int>(g) + 15));
  ASSERT_TRUE(reference.ok());
  EXPECT_EQ(continued->token_ids,
            std::vector<int64_t>(reference->token_ids.end() - 15, reference->token_ids.end()));
}

TEST_F(ServerTest, CancellationMidStreamLeavesExactlyTheStreamedTokens) {
  fwserve::GrpcServerOptions engine_writes;
  engine_writes.writer_thread_from_streams = 0;
  ExpectCancellationMidStreamKeepsAStreamedPrefix(engine_writes);
}

TEST_F(ServerTest, CancellationMidStreamWithWritesOnTheWriterThread) {
  fwserve::GrpcServerOptions writer_thread;
  writer_thread.writer_thread_from_streams = 1;
  ExpectCancellationMidStreamKeepsAStreamedPrefix(writer_thread);
}

TEST_F(ServerTest, CancelBeforeTheFirstTokenChangesNothing) {
  fwserve::CoreOptions options = Options();
  options.engine.scheduler.prefill_chunk_tokens =
      4;  // a long prefill, so the cancel lands inside it
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto session = server->client().CreateSession("", "kept");
  ASSERT_TRUE(session.ok());
  v1::GenerateRequest request = Greedy(std::string(100000, 'x'), 5, session->session_id());
  std::unique_ptr<fwserve::GenerateStream> stream = server->client().StartGenerate(request);
  // The server has the request (it holds the session's lease) before the cancel, so the
  // cancel reaches a running request, not one the server never saw.
  ASSERT_TRUE(WaitUntilBusy(server->client(), session->session_id()))
      << "the request never reached the server";
  stream->Cancel();
  v1::GenerateResponse message;
  int received = 0;
  while (stream->Next(&message)) received += message.token_ids_size();
  const absl::Status status = stream->Finish();
  // 100,000 prompt bytes in chunks of 4 (25,000 prefill chunks, most of a second here)
  // are not prefilled between the lease and the cancel (one 5 ms poll), so no token was
  // streamed.
  EXPECT_EQ(received, 0);
  EXPECT_EQ(status.code(), StatusCode::kCancelled) << status;
  absl::StatusOr<v1::SessionInfo> info;
  bool released = false;
  for (int i = 0; i < 500 && !released; ++i) {
    info = server->client().GetSession(session->session_id());
    ASSERT_TRUE(info.ok());
    released = !info->busy();
    if (!released) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(released) << "the cancelled request never released the session";
  EXPECT_EQ(info->tokens(), 4);
}

TEST_F(ServerTest, AGenerateCancelledWhileQueuedNeverRuns) {
  fwserve::CoreOptions options = Options();
  options.engine.scheduler.max_active_streams = 1;
  options.max_tokens = 1000000;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto session = server->client().CreateSession("", "queued");
  ASSERT_TRUE(session.ok());
  auto active = server->client().StartGenerate(Greedy("a", 1000000));
  v1::GenerateResponse message;
  ASSERT_TRUE(active->Next(&message));
  auto queued =
      server->client().StartGenerate(Greedy(std::string(100000, 'q'), 5, session->session_id()));
  ASSERT_TRUE(WaitUntilBusy(server->client(), session->session_id()))
      << "the second request never reached the server";
  queued->Cancel();
  while (queued->Next(&message)) {
  }
  EXPECT_EQ(queued->Finish().code(), StatusCode::kCancelled);
  active->Cancel();
  while (active->Next(&message)) {
  }
  // The queued request is dropped when it is admitted: the session is released unchanged.
  absl::StatusOr<v1::SessionInfo> info;
  for (int i = 0; i < 400; ++i) {
    info = server->client().GetSession(session->session_id());
    if (info.ok() && !info->busy()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->busy());
  EXPECT_EQ(info->tokens(), 6);
}

TEST_F(ServerTest, ACreateSessionWhoseCallerIsGoneLeavesNoSession) {
  // A stream holds the engine, so the CreateSession waits in its queue until the
  // caller's deadline has passed, however fast the machine.
  StepGate gate(/*free_steps=*/1);
  fwserve::CoreOptions options = Options();
  gate.Install(options);
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto holder = server->client().StartGenerate(Greedy("hold", 2000));
  v1::GenerateResponse message;
  ASSERT_TRUE(holder->Next(&message));
  ASSERT_TRUE(gate.WaitHeld());
  fwserve::ClientOptions client_options;
  client_options.target = server->target();
  // Only the time the call has to reach the server: it cannot be answered before the
  // gate opens.
  client_options.deadline = absl::Seconds(2);
  auto impatient = fwserve::Client::Connect(client_options);
  ASSERT_TRUE(impatient.ok());
  auto created = (*impatient)->CreateSession("", std::string(500000, 'p'));
  EXPECT_EQ(created.status().code(), StatusCode::kDeadlineExceeded);
  holder->Cancel();
  gate.Open();
  while (holder->Next(&message)) {
  }
  // The server took the call (it finished one CreateSession, for a caller that was gone)
  // and left no session behind.
  EXPECT_TRUE(Eventually([&] {
    return FinishedRequests(server->metrics(), "CreateSession", "CANCELLED") == 1;
  })) << "the CreateSession never reached the server, or did not see its caller gone";
  EXPECT_TRUE(server->client().ListAllSessions()->empty());
}

TEST_F(ServerTest, ASecondRequestOnABusySessionIsAbortedAndStateIsIntact) {
  StepGate gate(/*free_steps=*/1);  // the stream runs until the five calls are answered
  fwserve::CoreOptions options = Options();
  gate.Install(options);
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto session = server->client().CreateSession("", "busy");
  ASSERT_TRUE(session.ok());
  std::unique_ptr<fwserve::GenerateStream> stream =
      server->client().StartGenerate(Greedy("", 1500, session->session_id()));
  v1::GenerateResponse message;
  ASSERT_TRUE(stream->Next(&message));
  EXPECT_EQ(server->client().Generate(Greedy("x", 5, session->session_id())).status().code(),
            StatusCode::kAborted);
  EXPECT_EQ(server->client().ForkSession(session->session_id()).status().code(),
            StatusCode::kAborted);
  EXPECT_EQ(server->client().ExportSession(session->session_id()).status().code(),
            StatusCode::kAborted);
  EXPECT_EQ(server->client().DeleteSession(session->session_id()).code(), StatusCode::kAborted);
  v1::ScoreRequest score;
  score.set_session_id(session->session_id());
  score.set_text("abc");
  EXPECT_EQ(server->client().Score(score).status().code(), StatusCode::kAborted);
  gate.Open();
  int received = message.token_ids_size();
  while (stream->Next(&message)) received += message.token_ids_size();
  ASSERT_TRUE(stream->Finish().ok());
  EXPECT_EQ(received, 1500);
  EXPECT_EQ(server->client().GetSession(session->session_id())->tokens(), 4 + 1500);
}

TEST_F(ServerTest, ManyConcurrentStreamsAllComplete) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  auto reference = server->client().Generate(Greedy("same prompt", 30));
  ASSERT_TRUE(reference.ok());
  std::vector<std::thread> threads;
  std::atomic<int> matching{0};
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&] {
      auto result = server->client().Generate(Greedy("same prompt", 30));
      if (result.ok() && result->token_ids == reference->token_ids) ++matching;
    });
  }
  for (auto& t : threads) t.join();
  // Batched decoding gives every stream the same tokens as decoding it alone.
  EXPECT_EQ(matching.load(), 16);
}

TEST_F(ServerTest, ConcurrentStreamsShareDecodeSteps) {
  fwserve::CoreOptions options = Options();
  options.max_tokens = 1000000;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  // Eight streams that cannot finish (a million tokens each) are all running once
  // each has sent a token; from then on every decode step may batch them.
  std::vector<std::unique_ptr<fwserve::GenerateStream>> streams;
  v1::GenerateResponse message;
  for (int i = 0; i < 8; ++i) {
    streams.push_back(server->client().StartGenerate(Greedy("batch me", 1000000)));
  }
  for (auto& stream : streams) ASSERT_TRUE(stream->Next(&message));
  for (int i = 0; i < 20; ++i) {
    for (auto& stream : streams) ASSERT_TRUE(stream->Next(&message));
  }
  for (auto& stream : streams) {
    stream->Cancel();
    while (stream->Next(&message)) {
    }
    EXPECT_EQ(stream->Finish().code(), StatusCode::kCancelled);
  }
  // Steps that held more than one stream: all steps minus those in the "le=1" bucket.
  double steps = 0, single = 0;
  for (const auto& family : server->metrics().registry()->Collect()) {
    if (family.name != "fwserve_engine_batch_size") continue;
    for (const auto& metric : family.metric) {
      steps += static_cast<double>(metric.histogram.sample_count);
      for (const auto& bucket : metric.histogram.bucket) {
        if (bucket.upper_bound == 1) single += static_cast<double>(bucket.cumulative_count);
      }
    }
  }
  // Each stream's first token is sampled from its prefill's logits, so its 21 tokens
  // took at least 20 decode steps.
  EXPECT_GE(steps, 20);
  EXPECT_GT(steps - single, 0) << "no decode step batched two streams";
}

// ----------------------------------------------------------------------------------
// Listing sessions page by page.

// Every page of ListSessions(model, page_size), in order; fails the test on an error.
std::vector<std::vector<v1::SessionInfo>> AllPages(fwserve::Client& client,
                                                   const std::string& model, int32_t page_size) {
  std::vector<std::vector<v1::SessionInfo>> pages;
  std::string token;
  do {
    auto page = client.ListSessions(model, page_size, token);
    EXPECT_TRUE(page.ok()) << page.status();
    if (!page.ok() || pages.size() > 1000) break;
    pages.emplace_back(page->sessions().begin(), page->sessions().end());
    token = page->next_page_token();
  } while (!token.empty());
  return pages;
}

std::vector<std::string> IdsOf(const std::vector<std::vector<v1::SessionInfo>>& pages) {
  std::vector<std::string> ids;
  for (const auto& page : pages) {
    for (const v1::SessionInfo& info : page) ids.push_back(info.session_id());
  }
  return ids;
}

TEST_F(ServerTest, ListSessionsPagesListEverySessionOnceOldestFirst) {
  fwserve::FakeClock clock;
  fwserve::CoreOptions options = Options();
  options.model_dirs.push_back(ModelDir("fast_weight"));
  options.clock = &clock;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  // 30 aft and 10 fast_weight sessions, created in groups of 4 at the same instant: the
  // order is by creation time, then by id, and page boundaries fall inside groups.
  struct Created {
    int64_t group;
    std::string id;
    std::string model;
  };
  std::vector<Created> created;
  for (int i = 0; i < 40; ++i) {
    if (i % 4 == 0) clock.Advance(absl::Milliseconds(1));
    const std::string model = i % 4 == 1 ? "fast_weight" : "aft";
    auto session = client.CreateSession(model, "");
    ASSERT_TRUE(session.ok()) << session.status();
    created.push_back({i / 4, session->session_id(), model});
  }
  std::sort(created.begin(), created.end(), [](const Created& a, const Created& b) {
    return std::tie(a.group, a.id) < std::tie(b.group, b.id);
  });
  const auto expected = [&](const std::string& model) {
    std::vector<std::string> ids;
    for (const Created& c : created) {
      if (model.empty() || c.model == model) ids.push_back(c.id);
    }
    return ids;
  };

  for (const auto& [model, page_size] : std::vector<std::pair<std::string, int32_t>>{
           {"", 7}, {"aft", 7}, {"fast_weight", 3}, {"", 1}, {"", 40}, {"", 0}}) {
    SCOPED_TRACE(absl::StrCat("model '", model, "', page_size ", page_size));
    const auto pages = AllPages(client, model, page_size);
    const std::vector<std::string> want = expected(model);
    // Full pages, then the rest: no session twice, none left out, oldest first.
    EXPECT_EQ(IdsOf(pages), want);
    const size_t per_page = page_size == 0 ? 100 : static_cast<size_t>(page_size);
    ASSERT_FALSE(pages.empty());
    EXPECT_EQ(pages.size(), std::max<size_t>(1, (want.size() + per_page - 1) / per_page));
    for (size_t i = 0; i + 1 < pages.size(); ++i) EXPECT_EQ(pages[i].size(), per_page);
    for (const auto& page : pages) {
      for (size_t i = 1; i < page.size(); ++i) {
        EXPECT_LE(page[i - 1].created_unix_ms(), page[i].created_unix_ms());
      }
    }
  }
  // Without pages: everything at once (40 < the default 100), and the last page says so.
  auto everything = client.ListSessions();
  ASSERT_TRUE(everything.ok()) << everything.status();
  EXPECT_EQ(everything->sessions_size(), 40);
  EXPECT_TRUE(everything->next_page_token().empty());
  auto all = client.ListAllSessions();
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), 40u);
  EXPECT_EQ(client.ListSessions("no-such-model", 7).status().code(), StatusCode::kNotFound);
}

TEST_F(ServerTest, SessionsDeletedOrCreatedBetweenPagesDoNotDisturbTheOthers) {
  fwserve::FakeClock clock;
  fwserve::CoreOptions options = Options();
  options.clock = &clock;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  std::vector<std::string> ids;  // oldest first
  for (int i = 0; i < 20; ++i) {
    clock.Advance(absl::Milliseconds(1));
    auto session = client.CreateSession("", "");
    ASSERT_TRUE(session.ok()) << session.status();
    ids.push_back(session->session_id());
  }
  auto first = client.ListSessions("", 6);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(first->sessions_size(), 6);
  ASSERT_FALSE(first->next_page_token().empty());
  // The last session listed (where the next page starts from) and one not listed yet go;
  // a new one comes.
  ASSERT_TRUE(client.DeleteSession(ids[5]).ok());
  ASSERT_TRUE(client.DeleteSession(ids[8]).ok());
  clock.Advance(absl::Milliseconds(1));
  auto newer = client.CreateSession("", "");
  ASSERT_TRUE(newer.ok()) << newer.status();
  std::vector<std::string> rest;
  std::string token = first->next_page_token();
  while (!token.empty() && rest.size() < 100) {
    auto page = client.ListSessions("", 6, token);
    ASSERT_TRUE(page.ok()) << page.status();
    for (const v1::SessionInfo& info : page->sessions()) rest.push_back(info.session_id());
    token = page->next_page_token();
  }
  // Every session that existed throughout comes exactly once, in order: none is skipped
  // or repeated because the listing changed under the pages.
  std::vector<std::string> want(ids.begin() + 6, ids.end());
  want.erase(std::find(want.begin(), want.end(), ids[8]));
  std::vector<std::string> without_newer = rest;
  without_newer.erase(std::remove(without_newer.begin(), without_newer.end(), newer->session_id()),
                      without_newer.end());
  EXPECT_EQ(without_newer, want);
  EXPECT_LE(rest.size(), want.size() + 1);
}

TEST_F(ServerTest, ListSessionsPageSizeDefaultsTo100AndIsCappedAt1000) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  constexpr int kSessions = 1010;
  std::atomic<int> failures{0};
  std::vector<std::thread> creators;
  for (int t = 0; t < 4; ++t) {
    creators.emplace_back([&, t] {
      for (int i = t; i < kSessions; i += 4) {
        if (!server->client().CreateSession("", "").ok()) failures.fetch_add(1);
      }
    });
  }
  for (std::thread& thread : creators) thread.join();
  ASSERT_EQ(failures.load(), 0);
  fwserve::Client& client = server->client();

  auto by_default = client.ListSessions();
  ASSERT_TRUE(by_default.ok()) << by_default.status();
  EXPECT_EQ(by_default->sessions_size(), 100);
  EXPECT_FALSE(by_default->next_page_token().empty());

  auto capped = client.ListSessions("", 5000);
  ASSERT_TRUE(capped.ok()) << capped.status();
  EXPECT_EQ(capped->sessions_size(), 1000);
  ASSERT_FALSE(capped->next_page_token().empty());
  auto rest = client.ListSessions("", 5000, capped->next_page_token());
  ASSERT_TRUE(rest.ok()) << rest.status();
  EXPECT_EQ(rest->sessions_size(), kSessions - 1000);
  EXPECT_TRUE(rest->next_page_token().empty());

  auto all = client.ListAllSessions();
  ASSERT_TRUE(all.ok()) << all.status();
  std::set<std::string> unique;
  for (const v1::SessionInfo& info : *all) unique.insert(info.session_id());
  EXPECT_EQ(all->size(), static_cast<size_t>(kSessions));
  EXPECT_EQ(unique.size(), static_cast<size_t>(kSessions));
}

TEST_F(ServerTest, BadPageSizeAndPageTokenAreInvalidArgument) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(client.CreateSession("", "").ok());
  auto negative = client.ListSessions("", -1);
  EXPECT_EQ(negative.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(negative.status().message().find("page_size"), std::string::npos) << negative.status();
  EXPECT_NE(negative.status().message().find("-1"), std::string::npos) << negative.status();
  for (const std::string& token :
       {std::string("garbage"), std::string("\xc3\xa9t\xc3\xa9"), std::string(5000, 'A')}) {
    auto malformed = client.ListSessions("", 2, token);
    EXPECT_EQ(malformed.status().code(), StatusCode::kInvalidArgument) << malformed.status();
    EXPECT_NE(malformed.status().message().find("page_token"), std::string::npos)
        << malformed.status();
  }
}

// ----------------------------------------------------------------------------------
// Client channels: resolver targets and load balancing.

TEST_F(ServerTest, ClientReachesTheServerThroughResolverTargetsAndPolicies) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  const std::string port = std::to_string(server->port());
  for (const auto& [target, policy] :
       std::vector<std::pair<std::string, std::string>>{{"dns:///127.0.0.1:" + port, "round_robin"},
                                                        {"dns:///localhost:" + port, "round_robin"},
                                                        {"dns:///localhost:" + port, "pick_first"},
                                                        {"ipv4:127.0.0.1:" + port, "round_robin"},
                                                        {"127.0.0.1:" + port, ""}}) {
    SCOPED_TRACE(target + " " + policy);
    fwserve::ClientOptions options;
    options.target = target;
    options.load_balancing_policy = policy;
    options.deadline = absl::Seconds(10);
    auto client = fwserve::Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    auto session = (*client)->CreateSession("", "hi");
    ASSERT_TRUE(session.ok()) << session.status();
    EXPECT_EQ((*client)->GetSession(session->session_id())->tokens(), 2);
    auto page = (*client)->ListSessions("", 1000);
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_EQ(page->sessions(page->sessions_size() - 1).session_id(), session->session_id());
  }
  fwserve::ClientOptions bad;
  bad.load_balancing_policy = "random";
  auto refused = fwserve::Client::Connect(bad);
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("load_balancing_policy"), std::string::npos);
}

TEST_F(ServerTest, RoundRobinSpreadsCallsOverEveryAddress) {
  auto one = Harness::Start(Options());
  auto two = Harness::Start(Options());
  ASSERT_NE(one, nullptr);
  ASSERT_NE(two, nullptr);
  const std::string addresses =
      absl::StrCat("ipv4:127.0.0.1:", one->port(), ",127.0.0.1:", two->port());
  const auto sessions_on = [](Harness& server) {
    auto listed = server.client().ListAllSessions();
    return listed.ok() ? listed->size() : size_t{0};
  };
  {
    // pick_first: every call goes to the one server it connected to.
    fwserve::ClientOptions options;
    options.target = addresses;
    options.load_balancing_policy = "pick_first";
    auto client = fwserve::Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    for (int i = 0; i < 10; ++i) ASSERT_TRUE((*client)->CreateSession("", "").ok());
    EXPECT_EQ(sessions_on(*one) + sessions_on(*two), 10u);
    EXPECT_TRUE(sessions_on(*one) == 0 || sessions_on(*two) == 0);
  }
  const size_t before_one = sessions_on(*one);
  const size_t before_two = sessions_on(*two);
  fwserve::ClientOptions options;
  options.target = addresses;
  options.load_balancing_policy = "round_robin";
  auto client = fwserve::Client::Connect(options);
  ASSERT_TRUE(client.ok()) << client.status();
  // round_robin uses the addresses whose connection is up, so the first calls may all go
  // to one; within a few both are up and calls alternate.
  bool both = false;
  for (int i = 0; i < 200 && !both; ++i) {
    ASSERT_TRUE((*client)->CreateSession("", "").ok());
    both = sessions_on(*one) > before_one && sessions_on(*two) > before_two;
    if (!both) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(both) << "every round_robin call went to the same server";
}

// ----------------------------------------------------------------------------------
// Scoring.

TEST_F(ServerTest, ScoreMatchesTheModelLibraryAndLeavesSessionsUnchanged) {
  auto server = Harness::Start(Options("linear_attention"));
  ASSERT_NE(server, nullptr);
  v1::ScoreRequest request;
  request.set_text("To be, or not to be");
  auto fresh = server->client().Score(request);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  std::vector<double> reference = ReferenceScore(ModelDir("linear_attention"), request.text());
  ASSERT_EQ(fresh->logprobs_size(), 18);
  ASSERT_EQ(reference.size(), 18u);
  for (int i = 0; i < 18; ++i) EXPECT_NEAR(fresh->logprobs(i), reference[i], 1e-4);
  EXPECT_GT(fresh->perplexity(), 1.0);

  // Conditioned on a session holding "To be, " the rest scores like the tail of the
  // whole text, one value per token, and the session does not move.
  auto session = server->client().CreateSession("", "To be, ");
  ASSERT_TRUE(session.ok());
  request.set_session_id(session->session_id());
  request.set_text("or not to be");
  auto conditioned = server->client().Score(request);
  ASSERT_TRUE(conditioned.ok()) << conditioned.status();
  ASSERT_EQ(conditioned->logprobs_size(), 12);
  for (int i = 0; i < 12; ++i) EXPECT_NEAR(conditioned->logprobs(i), reference[6 + i], 1e-4);
  EXPECT_EQ(server->client().GetSession(session->session_id())->tokens(), 7);
}

// ----------------------------------------------------------------------------------
// Limits and lifetime.

TEST_F(ServerTest, FullQueueAnswersResourceExhaustedAtOnce) {
  fwserve::CoreOptions options = Options();
  options.engine.scheduler.max_active_streams = 1;
  options.engine.max_queued_requests = 1;
  options.max_tokens = 1000000;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto session = server->client().CreateSession("", "b");
  ASSERT_TRUE(session.ok());
  auto active = server->client().StartGenerate(Greedy("a", 1000000));
  v1::GenerateResponse message;
  ASSERT_TRUE(active->Next(&message));
  // The second request waits in the queue; it holds its session's lease from the moment
  // it is accepted, which is how the test knows it has arrived.
  auto queued = server->client().StartGenerate(Greedy("", 5, session->session_id()));
  ASSERT_TRUE(WaitUntilBusy(server->client(), session->session_id()))
      << "the second request never reached the server";
  // The queue is full: the next request is refused at once, naming the limit.
  absl::Status refused = server->client().Generate(Greedy("c", 5)).status();
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("--max-queued-requests"), std::string::npos) << refused;
  active->Cancel();
  while (active->Next(&message)) {
  }
  int received = 0;
  while (queued->Next(&message)) received += message.token_ids_size();
  EXPECT_TRUE(queued->Finish().ok());
  EXPECT_EQ(received, 5);
}

TEST_F(ServerTest, SessionLimitAndInputLimitsNameTheLimit) {
  fwserve::CoreOptions options = Options();
  options.engine.max_sessions = 2;
  options.max_prompt_bytes = 100;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(server->client().CreateSession().ok());
  ASSERT_TRUE(server->client().CreateSession().ok());
  auto third = server->client().CreateSession();
  EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("--max-sessions"), std::string::npos);
  auto too_long = server->client().Generate(Greedy(std::string(101, 'a'), 1));
  EXPECT_EQ(too_long.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("--max-prompt-bytes"), std::string::npos);
  auto too_many = server->client().Generate(Greedy("a", 2001));
  EXPECT_EQ(too_many.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_many.status().message().find("--max-tokens"), std::string::npos);
}

TEST_F(ServerTest, InvalidInputsGetExactCodes) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  fwserve::Client& client = server->client();
  auto code = [&](v1::GenerateRequest request) { return client.Generate(request).status().code(); };
  EXPECT_EQ(code(Greedy("", 5)), StatusCode::kInvalidArgument);          // empty prompt
  EXPECT_EQ(code(Greedy("\xff\xfe", 5)), StatusCode::kInvalidArgument);  // invalid UTF-8
  EXPECT_EQ(code(Greedy("\xc3", 5)), StatusCode::kInvalidArgument);      // truncated UTF-8
  EXPECT_EQ(code(Greedy("ok", -1)), StatusCode::kInvalidArgument);
  v1::GenerateRequest bad = Greedy("ok", 5);
  bad.mutable_sampling()->set_temperature(-1);
  EXPECT_EQ(code(bad), StatusCode::kInvalidArgument);
  bad = Greedy("ok", 5);
  bad.mutable_sampling()->set_top_p(1.5f);
  EXPECT_EQ(code(bad), StatusCode::kInvalidArgument);
  bad = Greedy("ok", 5);
  bad.mutable_sampling()->set_min_p(-0.1f);
  EXPECT_EQ(code(bad), StatusCode::kInvalidArgument);
  bad = Greedy("ok", 5);
  bad.mutable_sampling()->set_top_k(-3);
  EXPECT_EQ(code(bad), StatusCode::kInvalidArgument);
  bad = Greedy("ok", 5);
  bad.mutable_sampling()->set_repetition_penalty(-2);
  EXPECT_EQ(code(bad), StatusCode::kInvalidArgument);
  bad = Greedy("ok", 5);
  bad.add_stop("");
  EXPECT_EQ(code(bad), StatusCode::kInvalidArgument);
  bad = Greedy("ok", 5);
  bad.set_model("no-such-model");
  EXPECT_EQ(code(bad), StatusCode::kNotFound);
  EXPECT_EQ(code(Greedy("ok", 5, std::string(32, 'a'))), StatusCode::kNotFound);
  EXPECT_EQ(code(Greedy("ok", 5, "../../etc/passwd")), StatusCode::kInvalidArgument);
  // A session with no tokens cannot generate from an empty prompt.
  auto empty = client.CreateSession();
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(code(Greedy("", 5, empty->session_id())), StatusCode::kInvalidArgument);
  EXPECT_EQ(client.DescribeModel("nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(client.CreateSession("nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(client.CreateSession("", "\xed\xa0\x80").status().code(),  // a surrogate
            StatusCode::kInvalidArgument);
  v1::ScoreRequest score;
  score.set_text("\x80");
  EXPECT_EQ(client.Score(score).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(client.ImportSession("").status().code(), StatusCode::kInvalidArgument);
  // Nothing above created a session, apart from `empty`.
  EXPECT_EQ(client.ListAllSessions()->size(), 1u);
}

TEST_F(ServerTest, IdleSessionsExpireAndLeaveTheStore) {
  fwserve::FakeClock clock;
  fwserve::CoreOptions options = Options();
  options.clock = &clock;
  options.engine.session_ttl = absl::Hours(1);
  const std::string dir = MakeTempDir("ttl");
  options.session_store = "dir:" + dir;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto session = server->client().CreateSession("", "short-lived");
  auto kept = server->client().CreateSession("", "kept");
  ASSERT_TRUE(session.ok() && kept.ok());
  const std::string file = dir + "/" + session->session_id() + ".fwstate";
  EXPECT_TRUE(std::filesystem::exists(file));
  clock.Advance(absl::Minutes(59));
  // `kept` is used just before the first one's TTL runs out: its idle clock restarts.
  ASSERT_TRUE(server->client().Generate(Greedy(" still here", 2, kept->session_id())).ok());
  clock.Advance(absl::Minutes(2));
  EXPECT_TRUE(Eventually([&] {
    return server->client().GetSession(session->session_id()).status().code() ==
           StatusCode::kNotFound;
  }));
  EXPECT_TRUE(Eventually([&] { return !std::filesystem::exists(file); }));
  EXPECT_TRUE(server->client().GetSession(kept->session_id()).ok());
}

TEST_F(ServerTest, OverTheMemoryBudgetIdleSessionsAreEvictedWithoutASessionDir) {
  fwserve::CoreOptions options = Options();
  auto probe = Harness::Start(options);
  ASSERT_NE(probe, nullptr);
  const int64_t state_bytes = probe->client().DescribeModel()->state_bytes_per_session();
  probe.reset();
  options.engine.max_state_memory_bytes = 2 * state_bytes;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto first = server->client().CreateSession("", "one");
  auto second = server->client().CreateSession("", "two");
  ASSERT_TRUE(first.ok() && second.ok());
  auto third = server->client().CreateSession("", "three");
  ASSERT_TRUE(third.ok()) << third.status();
  // The least recently used one made room.
  EXPECT_EQ(server->client().GetSession(first->session_id()).status().code(),
            StatusCode::kNotFound);
  EXPECT_TRUE(server->client().GetSession(second->session_id()).ok());
  // With every slot in use by a stream, there is no room at all.
  auto a = server->client().StartGenerate(Greedy("", 2000, second->session_id()));
  auto b = server->client().StartGenerate(Greedy("", 2000, third->session_id()));
  v1::GenerateResponse message;
  ASSERT_TRUE(a->Next(&message) && b->Next(&message));
  auto refused = server->client().Generate(Greedy("x", 2));
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("--max-state-memory-bytes"), std::string::npos);
  a->Cancel();
  b->Cancel();
}

TEST_F(ServerTest, OneModelsIdleSessionsMakeRoomForAnother) {
  fwserve::CoreOptions options = Options();
  options.model_dirs.push_back(ModelDir("fast_weight"));
  auto probe = Harness::Start(options);
  ASSERT_NE(probe, nullptr);
  const int64_t aft_bytes = probe->client().DescribeModel("aft")->state_bytes_per_session();
  const int64_t fw_bytes = probe->client().DescribeModel("fast_weight")->state_bytes_per_session();
  probe.reset();
  // Room for aft sessions only; a fast_weight session needs some of them to go.
  const int64_t aft_sessions = (fw_bytes + aft_bytes - 1) / aft_bytes + 1;
  options.engine.max_state_memory_bytes = aft_sessions * aft_bytes;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  for (int64_t i = 0; i < aft_sessions; ++i) {
    ASSERT_TRUE(server->client().CreateSession("aft", "idle").ok());
  }
  auto first = server->client().CreateSession("fast_weight", "x");
  ASSERT_EQ(first.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(first.status().message().find("retry"), std::string::npos);
  // The aft engine releases idle sessions at its next housekeeping (once a second).
  absl::StatusOr<v1::SessionInfo> created = first;
  for (int i = 0; i < 60 && !created.ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    created = server->client().CreateSession("fast_weight", "x");
  }
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_LT(server->client().ListAllSessions("aft")->size(), static_cast<size_t>(aft_sessions));
}

TEST_F(ServerTest, IdleSessionsSpillToDiskAndComeBack) {
  fwserve::CoreOptions options = Options("fast_weight");
  const std::string dir = MakeTempDir("spill");
  options.session_store = "dir:" + dir;
  auto probe = Harness::Start(Options("fast_weight"));
  ASSERT_NE(probe, nullptr);
  const int64_t state_bytes = probe->client().DescribeModel()->state_bytes_per_session();
  auto expected = probe->client().Generate(Greedy("first session!", 20));
  ASSERT_TRUE(expected.ok());
  probe.reset();
  options.engine.max_state_memory_bytes = 2 * state_bytes;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto first = server->client().CreateSession("", "first");
  ASSERT_TRUE(first.ok());
  for (const char* prefix : {"second", "third", "fourth"}) {
    ASSERT_TRUE(server->client().CreateSession("", prefix).ok());
  }
  auto spilled = server->client().GetSession(first->session_id());
  ASSERT_TRUE(spilled.ok());
  EXPECT_FALSE(spilled->resident());
  EXPECT_TRUE(std::filesystem::exists(dir + "/" + first->session_id() + ".fwstate"));
  // Using it brings it back, unchanged.
  auto resumed = server->client().Generate(Greedy(" session!", 20, first->session_id()));
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->token_ids, expected->token_ids);
  EXPECT_TRUE(server->client().GetSession(first->session_id())->resident());
  EXPECT_EQ(server->client().ListAllSessions()->size(), 4u);
}

TEST_F(ServerTest, ASpilledSessionThatCannotBeReadBackIsDataLoss) {
  fwserve::CoreOptions options = Options();
  const std::string dir = MakeTempDir("data-loss");
  options.session_store = "dir:" + dir;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  const int64_t state_bytes = server->client().DescribeModel()->state_bytes_per_session();
  server.reset();
  options.engine.max_state_memory_bytes = state_bytes;  // one resident session at a time
  server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto first = server->client().CreateSession("", "first");
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(server->client().CreateSession("", "second").ok());  // spills the first
  const std::string path = dir + "/" + first->session_id() + ".fwstate";
  ASSERT_FALSE(server->client().GetSession(first->session_id())->resident());
  ASSERT_TRUE(std::filesystem::exists(path));
  std::ofstream(path, std::ios::trunc) << "not a state";
  auto turn = server->client().Generate(Greedy("x", 3, first->session_id()));
  EXPECT_EQ(turn.status().code(), StatusCode::kDataLoss) << turn.status();
  EXPECT_EQ(turn.status().message().find(dir), std::string::npos) << "leaks the path";
  // The other session is unaffected.
  EXPECT_EQ(server->client().ListAllSessions()->size(), 2u);
}

TEST_F(ServerTest, SessionsPersistAcrossARestart) {
  fwserve::CoreOptions options = Options();
  options.session_store = "dir:" + MakeTempDir("persist");
  std::string id;
  std::vector<int64_t> expected;
  {
    auto server = Harness::Start(options);
    ASSERT_NE(server, nullptr);
    auto session = server->client().CreateSession("", "Remember me");
    ASSERT_TRUE(session.ok());
    id = session->session_id();
    auto reference = server->client().Generate(Greedy("Remember me, please", 25));
    ASSERT_TRUE(reference.ok());
    expected = reference->token_ids;
    server->Shutdown();
  }
  auto restarted = Harness::Start(options);
  ASSERT_NE(restarted, nullptr);
  auto info = restarted->client().GetSession(id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->tokens(), 11);
  auto resumed = restarted->client().Generate(Greedy(", please", 25, id));
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->token_ids, expected);
}

TEST_F(ServerTest, EveryAnsweredChangeIsAlreadyInTheStore) {
  // Write-through: what a client was answered is on disk before any shutdown. The store
  // is read here by a second, independent Core after the first one is gone without
  // Stop() having any unsaved session to write (every session is stored on answer).
  fwserve::CoreOptions options = Options();
  const std::string dir = MakeTempDir("through");
  options.session_store = "dir:" + dir;
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto created = server->client().CreateSession("", "Once upon");
  ASSERT_TRUE(created.ok());
  const std::string file = dir + "/" + created->session_id() + ".fwstate";
  ASSERT_TRUE(std::filesystem::exists(file));
  auto read_file = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_NE(read_file(file).find("\"tokens\":\"9\""), std::string::npos);
  auto generated = server->client().Generate(Greedy(" a time", 12, created->session_id()));
  ASSERT_TRUE(generated.ok());
  // Before the final message arrived, the file held 9 + 7 + 12 tokens.
  EXPECT_NE(read_file(file).find("\"tokens\":\"28\""), std::string::npos);
  auto forked = server->client().ForkSession(created->session_id());
  ASSERT_TRUE(forked.ok());
  EXPECT_TRUE(std::filesystem::exists(dir + "/" + forked->session_id() + ".fwstate"));
  auto exported = server->client().ExportSession(created->session_id());
  ASSERT_TRUE(exported.ok());
  auto imported = server->client().ImportSession(exported->blob());
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_TRUE(std::filesystem::exists(dir + "/" + imported->session_id() + ".fwstate"));
  ASSERT_TRUE(server->client().DeleteSession(forked->session_id()).ok());
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + forked->session_id() + ".fwstate"));
  // Session files are private to the server.
  EXPECT_EQ(std::filesystem::status(file).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  EXPECT_EQ(std::filesystem::status(dir).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_all);
}

TEST_F(ServerTest, ASecondServerOnTheSameStoreDirectoryFailsAtStart) {
  fwserve::CoreOptions options = Options();
  options.session_store = "dir:" + MakeTempDir("locked");
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto second = fwserve::Core::Create(options);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("another fwserve process is using it"),
            std::string::npos)
      << second.status();
  // Once the first one is gone the directory is free again, with its sessions.
  auto session = server->client().CreateSession("", "mine");
  ASSERT_TRUE(session.ok());
  server.reset();
  auto third = Harness::Start(options);
  ASSERT_NE(third, nullptr);
  EXPECT_TRUE(Eventually([&] { return third->client().GetSession(session->session_id()).ok(); }));
}

TEST_F(ServerTest, BadSessionStoreFlagsNameTheFlag) {
  fwserve::CoreOptions options = Options();
  options.session_store = "tape:/dev/st0";
  auto core = fwserve::Core::Create(options);
  ASSERT_FALSE(core.ok());
  EXPECT_EQ(core.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(core.status().message().find("--session-store"), std::string::npos);
}

// ----------------------------------------------------------------------------------
// Models, health, shutdown.

TEST_F(ServerTest, ModelsAreListedAndDescribed) {
  fwserve::CoreOptions options = Options();
  options.model_dirs.push_back(ModelDir("fast_weight"));
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto models = server->client().ListModels();
  ASSERT_TRUE(models.ok());
  ASSERT_EQ(models->size(), 2u);
  EXPECT_EQ((*models)[0].name(), "aft");
  EXPECT_TRUE((*models)[0].is_default());
  EXPECT_EQ((*models)[1].architecture(), "fast_weight");
  EXPECT_GT((*models)[1].parameters(), 0);
  EXPECT_EQ((*models)[1].fingerprint().size(), 64u);
  EXPECT_NE((*models)[1].config_json().find("\"architecture\""), std::string::npos);
  auto described = server->client().DescribeModel("fast_weight");
  ASSERT_TRUE(described.ok());
  EXPECT_EQ(described->state_bytes_per_session(), (*models)[1].state_bytes_per_session());
}

// Sends this process's stderr (fd 2) to a file while it lives.
class StderrToFile {
 public:
  explicit StderrToFile(const std::string& path) {
    std::fflush(stderr);
    saved_ = dup(2);
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    close(fd);
  }
  ~StderrToFile() {
    std::fflush(stderr);
    dup2(saved_, 2);
    close(saved_);
  }

 private:
  int saved_ = -1;
};

// docs/metrics.md "Logs": every finished RPC logs one structured line, at INFO when it
// succeeded and at WARNING with the error message when it failed.
TEST_F(ServerTest, EveryFinishedRpcLogsOneRequestLine) {
  auto server = Harness::Start(Options());
  ASSERT_NE(server, nullptr);
  auto session = server->client().CreateSession("", "hello");
  ASSERT_TRUE(session.ok());
  const std::string path = MakeTempDir("request-log") + "/stderr";
  const auto request_lines = [&path] {
    std::ifstream in(path);
    std::vector<std::string> lines;
    // Generate lines only: the log is written by its own thread, so CreateSession's line
    // (logged as that RPC finished) may reach stderr after the capture has begun.
    for (std::string line; std::getline(in, line);) {
      if (line.find(" request id=") != std::string::npos &&
          line.find(" method=Generate ") != std::string::npos) {
        lines.push_back(line);
      }
    }
    return lines;
  };
  std::vector<std::string> lines;
  {
    StderrToFile capture(path);
    ASSERT_TRUE(server->client().Generate(Greedy("abc", 5, session->session_id())).ok());
    v1::GenerateRequest bad = Greedy("x", 1);
    bad.set_max_tokens(-1);
    EXPECT_EQ(server->client().Generate(bad).status().code(), StatusCode::kInvalidArgument);
    // The line is written as the RPC finishes, possibly after the client has its reply.
    EXPECT_TRUE(Eventually([&] {
      lines = request_lines();
      return lines.size() >= 2;
    }));
  }
  ASSERT_EQ(lines.size(), 2u);
  // Session ids are capabilities: the log shows their first 8 digits (server/base/log.h).
  const std::regex ok(
      R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO request id=\d+ method=Generate (tenant=- )?)"
      R"(model=aft session=)" +
      session->session_id().substr(0, 8) +
      R"(\.\.\. prompt_tokens=3 generated_tokens=5 latency_ms=\d+ status=OK)");
  EXPECT_TRUE(std::regex_match(lines[0], ok)) << lines[0];
  const std::regex failed(
      R"(\S+Z WARNING request id=\d+ method=Generate (tenant=- )?model=\S+ session=- )"
      R"(prompt_tokens=0 generated_tokens=0 latency_ms=\d+ status=INVALID_ARGUMENT )"
      R"(error="[^"]*max_tokens[^"]*")");
  EXPECT_TRUE(std::regex_match(lines[1], failed)) << lines[1];
}

TEST_F(ServerTest, HealthAndGracefulShutdown) {
  StepGate gate(/*free_steps=*/1);  // the stream cannot finish before the checks below
  fwserve::CoreOptions options = Options();
  gate.Install(options);
  fwserve::GrpcServerOptions server_options;
  server_options.drain_timeout = absl::Seconds(120);  // a safety net; never reached
  auto server = Harness::Start(options, server_options);
  ASSERT_NE(server, nullptr);
  EXPECT_TRUE(*server->client().Health());
  EXPECT_TRUE(*server->client().Health("fwserve.v1.Fwserve"));
  // An in-flight stream finishes during the drain while new work is refused.
  auto stream = server->client().StartGenerate(Greedy("drain", 300));
  v1::GenerateResponse message;
  ASSERT_TRUE(stream->Next(&message));
  ASSERT_TRUE(gate.WaitHeld());
  std::thread stopper([&] { server->Shutdown(); });
  absl::StatusOr<bool> health;
  EXPECT_TRUE(Eventually([&] {
    health = server->client().Health();
    return !health.ok() || !*health;
  })) << "the server never reported NOT_SERVING";
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_FALSE(*health);
  EXPECT_FALSE(*server->client().Health("fwserve.v1.Fwserve"));
  EXPECT_EQ(server->client().Generate(Greedy("late", 1)).status().code(), StatusCode::kUnavailable);
  gate.Open();
  int received = message.token_ids_size();
  v1::FinishReason reason = v1::FINISH_REASON_UNSPECIFIED;
  while (stream->Next(&message)) {
    received += message.token_ids_size();
    if (message.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) reason = message.finish_reason();
  }
  const absl::Status finished = stream->Finish();
  EXPECT_TRUE(finished.ok()) << finished;
  EXPECT_EQ(received, 300);
  EXPECT_EQ(reason, v1::FINISH_REASON_LENGTH);
  stopper.join();
}

TEST_F(ServerTest, ShutdownWithOnlyAnIdleConnectedClientDoesNotWaitForIt) {
  // It used to wait out the gRPC shutdown deadline for the idle connection: with that
  // deadline and the drain timeout at 10 minutes, waiting either out is told apart from
  // a slow machine by far.
  fwserve::GrpcServerOptions server_options;
  server_options.drain_timeout = absl::Minutes(10);
  server_options.stuck_write_timeout = absl::Minutes(10);
  auto server = Harness::Start(Options(), server_options);
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(server->client().ListSessions().ok());  // the channel is connected, idle
  const absl::Time start = absl::Now();
  server->Shutdown();
  EXPECT_LT(absl::Now() - start, absl::Minutes(2));
}

TEST_F(ServerTest, DrainTimeoutEndsLongStreamsWithReasonShutdown) {
  // The stream is held after its first step until the drain timeout has passed and the
  // shutdown ends the remaining work: it can neither finish first nor be ended early.
  StepGate gate(/*free_steps=*/1, /*until_ending=*/true);
  fwserve::GrpcServerOptions server_options;
  server_options.drain_timeout = absl::Milliseconds(200);
  fwserve::CoreOptions options = Options();
  gate.Install(options);
  options.session_store = "dir:" + MakeTempDir("drain");
  auto server = Harness::Start(options, server_options);
  ASSERT_NE(server, nullptr);
  auto session = server->client().CreateSession("", "long");
  ASSERT_TRUE(session.ok());
  auto stream = server->client().StartGenerate(Greedy("", 2000, session->session_id()));
  v1::GenerateResponse message;
  ASSERT_TRUE(stream->Next(&message));
  std::thread stopper([&] { server->Shutdown(); });
  int received = message.token_ids_size();
  v1::GenerateResponse last;
  while (stream->Next(&message)) {
    received += message.token_ids_size();
    last = message;
  }
  EXPECT_TRUE(stream->Finish().ok());
  stopper.join();
  EXPECT_EQ(last.finish_reason(), v1::FINISH_REASON_SHUTDOWN);
  EXPECT_LT(received, 10);  // the free step, and at most the one the gate held
  EXPECT_EQ(last.usage().session_tokens(), 4 + received);
  // The session was persisted with exactly what was streamed.
  server.reset();  // releases the store directory
  options.engine.before_decode_step_for_testing = nullptr;
  auto restarted = Harness::Start(options);
  ASSERT_NE(restarted, nullptr);
  EXPECT_EQ(restarted->client().GetSession(session->session_id())->tokens(), 4 + received);
}

TEST_F(ServerTest, ShippedModelScoresShakespeareWell) {
  fwserve::CoreOptions options;
  options.model_dirs = {std::string(FWSERVE_SOURCE_DIR) + "/models/pretrained/aft-shakespeare"};
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  v1::ScoreRequest request;
  request.set_text("ROMEO:\nBut, soft! what light through yonder window breaks?\n");
  auto scored = server->client().Score(request);
  ASSERT_TRUE(scored.ok()) << scored.status();
  double total = 0;
  for (double v : scored->logprobs()) total += v;
  // Bytes of English verse under a trained model: well below the 5.5 nats of uniform.
  EXPECT_LT(-total / scored->logprobs_size(), 2.0);
}

TEST_F(ServerTest, ProductKeyMemoryModelIsServedLikeAnyOther) {
  // The shipped PKM model: no per-session state for the memory, DescribeModel reports
  // its size, and a session's turns equal one request over the whole text.
  fwserve::CoreOptions options;
  options.model_dirs = {std::string(FWSERVE_SOURCE_DIR) + "/models/pretrained/aft_pkm-shakespeare"};
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  auto model = server->client().DescribeModel();
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->memory_slots(), 128 * 128);
  auto session = server->client().CreateSession("", "ROMEO:");
  ASSERT_TRUE(session.ok()) << session.status();
  auto first = server->client().Generate(GreedyRequest(" But", 20, session->session_id()));
  auto second = server->client().Generate(GreedyRequest(" and", 20, session->session_id()));
  auto whole = server->client().Generate(
      GreedyRequest("ROMEO: But" + (first.ok() ? first->text : "") + " and", 20));
  ASSERT_TRUE(first.ok() && second.ok() && whole.ok());
  EXPECT_EQ(second->text, whole->text);
  EXPECT_EQ(second->usage.session_tokens(), 6 + 4 + 20 + 4 + 20);
}

}  // namespace
}  // namespace fwtest
