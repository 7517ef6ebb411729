// Overload behaviour on a real in-process server (docs/serving.md "Overload"): the
// refusal's retry hint in both gRPC forms, the client library's backoff (it waits at
// least the hint), admission by deadline, refusals counted by reason, and one tenant's
// storm leaving another's requests unrefused. Counts and events decide, never elapsed
// time, with two exceptions. The client's waits are a lower bound. DeadlineAdmission
// assumes that a stream of 8,000 tokens of the tiny model takes over 7 ms. It takes
// about 60 ms on a 2-core VM, and longer on anything slower.
#include <grpcpp/grpcpp.h>
#include <prometheus/registry.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "fwserve/v1/fwserve.grpc.pb.h"
#include "google/rpc/error_details.pb.h"
#include "google/rpc/status.pb.h"
#include "gtest/gtest.h"
#include "models/checkpoints/checkpoint.h"
#include "server/tenancy/authenticator.h"
#include "server/tenancy/tenants.h"
#include "tests/integration/harness.h"

namespace fwserve {
namespace {

using fwtest::GreedyRequest;
using fwtest::Harness;

bool WaitUntilBusy(Client& client, const std::string& id) {
  for (int i = 0; i < 2000; ++i) {
    auto info = client.GetSession(id);
    if (info.ok() && info->busy()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

class OverloadTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_dir_ = new std::string(fwtest::MakeTempDir("overload-model") + "/aft");
    fwtest::WriteTinyCheckpoint(*model_dir_, "aft", 5);
  }
  static void TearDownTestSuite() { delete model_dir_; }

  static CoreOptions Options(int64_t active, int64_t queued) {
    CoreOptions options;
    options.model_dirs = {*model_dir_};
    options.max_tokens = 10000000;
    options.engine.scheduler.max_active_streams = active;
    options.engine.max_queued_requests = queued;
    return options;
  }

  // A stub without the client library (no retries): the server's own answers.
  static std::unique_ptr<v1::Fwserve::Stub> RawStub(Harness& server) {
    return v1::Fwserve::NewStub(
        grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials()));
  }

  // While alive, keeps the one stream slot of `server` saturated with streams of 8,000
  // tokens (about 60 ms on a 2-core VM, longer on a slower or busier machine), 8 at a
  // time, so that the drain rate is measured and 7 wait.
  static constexpr int kSaturatingTokens = 8000;
  class SaturatedSlot {
   public:
    explicit SaturatedSlot(Harness& server) {
      for (int i = 0; i < 8; ++i) {
        load_.emplace_back([this, &server] {
          while (!stop_.load())
            (void)server.client().Generate(GreedyRequest("a", kSaturatingTokens));
        });
      }
    }
    ~SaturatedSlot() {
      stop_.store(true);
      for (auto& thread : load_) thread.join();
    }

   private:
    std::atomic<bool> stop_{false};
    std::vector<std::thread> load_;
  };

  // Sends a 5-token Generate (with `deadline` from now, unless zero) every 100 ms until
  // one ends with `code` and a message containing `text`; returns that message, or ""
  // after 300 tries (a hang guard).
  static std::string GenerateUntilRefused(v1::Fwserve::Stub& stub, absl::Duration deadline,
                                          grpc::StatusCode code, const std::string& text) {
    for (int attempt = 0; attempt < 300; ++attempt) {
      grpc::ClientContext context;
      if (deadline > absl::ZeroDuration()) {
        context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
      }
      auto reader = stub.Generate(&context, GreedyRequest("c", 5));
      v1::GenerateResponse message;
      while (reader->Read(&message)) {
      }
      const grpc::Status status = reader->Finish();
      if (status.error_code() == code && absl::StrContains(status.error_message(), text)) {
        return status.error_message();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return "";
  }

  // Fills a server of two stream slots (kFilledSlots) and one queue place: two endless
  // streams run and a request on a session waits. Returns the streams once the session's
  // lease shows the request arrived and the engine's queue gauge shows it queued: an
  // arrival that was refused (the client library then retries it after the hint) must not
  // leave the queue place to the test's own request, which would wait forever behind the
  // streams. No task ends while the slots are all taken, so the drain stays unmeasured:
  // the session's creation (a task of its own) runs while a slot is still free; with one
  // slot its end would count as the drain of a saturated window.
  static constexpr int64_t kFilledSlots = 2;
  struct Filled {
    std::vector<std::unique_ptr<GenerateStream>> running;
    std::unique_ptr<GenerateStream> queued;
  };
  static Filled Fill(Harness& server) {
    Filled filled;
    auto session = server.client().CreateSession("", "b");
    EXPECT_TRUE(session.ok());
    for (int64_t i = 0; i < kFilledSlots; ++i) {
      filled.running.push_back(server.client().StartGenerate(GreedyRequest("a", 10000000)));
      v1::GenerateResponse message;
      EXPECT_TRUE(filled.running.back()->Next(&message));
    }
    filled.queued = server.client().StartGenerate(GreedyRequest("", 3, session->session_id()));
    EXPECT_TRUE(WaitUntilBusy(server.client(), session->session_id()));
    bool queued = false;
    for (int i = 0; i < 2000 && !queued; ++i) {  // a hang guard of 10 s, far beyond 2 gauge ticks
      // The engine's queue length as its gauge says (published once a second).
      queued = fwtest::GaugeValue(server, "fwserve_engine_queued_requests") == 1;
      if (!queued) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (!queued) {
      ADD_FAILURE() << "the session's request never showed in the engine's queue";
      // So that no later request waits behind them forever.
      for (auto& running : filled.running) running->Cancel();
    }
    return filled;
  }
  static void Drain(Filled& filled) {
    v1::GenerateResponse message;
    for (auto& running : filled.running) {
      running->Cancel();
      while (running->Next(&message)) {
      }
    }
    while (filled.queued->Next(&message)) {
    }
  }

  // Two tenants, storm and calm, each with its API key; a server over `options` that
  // authenticates them; and a client of each (no overload retries: every refusal shows).
  static constexpr char kStormKey[] = "key-of-storm-0123456789";
  static constexpr char kCalmKey[] = "key-of-calm-01234567890";
  struct TwoTenants {
    std::unique_ptr<Tenants> tenants;
    std::unique_ptr<ApiKeyAuthenticator> authenticator;
    std::unique_ptr<Harness> server;
    std::unique_ptr<Client> storm, calm;
  };
  static TwoTenants StartTwoTenants(CoreOptions options, GrpcServerOptions server_options) {
    TwoTenants t;
    auto tenants = Tenants::FromText("sha256:" + Sha256Hex(kStormKey) + " tenant=storm\n" +
                                     "sha256:" + Sha256Hex(kCalmKey) + " tenant=calm\n");
    EXPECT_TRUE(tenants.ok());
    if (!tenants.ok()) return t;
    t.tenants = std::move(*tenants);
    t.authenticator = std::make_unique<ApiKeyAuthenticator>(t.tenants.get(), nullptr);
    options.tenants = t.tenants.get();
    server_options.authenticator = t.authenticator.get();
    t.server = Harness::Start(options, server_options);
    if (t.server == nullptr) return t;
    auto connect = [&](const char* key) {
      ClientOptions client_options;
      client_options.target = t.server->target();
      client_options.auth_token = key;
      client_options.max_overload_retries = 0;
      return std::move(*Client::Connect(client_options));
    };
    t.storm = connect(kStormKey);
    t.calm = connect(kCalmKey);
    return t;
  }

  static std::string* model_dir_;
};
std::string* OverloadTest::model_dir_ = nullptr;

// The raw call, as any gRPC client sees it: RESOURCE_EXHAUSTED with the pushback
// trailer and a RetryInfo detail; with --max-refusal-delay 0 the two say the same.
TEST_F(OverloadTest, RefusalCarriesPushbackAndRetryInfo) {
  GrpcServerOptions server_options;
  server_options.max_refusal_delay = absl::ZeroDuration();
  auto server = Harness::Start(Options(kFilledSlots, 1), server_options);
  ASSERT_NE(server, nullptr);
  Filled filled = Fill(*server);

  auto stub = RawStub(*server);
  grpc::ClientContext context;
  auto reader = stub->Generate(&context, GreedyRequest("c", 5));
  v1::GenerateResponse message;
  EXPECT_FALSE(reader->Read(&message));
  const grpc::Status status = reader->Finish();
  ASSERT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "--max-queued-requests"));

  const auto& trailers = context.GetServerTrailingMetadata();
  auto pushback = trailers.find("grpc-retry-pushback-ms");
  ASSERT_NE(pushback, trailers.end());
  int64_t pushback_ms = -1;
  ASSERT_TRUE(absl::SimpleAtoi(std::string(pushback->second.data(), pushback->second.size()),
                               &pushback_ms));
  google::rpc::Status details;
  ASSERT_TRUE(details.ParseFromString(status.error_details()));
  EXPECT_EQ(details.code(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  ASSERT_EQ(details.details_size(), 1);
  google::rpc::RetryInfo retry;
  ASSERT_TRUE(details.details(0).UnpackTo(&retry));
  const int64_t retry_ms =
      retry.retry_delay().seconds() * 1000 + retry.retry_delay().nanos() / 1000000;
  // Nothing has drained yet: the unmeasured hint, 1 s, in both forms.
  EXPECT_EQ(retry_ms, 1000);
  EXPECT_EQ(pushback_ms, 1000);
  Drain(filled);
}

// A held refusal: the pushback is what is left of the hint after the hold.
TEST_F(OverloadTest, HeldRefusalPushesBackTheRest) {
  GrpcServerOptions server_options;
  server_options.max_refusal_delay = absl::Milliseconds(300);
  auto server = Harness::Start(Options(kFilledSlots, 1), server_options);
  ASSERT_NE(server, nullptr);
  Filled filled = Fill(*server);
  auto stub = RawStub(*server);
  grpc::ClientContext context;
  const absl::Time sent = absl::Now();
  auto reader = stub->Generate(&context, GreedyRequest("c", 5));
  v1::GenerateResponse message;
  EXPECT_FALSE(reader->Read(&message));
  const grpc::Status status = reader->Finish();
  const absl::Duration answered_after = absl::Now() - sent;
  ASSERT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  const auto& trailers = context.GetServerTrailingMetadata();
  auto pushback = trailers.find("grpc-retry-pushback-ms");
  ASSERT_NE(pushback, trailers.end());
  EXPECT_EQ(std::string(pushback->second.data(), pushback->second.size()), "700");
  // Held at least the 300 ms (a lower bound: a slow machine only makes it later).
  EXPECT_GE(answered_after, absl::Milliseconds(300));
  Drain(filled);
}

// The client library waits at least the hint before each retry, with jitter on top, and
// gives up after max_overload_retries; the server saw every attempt.
TEST_F(OverloadTest, ClientRetriesAfterTheHint) {
  GrpcServerOptions server_options;
  server_options.max_refusal_delay = absl::ZeroDuration();
  auto server = Harness::Start(Options(kFilledSlots, 1), server_options);
  ASSERT_NE(server, nullptr);
  Filled filled = Fill(*server);

  std::vector<absl::Duration> waits;
  ClientOptions options;
  options.target = server->target();
  options.max_overload_retries = 3;
  options.overload_backoff = absl::Milliseconds(50);
  options.retry_wait_for_testing = [&waits](absl::Duration wait) { waits.push_back(wait); };
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok());
  absl::Status refused = (*client)->Generate(GreedyRequest("c", 5)).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  ASSERT_EQ(waits.size(), 3u);
  for (size_t i = 0; i < waits.size(); ++i) {
    // The hint (1 s, unmeasured) plus a jitter below 50 ms * 2^i.
    EXPECT_GE(waits[i], absl::Seconds(1)) << i;
    EXPECT_LT(waits[i], absl::Seconds(1) + absl::Milliseconds(50) * (1 << i)) << i;
  }

  // Unary calls too: a session operation refused for a full queue is retried the same.
  waits.clear();
  EXPECT_EQ((*client)->CreateSession("", "x").status().code(),
            absl::StatusCode::kResourceExhausted);
  // The budget (10 tokens, -1 per refusal, retries only above 5): 4 refusals so far,
  // so this call's first refusal leaves 5 and it is not retried.
  EXPECT_EQ(waits.size(), 0u);

  // Without retries the refusal comes back at once.
  ClientOptions once = options;
  once.max_overload_retries = 0;
  waits.clear();
  auto impatient = Client::Connect(once);
  ASSERT_TRUE(impatient.ok());
  EXPECT_EQ((*impatient)->Generate(GreedyRequest("c", 5)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(waits.empty());
  Drain(filled);
}

// A request that the queue's measured drain says cannot start before its deadline is
// refused by admission at once (its own message, not a deadline that ran out in the queue).
TEST_F(OverloadTest, DeadlineAdmission) {
  auto server = Harness::Start(Options(1, 64));
  ASSERT_NE(server, nullptr);
  // The expected wait of 7 streams of about 60 ms (0.4 s here; 0.1 s on a machine 4x
  // faster) is far beyond 50 ms.
  SaturatedSlot load(*server);
  auto stub = RawStub(*server);
  const std::string refusal =
      GenerateUntilRefused(*stub, absl::Milliseconds(50), grpc::StatusCode::DEADLINE_EXCEEDED,
                           "cannot start this request before its deadline");
  EXPECT_TRUE(absl::StrContains(refusal, "expected wait")) << refusal;
}

// With --max-queue-wait the queue holds only what its measured drain starts within the
// bound (at least 2): a queue of 64 places is refused at 2, naming the flag, and counted
// as reason queue_wait.
TEST_F(OverloadTest, QueueWaitBoundsTheQueue) {
  CoreOptions options = Options(1, 64);
  options.engine.max_queue_wait = absl::Milliseconds(1);
  auto server = Harness::Start(options);
  ASSERT_NE(server, nullptr);
  // About 16 streams end a second: 1 ms drains less than one, so the capacity is 2.
  SaturatedSlot load(*server);
  auto stub = RawStub(*server);
  const std::string refusal = GenerateUntilRefused(
      *stub, absl::ZeroDuration(), grpc::StatusCode::RESOURCE_EXHAUSTED, "--max-queue-wait");
  EXPECT_TRUE(absl::StrContains(
      refusal, "is full (2 requests, what drains within --max-queue-wait=1ms); retry later"))
      << refusal;
  double queue_wait_refusals = 0;
  for (const auto& family : server->metrics().registry()->Collect()) {
    if (family.name != "fwserve_requests_refused_total") continue;
    for (const auto& metric : family.metric) {
      for (const auto& label : metric.label) {
        if (label.name == "reason" && label.value == "queue_wait") {
          queue_wait_refusals = metric.counter.value;
        }
      }
    }
  }
  EXPECT_GE(queue_wait_refusals, 1);
}

// One tenant's storm: past its half of the queue it is refused; the other tenant, well
// within its share, is never refused and every one of its requests completes.
TEST_F(OverloadTest, AStormStaysWithItsTenant) {
  GrpcServerOptions server_options;
  server_options.max_refusal_delay = absl::ZeroDuration();
  TwoTenants t = StartTwoTenants(Options(2, 8), server_options);
  ASSERT_NE(t.server, nullptr);
  Client* storm = t.storm.get();
  Client* calm = t.calm.get();
  // The storm: 2 endless streams run, then 12 more arrive, of which 4 fit its share.
  std::vector<std::unique_ptr<GenerateStream>> running;
  for (int i = 0; i < 2; ++i) {
    running.push_back(storm->StartGenerate(GreedyRequest("s", 10000000)));
    v1::GenerateResponse message;
    ASSERT_TRUE(running.back()->Next(&message));
  }
  std::atomic<int> storm_refused{0}, storm_share_refusals{0};
  std::vector<std::unique_ptr<GenerateStream>> storm_queued;
  std::vector<std::thread> storm_threads;
  std::mutex mu;
  for (int i = 0; i < 12; ++i) {
    storm_threads.emplace_back([&] {
      auto stream = storm->StartGenerate(GreedyRequest("s", 20));
      v1::GenerateResponse message;
      if (stream->Next(&message)) {
        std::lock_guard<std::mutex> lock(mu);
        storm_queued.push_back(std::move(stream));
        return;
      }
      absl::Status status = stream->Finish();
      if (status.code() == absl::StatusCode::kResourceExhausted) {
        ++storm_refused;
        if (absl::StrContains(status.message(), "its share of the queue")) ++storm_share_refusals;
      } else {
        // Queued behind the running streams: stays open until they end.
        std::lock_guard<std::mutex> lock(mu);
        storm_queued.push_back(std::move(stream));
      }
    });
  }
  // Wait (events, not time) until 8 storm requests were refused: 12 - its share of 4.
  for (int i = 0; i < 3000 && storm_refused.load() < 8; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(storm_refused.load(), 8);
  EXPECT_EQ(storm_share_refusals.load(), 8);
  // The calm tenant, mid-storm: both requests accepted and completed in full.
  std::vector<absl::StatusOr<GenerateResult>> calm_results(2);
  std::vector<std::thread> calm_threads;
  for (int i = 0; i < 2; ++i) {
    calm_threads.emplace_back([&, i] { calm_results[i] = calm->Generate(GreedyRequest("c", 10)); });
  }
  // Let them through: end the storm's endless streams (fair share admits calm first).
  for (auto& stream : running) stream->Cancel();
  for (auto& thread : calm_threads) thread.join();
  for (const auto& result : calm_results) {
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_EQ(result->usage.generated_tokens(), 10);
  }
  for (auto& thread : storm_threads) thread.join();
  v1::GenerateResponse message;
  for (auto& stream : running) {
    while (stream->Next(&message)) {
    }
  }
  for (auto& stream : storm_queued) {
    while (stream->Next(&message)) {
    }
  }
}

// Fair share by preemption: with the one slot held by tenant storm's endless stream,
// tenant calm (below its share of 1 slot) does not wait for it to end. The storm's
// stream is parked, calm's request runs in full, and the storm's stream then resumes
// where it was: its tokens are those of the same request never interrupted.
TEST_F(OverloadTest, ATenantBelowItsShareParksAStreamOfTheTenantAboveIt) {
  CoreOptions options = Options(1, 4);
  options.engine.preempt_for_fair_share = true;
  TwoTenants t = StartTwoTenants(options, GrpcServerOptions());
  ASSERT_NE(t.server, nullptr);
  Client* storm = t.storm.get();
  Client* calm = t.calm.get();
  Harness* server = t.server.get();

  constexpr int kStormTokens = 60;
  auto endless = storm->StartGenerate(GreedyRequest("s", 10000000));
  std::vector<int64_t> storm_tokens;
  v1::GenerateResponse message;
  ASSERT_TRUE(endless->Next(&message));
  storm_tokens.assign(message.token_ids().begin(), message.token_ids().end());

  std::atomic<bool> calm_done{false};
  absl::StatusOr<GenerateResult> calm_result;
  std::thread calm_thread([&] {
    calm_result = calm->Generate(GreedyRequest("c", 10));
    calm_done.store(true);
  });
  // A hang guard far beyond the milliseconds this takes: without preemption calm waits
  // for a stream that never ends, and this fails (then lets it through).
  for (int i = 0; i < 6000 && !calm_done.load(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(calm_done.load()) << "calm waited behind storm's stream";
  if (!calm_done.load()) endless->Cancel();
  calm_thread.join();
  ASSERT_TRUE(calm_result.ok()) << calm_result.status();
  EXPECT_EQ(calm_result->usage.generated_tokens(), 10);

  // The parked stream resumes and goes on exactly as it would have.
  while (static_cast<int>(storm_tokens.size()) < kStormTokens && endless->Next(&message)) {
    storm_tokens.insert(storm_tokens.end(), message.token_ids().begin(), message.token_ids().end());
  }
  endless->Cancel();
  while (endless->Next(&message)) {
  }
  ASSERT_GE(static_cast<int>(storm_tokens.size()), kStormTokens);
  storm_tokens.resize(kStormTokens);
  auto reference = storm->Generate(GreedyRequest("s", kStormTokens));
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_EQ(storm_tokens, reference->token_ids);

  double preempted = -1;
  for (const auto& family : server->metrics().registry()->Collect()) {
    if (family.name == "fwserve_streams_preempted_total") {
      preempted = family.metric.at(0).counter.value;
    }
  }
  EXPECT_EQ(preempted, 1);
}

// CoDel (--queue-codel-target): behind a stream that never ends, the queue stands, and
// each request that waited past the target is refused with the retry hint in both gRPC
// forms and counted; without CoDel they would wait for the stream forever.
TEST_F(OverloadTest, AStandingQueueShedsWhatWaitedPastTheTarget) {
  CoreOptions options = Options(1, 8);
  options.engine.codel_target = absl::Milliseconds(1);
  options.engine.codel_interval = absl::Milliseconds(20);
  GrpcServerOptions server_options;
  server_options.max_refusal_delay = absl::ZeroDuration();  // the hint whole in the trailer
  auto server = Harness::Start(options, server_options);
  ASSERT_NE(server, nullptr);
  auto endless = server->client().StartGenerate(GreedyRequest("a", 10000000));
  v1::GenerateResponse message;
  ASSERT_TRUE(endless->Next(&message));

  constexpr int kQueued = 3;
  auto stub = RawStub(*server);
  std::vector<grpc::Status> statuses(kQueued);
  std::vector<std::string> pushback(kQueued);
  std::vector<std::thread> callers;
  for (int i = 0; i < kQueued; ++i) {
    callers.emplace_back([&, i] {
      grpc::ClientContext context;
      // A hang guard far beyond the milliseconds shedding takes.
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      auto reader = stub->Generate(&context, GreedyRequest("c", 5));
      v1::GenerateResponse ignored;
      while (reader->Read(&ignored)) {
      }
      statuses[i] = reader->Finish();
      const auto& trailers = context.GetServerTrailingMetadata();
      if (auto it = trailers.find("grpc-retry-pushback-ms"); it != trailers.end()) {
        pushback[i] = std::string(it->second.data(), it->second.size());
      }
    });
  }
  for (auto& caller : callers) caller.join();
  endless->Cancel();
  while (endless->Next(&message)) {
  }
  for (int i = 0; i < kQueued; ++i) {
    EXPECT_EQ(statuses[i].error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
        << statuses[i].error_message();
    EXPECT_TRUE(absl::StrContains(statuses[i].error_message(), "--queue-codel-target=1ms"))
        << statuses[i].error_message();
    int64_t pushback_ms = -1;
    EXPECT_TRUE(absl::SimpleAtoi(pushback[i], &pushback_ms)) << "no pushback trailer";
    EXPECT_EQ(pushback_ms, 1000);  // nothing drained yet: the unmeasured hint
    google::rpc::Status details;
    ASSERT_TRUE(details.ParseFromString(statuses[i].error_details()));
    ASSERT_EQ(details.details_size(), 1);
    google::rpc::RetryInfo retry;
    EXPECT_TRUE(details.details(0).UnpackTo(&retry));
  }
  double shed = -1;
  for (const auto& family : server->metrics().registry()->Collect()) {
    if (family.name == "fwserve_queue_shed_total") shed = family.metric.at(0).counter.value;
  }
  EXPECT_EQ(shed, kQueued);
  // The slot is free again: a request starts and completes. (Until the engine has
  // ended the cancelled stream a request may still queue, and a slow machine may shed
  // it: each try is refused with a hint or served, never left waiting.)
  absl::StatusOr<GenerateResult> after;
  for (int attempt = 0; attempt < 50; ++attempt) {
    after = server->client().Generate(GreedyRequest("d", 3));
    if (after.ok()) break;
    EXPECT_EQ(after.status().code(), absl::StatusCode::kResourceExhausted) << after.status();
  }
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->usage.generated_tokens(), 3);
}

}  // namespace
}  // namespace fwserve
