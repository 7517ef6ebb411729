// Two in-process servers on one real redis-server (--session-store redis://), driven
// through the real client: any server serves any session, the resident pool is a
// version-checked cache, a busy session is ABORTED across servers, a lost lease's write
// is refused (fencing), and Redis going away gives UNAVAILABLE and then recovers.
// The multi-process version (HAProxy, kill -9, SIGSTOP) is replicas_test.py.
#include <prometheus/registry.h>

#include <atomic>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/common/redis_server.h"
#include "tests/integration/harness.h"

namespace fwserve {
namespace {

using fwtest::GreedyRequest;
using fwtest::Harness;

class SharedStoreTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_dir_ = new std::string(fwtest::MakeTempDir("shared-model") + "/aft");
    fwtest::WriteTinyCheckpoint(*model_dir_, "aft", 7);
  }
  static void TearDownTestSuite() { delete model_dir_; }

  void SetUp() override {
    RedisServer::Options options;
    options.appendonly = true;
    auto redis = RedisServer::Start(options);
    ASSERT_TRUE(redis.ok()) << redis.status();
    redis_ = std::move(*redis);
  }

  CoreOptions Options(const std::string& store) const {
    CoreOptions options;
    options.model_dirs = {*model_dir_};
    options.session_store = store;
    options.session_store_timeout = absl::Milliseconds(500);
    options.session_lease_ttl = absl::Seconds(2);
    return options;
  }

  std::unique_ptr<Harness> StartReplica() { return Harness::Start(Options(redis_->spec())); }

  // The value of counter `name` with label `key`=`value` (0 if absent).
  static double Counter(Harness& h, const std::string& name, const std::string& key,
                        const std::string& value) {
    for (const auto& family : h.metrics().registry()->Collect()) {
      if (family.name != name) continue;
      for (const auto& metric : family.metric) {
        for (const auto& label : metric.label) {
          if (label.name == key && label.value == value) return metric.counter.value;
        }
      }
    }
    return 0;
  }

  static std::string* model_dir_;
  std::unique_ptr<RedisServer> redis_;
};

std::string* SharedStoreTest::model_dir_ = nullptr;

TEST_F(SharedStoreTest, TurnsHopBetweenServersAndMatchOneServer) {
  auto a = StartReplica();
  auto b = StartReplica();
  auto reference = Harness::Start(Options("memory"));
  auto shared = a->client().CreateSession("", "ROMEO: ");
  auto local = reference->client().CreateSession("", "ROMEO: ");
  ASSERT_TRUE(shared.ok()) << shared.status();
  ASSERT_TRUE(local.ok()) << local.status();
  Harness* turns[] = {b.get(), a.get(), a.get(), b.get(), a.get()};
  int64_t tokens = shared->tokens();
  for (int turn = 0; turn < 5; ++turn) {
    const std::string prompt = " turn " + std::to_string(turn) + ":";
    auto got = turns[turn]->client().Generate(GreedyRequest(prompt, 12, shared->session_id()));
    auto want = reference->client().Generate(GreedyRequest(prompt, 12, local->session_id()));
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->token_ids, want->token_ids) << "turn " << turn;
    tokens += static_cast<int64_t>(prompt.size()) + 12;
    EXPECT_EQ(got->usage.session_tokens(), tokens);
  }
  // From either server, the store's view.
  auto seen_by_b = b->client().GetSession(shared->session_id());
  ASSERT_TRUE(seen_by_b.ok()) << seen_by_b.status();
  EXPECT_EQ(seen_by_b->tokens(), tokens);
  // Cache: a's turns 1 (b had changed it), 4 (b changed it) miss, turn 2 hits; b's
  // turn 0 and 3 miss (a changed it in between).
  EXPECT_EQ(Counter(*a, "fwserve_session_cache_lookups_total", "result", "hit"), 1);
  EXPECT_EQ(Counter(*a, "fwserve_session_cache_lookups_total", "result", "miss"), 2);
  EXPECT_EQ(Counter(*b, "fwserve_session_cache_lookups_total", "result", "miss"), 2);
  // Deleted on one server, gone on the other.
  ASSERT_TRUE(b->client().DeleteSession(shared->session_id()).ok());
  auto gone = a->client().Generate(GreedyRequest("x", 1, shared->session_id()));
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
}

TEST_F(SharedStoreTest, BusySessionIsAbortedOnAnotherServer) {
  // a's engine holds the request's decode steps after its first until b has looked, so
  // a's request is still running (and holds the lease) whatever the machine's speed.
  std::atomic<bool> streaming{false};
  std::atomic<bool> armed{false};
  std::atomic<int> steps{0};
  std::atomic<bool> b_done{false};
  CoreOptions a_options = Options(redis_->spec());
  a_options.engine.before_decode_step_for_testing = [&](const std::function<bool()>& ending) {
    if (!armed.load() || ++steps < 2) return;
    while (!b_done.load() && !ending()) absl::SleepFor(absl::Milliseconds(1));
  };
  auto a = Harness::Start(a_options);
  auto b = StartReplica();
  auto session = a->client().CreateSession("", "x");
  ASSERT_TRUE(session.ok()) << session.status();
  absl::Status a_status;
  int64_t a_tokens = 0;
  armed = true;
  std::thread long_request([&] {
    auto result = a->client().Generate(GreedyRequest("y", 40, session->session_id()),
                                       [&](const v1::GenerateResponse&) {
                                         streaming = true;
                                         return true;
                                       });
    a_status = result.status();
    if (result.ok()) a_tokens = result->usage.session_tokens();
  });
  while (!streaming.load()) absl::SleepFor(absl::Milliseconds(5));
  auto busy = b->client().Generate(GreedyRequest("z", 1, session->session_id()));
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kAborted) << busy.status();
  EXPECT_TRUE(absl::StrContains(busy.status().message(), "busy")) << busy.status();
  auto seen_by_b = b->client().GetSession(session->session_id());
  ASSERT_TRUE(seen_by_b.ok()) << seen_by_b.status();
  EXPECT_TRUE(seen_by_b->busy());
  b_done = true;
  long_request.join();
  // a's request was not disturbed by b's refused one: it ran to its end and committed.
  EXPECT_TRUE(a_status.ok()) << a_status;
  EXPECT_EQ(a_tokens, 1 + 1 + 40);
  EXPECT_EQ(Counter(*b, "fwserve_session_lease_conflicts_total", "op", "acquire"), 1);
}

TEST_F(SharedStoreTest, WriteOfALostLeaseIsRefused) {
  std::atomic<int> received{0};
  std::atomic<bool> b_done{false};
  // a's engine holds every decode step until b has committed: its first token (sampled
  // after the prefill, no step needed) reaches the client, and nothing more is computed.
  // gRPC buffers a's messages, so a blocked client alone does not keep a fast server from
  // finishing (and committing) before the lease is taken away; nor did holding the steps
  // only from the first token the client received: on a loaded machine the server
  // finished all 400 tokens before the client's first callback ran.
  CoreOptions a_options = Options(redis_->spec());
  a_options.engine.before_decode_step_for_testing = [&](const std::function<bool()>& ending) {
    while (!b_done.load() && !ending()) absl::SleepFor(absl::Milliseconds(1));
  };
  auto a = Harness::Start(a_options);
  auto b = StartReplica();
  auto session = a->client().CreateSession("", "x");
  ASSERT_TRUE(session.ok()) << session.status();
  const std::string id = session->session_id();
  absl::Status a_status;
  std::thread long_request([&] {
    auto result =
        a->client().Generate(GreedyRequest("y", 400, id), [&](const v1::GenerateResponse&) {
          ++received;
          // Hold a's request open until b has committed.
          while (received.load() == 1 && !b_done.load()) absl::SleepFor(absl::Milliseconds(5));
          return true;
        });
    a_status = result.status();
  });
  while (received.load() == 0) absl::SleepFor(absl::Milliseconds(5));
  // a's lease disappears (as if it had expired while a was paused past it).
  ASSERT_TRUE(redis_->Command({"DEL", "fws:{" + id + "}:lease"}).ok());
  auto b_turn = b->client().Generate(GreedyRequest(" b", 5, id));
  ASSERT_TRUE(b_turn.ok()) << b_turn.status();
  const int64_t b_tokens = b_turn->usage.session_tokens();
  b_done = true;
  long_request.join();
  EXPECT_EQ(a_status.code(), absl::StatusCode::kAborted) << a_status;
  EXPECT_TRUE(absl::StrContains(a_status.message(), "lost its lease")) << a_status;
  auto after = b->client().GetSession(id);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->tokens(), b_tokens);
  // And a serves the session again, from b's state.
  auto next = a->client().Generate(GreedyRequest(" a", 3, id));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->usage.session_tokens(), b_tokens + 2 + 3);
}

TEST_F(SharedStoreTest, ACachedCopyOfALostCommitIsNotServed) {
  auto a = StartReplica();
  auto b = StartReplica();
  auto session = a->client().CreateSession("", "x");
  ASSERT_TRUE(session.ok()) << session.status();
  const std::string id = session->session_id();
  const std::string key = "fws:{" + id + "}:s";
  auto version_1 = redis_->Command({"DUMP", key});
  ASSERT_TRUE(version_1.ok()) << version_1.status();
  auto lost = a->client().Generate(GreedyRequest(" a long turn", 5, id));  // version 2 on a
  ASSERT_TRUE(lost.ok()) << lost.status();
  // Redis loses that commit (a failover to a replica that never received it).
  ASSERT_TRUE(redis_->Command({"RESTORE", key, "0", *version_1, "REPLACE"}).ok());
  auto other = b->client().Generate(GreedyRequest(" b", 5, id));  // version 2 again, on b
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->usage.session_tokens(), 1 + 2 + 5);
  // a holds "version 2" too, but of the lost timeline: it must load b's.
  auto next = a->client().Generate(GreedyRequest(" c", 3, id));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->usage.session_tokens(), 1 + 2 + 5 + 2 + 3);
}

TEST_F(SharedStoreTest, RedisDownIsUnavailableAndRecovers) {
  auto a = StartReplica();
  auto session = a->client().CreateSession("", "x");
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE(redis_->Stop().ok());

  auto throwaway = a->client().Generate(GreedyRequest("hello", 5));
  EXPECT_TRUE(throwaway.ok()) << throwaway.status();
  const absl::Time start = absl::Now();
  auto turn = a->client().Generate(GreedyRequest("y", 5, session->session_id()));
  // Refused, not hung until Redis comes back (a hang guard, not a speed bound).
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));
  EXPECT_EQ(turn.status().code(), absl::StatusCode::kUnavailable) << turn.status();
  EXPECT_TRUE(absl::StrContains(turn.status().message(), "session store unavailable"))
      << turn.status();
  EXPECT_FALSE(absl::StrContains(turn.status().message(), "127.0.0.1")) << "leaks the host";
  auto create = a->client().CreateSession("", "x");
  EXPECT_EQ(create.status().code(), absl::StatusCode::kUnavailable) << create.status();
  // A session that was not created is not "a result that may not have been saved".
  EXPECT_TRUE(absl::StrContains(create.status().message(), "session store unavailable"))
      << create.status();
  EXPECT_FALSE(absl::StrContains(create.status().message(), "may not have been saved"))
      << create.status();

  ASSERT_TRUE(redis_->Restart().ok());
  absl::StatusOr<fwserve::GenerateResult> again = absl::UnavailableError("not tried");
  for (int attempt = 0; attempt < 50 && !again.ok(); ++attempt) {
    again = a->client().Generate(GreedyRequest("y", 5, session->session_id()));
    if (!again.ok()) absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->usage.session_tokens(), 1 + 1 + 5);
}

TEST_F(SharedStoreTest, ListPagesSessionsOfEveryServer) {
  auto a = StartReplica();
  auto b = StartReplica();
  std::set<std::string> created;
  for (int i = 0; i < 12; ++i) {
    auto session = (i % 2 == 0 ? a : b)->client().CreateSession("", "");
    ASSERT_TRUE(session.ok()) << session.status();
    created.insert(session->session_id());
  }
  std::set<std::string> listed;
  std::string token;
  int pages = 0;
  do {
    auto page = a->client().ListSessions("", 5, token);
    ASSERT_TRUE(page.ok()) << page.status();
    EXPECT_LE(page->sessions_size(), 5);
    for (const auto& s : page->sessions()) EXPECT_TRUE(listed.insert(s.session_id()).second);
    token = page->next_page_token();
    ASSERT_LT(++pages, 10);
  } while (!token.empty());
  EXPECT_EQ(listed, created);
  auto bad = a->client().ListSessions("", 5, "not-a-token");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
}

}  // namespace
}  // namespace fwserve
