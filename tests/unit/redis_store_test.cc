// The redis:// session store (RedisSessionStore) against a real redis-server started
// for each test on a free loopback port (tests/common/redis_server.h). Without
// redis-server the tests fail, they do not skip. Timing assertions have wide margins
// (a loaded 2-core machine): they separate "about the timeout" from "many timeouts".
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/sessions/store/redis_session_store.h"
#include "server/base/session_id.h"
#include "server/sessions/store/session_store.h"
#include "tests/common/redis_server.h"

namespace fwserve {
namespace {

constexpr absl::Duration kLease = absl::Seconds(10);
constexpr char kUnavailablePrefix[] = "session store unavailable: ";

std::string TempFile(const std::string& tag, const std::string& content) {
  std::string pattern =
      (std::filesystem::temp_directory_path() / ("fwserve-redis-test-" + tag + "-XXXXXX")).string();
  const int fd = mkstemp(pattern.data());
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(pattern) << content;
  return pattern;
}

StoredSessionInfo Info(const std::string& id, const std::string& model, int64_t created_ms) {
  StoredSessionInfo info;
  info.id = id;
  info.model = model;
  info.tokens = 7;
  info.created = absl::FromUnixMillis(created_ms);
  info.last_used = absl::FromUnixMillis(created_ms + 5);
  return info;
}

std::unique_ptr<RedisSessionStore> OpenStore(const std::string& spec,
                                             SessionStoreOptions options = {}) {
  auto store = OpenSessionStore(spec, options);
  EXPECT_TRUE(store.ok()) << store.status();
  if (!store.ok()) return nullptr;
  auto* redis = dynamic_cast<RedisSessionStore*>(store->release());
  EXPECT_NE(redis, nullptr) << spec;
  return std::unique_ptr<RedisSessionStore>(redis);
}

class RedisStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = RedisServer::Start();
    ASSERT_TRUE(server.ok()) << server.status();
    redis_ = std::move(*server);
    store_ = OpenStore(redis_->spec());
    ASSERT_NE(store_, nullptr);
  }

  // Creates a session of `model` with blob "blob-<id>".
  std::string Create(RedisSessionStore& store, const std::string& model = "m",
                     int64_t created_ms = 1700000000000) {
    const std::string id = NewSessionId();
    EXPECT_TRUE(store.CreateSession(Info(id, model, created_ms), "blob-" + id).ok());
    return id;
  }

  std::unique_ptr<RedisServer> redis_;
  std::unique_ptr<RedisSessionStore> store_;
};

TEST_F(RedisStoreTest, CreateThenAcquireReturnsTheBlobOnlyOnAVersionMismatch) {
  const std::string id = NewSessionId();
  const std::string blob(100000, '\0');  // binary-safe, and not small
  ASSERT_TRUE(store_->CreateSession(Info(id, "tiny", 1700000000123), blob).ok());
  EXPECT_EQ(store_->CreateSession(Info(id, "tiny", 1700000000123), "other").code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(store_->CreateSession(Info("not-an-id", "tiny", 1), "x").code(),
            absl::StatusCode::kInvalidArgument);

  // A miss: no resident copy.
  auto miss = store_->AcquireLease(id, kLease, 0, "");
  ASSERT_TRUE(miss.ok()) << miss.status();
  EXPECT_EQ(miss->token.size(), 32u);
  EXPECT_TRUE(IsWellFormedSessionId(miss->token));
  EXPECT_EQ(miss->info.id, id);
  EXPECT_EQ(miss->info.model, "tiny");
  EXPECT_EQ(miss->info.tokens, 7);
  EXPECT_EQ(miss->info.version, 1);
  EXPECT_EQ(miss->info.created, absl::FromUnixMillis(1700000000123));
  EXPECT_EQ(miss->info.last_used, absl::FromUnixMillis(1700000000128));
  ASSERT_TRUE(miss->blob.has_value());
  EXPECT_EQ(*miss->blob, blob);
  ASSERT_TRUE(store_->ReleaseLease(id, miss->token).ok());

  // A hit: the caller holds version 1.
  auto hit = store_->AcquireLease(id, kLease, 1, "");
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_FALSE(hit->blob.has_value());
  EXPECT_EQ(hit->info.version, 1);
  EXPECT_NE(hit->token, miss->token);
  ASSERT_TRUE(store_->ReleaseLease(id, hit->token).ok());

  // A stale copy (version 5 is not the store's) is a miss too.
  auto stale = store_->AcquireLease(id, kLease, 5, "");
  ASSERT_TRUE(stale.ok());
  EXPECT_TRUE(stale->blob.has_value());

  // The key layout of shared_session_store.h, with the session's TTL set.
  EXPECT_EQ(store_->SessionKey(id), "fws:{" + id + "}:s");
  EXPECT_EQ(*redis_->Command({"GET", store_->LeaseKey(id)}), stale->token);
  EXPECT_EQ(*redis_->Command({"HGET", store_->SessionKey(id), "created"}), "1700000000123");
  const int64_t ttl_ms = std::stoll(*redis_->Command({"PTTL", store_->SessionKey(id)}));
  EXPECT_GT(ttl_ms, 23 * 3600 * 1000);
  EXPECT_LE(ttl_ms, 24 * 3600 * 1000);
  EXPECT_EQ(*redis_->Command({"ZRANGE", "fws:index", "0", "-1"}), "1700000000123:" + id);
  EXPECT_EQ(*redis_->Command({"ZSCORE", "fws:index", "1700000000123:" + id}), "0");
}

TEST_F(RedisStoreTest, ABusySessionIsAbortedUntilReleased) {
  const std::string id = Create(*store_);
  auto first = store_->AcquireLease(id, kLease, 0, "");
  ASSERT_TRUE(first.ok());
  auto second = store_->AcquireLease(id, kLease, 0, "");
  ASSERT_EQ(second.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(second.status().message(), "session_id '" + id + "' is busy with another request");
  // Releasing with somebody else's token is OK but releases nothing.
  EXPECT_TRUE(store_->ReleaseLease(id, NewSessionId()).ok());
  EXPECT_EQ(store_->AcquireLease(id, kLease, 0, "").status().code(), absl::StatusCode::kAborted);
  ASSERT_TRUE(store_->ReleaseLease(id, first->token).ok());
  EXPECT_TRUE(store_->ReleaseLease(id, first->token).ok());  // twice: still OK
  EXPECT_TRUE(store_->AcquireLease(id, kLease, 0, "").ok());
}

TEST_F(RedisStoreTest, CommitBumpsTheVersionAndEndsTheLease) {
  const std::string id = Create(*store_);
  auto grant = store_->AcquireLease(id, kLease, 0, "");
  ASSERT_TRUE(grant.ok());
  // Fenced: a wrong token or a wrong version writes nothing.
  EXPECT_EQ(store_->CommitLeased(id, NewSessionId(), 1, "x", 1, absl::Now()).status().code(),
            absl::StatusCode::kAborted);
  auto wrong_version = store_->CommitLeased(id, grant->token, 3, "x", 1, absl::Now());
  EXPECT_EQ(wrong_version.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(*store_->Get(id), "blob-" + id);
  // A refused write also ends the lease it held (the session is not left busy).
  grant = store_->AcquireLease(id, kLease, 0, "");
  ASSERT_TRUE(grant.ok()) << grant.status();

  const absl::Time used = absl::FromUnixMillis(1800000000456);
  auto version = store_->CommitLeased(id, grant->token, 1, "state-2", 42, used);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 2);
  // The lease ended: the same token cannot commit again, and a new request gets in.
  EXPECT_EQ(store_->CommitLeased(id, grant->token, 2, "x", 1, used).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(*redis_->Command({"EXISTS", store_->LeaseKey(id)}), "0");
  auto next = store_->AcquireLease(id, kLease, 1, "");  // holds version 1: a miss
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->info.version, 2);
  EXPECT_EQ(next->info.tokens, 42);
  EXPECT_EQ(next->info.last_used, used);
  EXPECT_EQ(next->info.model, "m");
  ASSERT_TRUE(next->blob.has_value());
  EXPECT_EQ(*next->blob, "state-2");
  EXPECT_EQ(*store_->CommitLeased(id, next->token, 2, "state-3", 43, used), 3);
  auto info = store_->GetInfo(id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->version, 3);
  EXPECT_EQ(info->tokens, 43);
}

TEST_F(RedisStoreTest, ACommitAfterTheLeaseExpiredAndWasTakenIsRefused) {
  const std::string id = Create(*store_);
  auto slow = store_->AcquireLease(id, absl::Milliseconds(100), 0, "");
  ASSERT_TRUE(slow.ok());
  absl::SleepFor(absl::Milliseconds(400));  // the writer stalls past its lease
  auto fast = store_->AcquireLease(id, kLease, 0, "");
  ASSERT_TRUE(fast.ok()) << fast.status();
  auto late = store_->CommitLeased(id, slow->token, 1, "stale write", 99, absl::Now());
  ASSERT_EQ(late.status().code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(absl::StrContains(late.status().message(), "lost its lease")) << late.status();
  EXPECT_EQ(*store_->Get(id), "blob-" + id);
  EXPECT_EQ(store_->GetInfo(id)->version, 1);
  EXPECT_EQ(store_->GetInfo(id)->tokens, 7);
  EXPECT_EQ(store_->RenewLease(id, slow->token, kLease).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(store_->DeleteLeased(id, slow->token).code(), absl::StatusCode::kAborted);
  // The new holder's commit goes through.
  EXPECT_EQ(*store_->CommitLeased(id, fast->token, 1, "fresh", 8, absl::Now()), 2);
  EXPECT_EQ(*store_->Get(id), "fresh");
}

TEST_F(RedisStoreTest, RenewKeepsALeaseAlivePastItsTtl) {
  // Redis's own clock expires leases, so the test reads the lease key's remaining time
  // (PTTL) instead of racing renewals against a short TTL.
  const std::string id = Create(*store_);
  const absl::Duration ttl = absl::Milliseconds(1000);
  auto grant = store_->AcquireLease(id, ttl, 0, "");
  ASSERT_TRUE(grant.ok());
  auto pttl = [&] { return std::stoll(*redis_->Command({"PTTL", store_->LeaseKey(id)})); };
  EXPECT_GT(pttl(), 0);
  EXPECT_LE(pttl(), 1000);
  // A renewal sets the lease's time to the new TTL: it now outlives the first one.
  ASSERT_TRUE(store_->RenewLease(id, grant->token, absl::Seconds(60)).ok());
  EXPECT_GT(pttl(), 1000);
  absl::SleepFor(absl::Milliseconds(1500));  // past the first TTL: still held
  EXPECT_EQ(store_->AcquireLease(id, kLease, 0, "").status().code(), absl::StatusCode::kAborted);
  ASSERT_TRUE(store_->RenewLease(id, grant->token, ttl).ok());
  EXPECT_LE(pttl(), 1000);
  auto wrong = store_->RenewLease(id, NewSessionId(), ttl);
  EXPECT_EQ(wrong.code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(absl::StrContains(wrong.message(), "lost its lease")) << wrong;
  // Without renewals it lapses (waited for as an event; 30 s only catches a hang).
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (pttl() != -2 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(pttl(), -2) << "the lease key never expired";
  EXPECT_EQ(store_->RenewLease(id, grant->token, ttl).code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(store_->AcquireLease(id, kLease, 0, "").ok());
}

TEST_F(RedisStoreTest, DeleteLeasedIsFenced) {
  const std::string id = Create(*store_, "m", 1700000000001);
  auto grant = store_->AcquireLease(id, kLease, 0, "");
  ASSERT_TRUE(grant.ok());
  EXPECT_EQ(store_->DeleteLeased(id, NewSessionId()).code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(store_->GetInfo(id).ok());
  ASSERT_TRUE(store_->DeleteLeased(id, grant->token).ok());
  EXPECT_EQ(store_->GetInfo(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*redis_->Command({"EXISTS", store_->SessionKey(id), store_->LeaseKey(id)}), "0");
  EXPECT_EQ(*redis_->Command({"ZCARD", "fws:index"}), "0");

  // The unfenced Delete of SessionStore (tools): also removes lease and index entry.
  const std::string other = Create(*store_);
  ASSERT_TRUE(store_->AcquireLease(other, kLease, 0, "").ok());
  ASSERT_TRUE(store_->Delete(other).ok());
  EXPECT_EQ(*redis_->Command({"EXISTS", store_->SessionKey(other), store_->LeaseKey(other)}), "0");
  EXPECT_EQ(*redis_->Command({"ZCARD", "fws:index"}), "0");
  EXPECT_TRUE(store_->Delete(other).ok());  // absent: OK
}

TEST_F(RedisStoreTest, UnknownSessionsAreNotFound) {
  const std::string id = NewSessionId();
  const std::string message = "session_id '" + id + "' not found";
  auto acquire = store_->AcquireLease(id, kLease, 0, "");
  EXPECT_EQ(acquire.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(acquire.status().message(), message);
  EXPECT_EQ(store_->GetInfo(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Get(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Get(id).status().message(), message);
  // No lease was left behind by the failed acquire.
  EXPECT_EQ(*redis_->Command({"EXISTS", store_->LeaseKey(id)}), "0");
  EXPECT_EQ(store_->RenewLease(id, NewSessionId(), kLease).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(store_->CommitLeased(id, NewSessionId(), 1, "x", 1, absl::Now()).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(*redis_->Command({"EXISTS", store_->SessionKey(id)}), "0");
}

TEST_F(RedisStoreTest, IdleSessionsExpireAndUseRefreshesTheTtl) {
  SessionStoreOptions short_ttl;
  short_ttl.session_ttl = absl::Milliseconds(300);
  auto store = OpenStore(redis_->spec(), short_ttl);
  const std::string id = Create(*store);
  EXPECT_TRUE(store->GetInfo(id).ok());
  absl::SleepFor(absl::Seconds(1));
  EXPECT_EQ(store->GetInfo(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->AcquireLease(id, kLease, 0, "").status().code(), absl::StatusCode::kNotFound);

  // Acquire and commit push the expiry out.
  SessionStoreOptions one_second;
  one_second.session_ttl = absl::Seconds(1);
  store = OpenStore(redis_->spec(), one_second);
  const std::string used = Create(*store);
  const absl::Time start = absl::Now();
  int64_t version = 1;
  while (absl::Now() - start < absl::Milliseconds(2500)) {
    absl::SleepFor(absl::Milliseconds(150));
    auto grant = store->AcquireLease(used, kLease, version, "");
    ASSERT_TRUE(grant.ok()) << grant.status();
    auto committed = store->CommitLeased(used, grant->token, version, "s", 1, absl::Now());
    ASSERT_TRUE(committed.ok()) << committed.status();
    version = *committed;
  }
  EXPECT_TRUE(store->GetInfo(used).ok());
}

class RedisListTest : public RedisStoreTest {
 protected:
  // `n` sessions, models "a" (even i) and "b" (odd i), created at base+i ms, made in a
  // shuffled order (the listing follows creation times, not insertion).
  std::vector<std::string> CreateMany(int n) {
    std::vector<std::string> ids;
    for (int i = 0; i < n; ++i) ids.push_back(NewSessionId());
    std::vector<int> order(n);
    for (int i = 0; i < n; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937(7));
    for (int i : order) {
      EXPECT_TRUE(store_->CreateSession(Info(ids[i], i % 2 == 0 ? "a" : "b", kBase + i), "b").ok());
    }
    return ids;
  }

  // Every page of `model`; checks page sizes and tokens along the way.
  std::vector<std::string> ListAll(const std::string& model, int page_size, int* pages) {
    std::vector<std::string> seen;
    std::string token;
    *pages = 0;
    do {
      auto page = store_->List(model, "", page_size, token);
      EXPECT_TRUE(page.ok()) << page.status();
      if (!page.ok()) break;
      EXPECT_LE(static_cast<int>(page->sessions.size()), std::clamp(page_size, 1, 1000));
      for (const auto& info : page->sessions) {
        if (!model.empty()) {
          EXPECT_EQ(info.model, model);
        }
        EXPECT_GE(info.version, 1);
        seen.push_back(info.id);
      }
      token = page->next_page_token;
      ++*pages;
      EXPECT_LT(*pages, 1000);
    } while (!token.empty() && *pages < 1000);
    return seen;
  }

  static constexpr int64_t kBase = 1700000000000;
};

TEST_F(RedisListTest, PagesInCreationOrderFilteredByModel) {
  const std::vector<std::string> ids = CreateMany(250);
  int pages = 0;
  EXPECT_EQ(ListAll("", 100, &pages), ids);
  EXPECT_EQ(pages, 3);
  std::vector<std::string> a, b;
  for (size_t i = 0; i < ids.size(); ++i) (i % 2 == 0 ? a : b).push_back(ids[i]);
  EXPECT_EQ(ListAll("a", 100, &pages), a);
  EXPECT_EQ(pages, 2);
  EXPECT_EQ(ListAll("b", 100, &pages), b);
  EXPECT_EQ(ListAll("c", 100, &pages), std::vector<std::string>());

  auto first = store_->List("", "", 100, "");
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->sessions.size(), 100u);
  EXPECT_EQ(first->next_page_token, absl::StrCat(kBase + 99, ":", ids[99]));
  EXPECT_EQ(first->sessions[0].created, absl::FromUnixMillis(kBase));
  EXPECT_EQ(first->sessions[0].model, "a");
  EXPECT_EQ(first->sessions[1].model, "b");

  // page_size is clamped to 1..1000.
  auto all = store_->List("", "", 5000, "");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->sessions.size(), 250u);
  EXPECT_EQ(all->next_page_token, "");
  auto one = store_->List("", "", 0, "");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->sessions.size(), 1u);
  EXPECT_FALSE(one->next_page_token.empty());

  for (const std::string& bad :
       {std::string("garbage"), absl::StrCat(kBase, ":", ids[0]).substr(1),
        absl::StrCat(kBase, ":", std::string(32, 'A')), absl::StrCat(kBase, "-", ids[0]),
        absl::StrCat(kBase, ":", ids[0], "x")}) {
    auto page = store_->List("", "", 10, bad);
    EXPECT_EQ(page.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(page.status().message(), "page_token is malformed");
  }

  int visited = 0;
  std::set<std::string> each;
  ASSERT_TRUE(store_
                  ->ForEachId([&](const std::string& id) {
                    each.insert(id);
                    return ++visited < 1000;
                  })
                  .ok());
  EXPECT_EQ(each, std::set<std::string>(ids.begin(), ids.end()));
  visited = 0;
  ASSERT_TRUE(store_->ForEachId([&](const std::string&) { return ++visited < 3; }).ok());
  EXPECT_EQ(visited, 3);
}

TEST_F(RedisListTest, StaleIndexEntriesAreSkippedAndRemoved) {
  const std::vector<std::string> ids = CreateMany(250);
  std::vector<std::string> live;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i % 8 == 3) {  // as if expired: the hash is gone, its index entry is not
      ASSERT_EQ(*redis_->Command({"DEL", store_->SessionKey(ids[i])}), "1");
    } else {
      live.push_back(ids[i]);
    }
  }
  // Junk that is not even an index member's shape.
  ASSERT_TRUE(redis_->Command({"ZADD", "fws:index", "0", "junk"}).ok());
  int pages = 0;
  EXPECT_EQ(ListAll("", 100, &pages), live);
  EXPECT_EQ(*redis_->Command({"ZCARD", "fws:index"}), absl::StrCat(live.size()));
}

TEST_F(RedisListTest, AHugeStaleRunDoesNotMakeOneCallExamineEverything) {
  const std::vector<std::string> before = {Create(*store_, "m", kBase + 1),
                                           Create(*store_, "m", kBase + 2)};
  // 5000 stale entries between them and the next live session.
  std::vector<std::string> zadd = {"ZADD", "fws:index"};
  for (int i = 0; i < 5000; ++i) {
    zadd.push_back("0");
    zadd.push_back(absl::StrCat(kBase + 10 + i, ":", NewSessionId()));
  }
  ASSERT_EQ(*redis_->Command(zadd), "5000");
  const std::string after = Create(*store_, "m", kBase + 100000);
  auto page = store_->List("", "", 10, "");
  ASSERT_TRUE(page.ok());
  ASSERT_EQ(page->sessions.size(), 2u);
  EXPECT_FALSE(page->next_page_token.empty());  // cut short by the work bound
  const int64_t left = std::stoll(*redis_->Command({"ZCARD", "fws:index"}));
  EXPECT_GT(left, 3);         // did not clean everything in one call
  EXPECT_LT(left, 5000 + 3);  // but cleaned what it examined
  // From the token on, only `after` remains.
  std::vector<std::string> rest;
  std::string token = page->next_page_token;
  int calls = 0;
  while (!token.empty() && ++calls < 1000) {
    auto next = store_->List("", "", 10, token);
    ASSERT_TRUE(next.ok());
    for (const auto& info : next->sessions) rest.push_back(info.id);
    token = next->next_page_token;
  }
  EXPECT_GT(calls, 5);  // the stale run took several bounded calls
  const std::vector<std::string> expected = {after};
  EXPECT_EQ(rest, expected);
  EXPECT_EQ(*redis_->Command({"ZCARD", "fws:index"}), "3");
  int pages = 0;
  EXPECT_EQ(ListAll("", 10, &pages), (std::vector<std::string>{before[0], before[1], after}));
  EXPECT_EQ(pages, 1);
}

TEST_F(RedisStoreTest, PutAndGetForTools) {
  const std::string id = NewSessionId();
  ASSERT_TRUE(store_->Put(id, "one").ok());
  EXPECT_EQ(*store_->Get(id), "one");
  auto info = store_->GetInfo(id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version, 1);
  EXPECT_EQ(info->model, "");
  ASSERT_TRUE(store_->Put(id, "two").ok());
  EXPECT_EQ(*store_->Get(id), "two");
  EXPECT_EQ(store_->GetInfo(id)->version, 2);
  EXPECT_EQ(store_->Put("../x", "y").code(), absl::StatusCode::kInvalidArgument);
  auto page = store_->List("", "", 10, "");
  ASSERT_TRUE(page.ok());
  ASSERT_EQ(page->sessions.size(), 1u);
  EXPECT_EQ(page->sessions[0].id, id);
}

TEST_F(RedisStoreTest, KeyPrefixesSeparateDeployments) {
  SessionStoreOptions other;
  other.key_prefix = "other:";
  auto second = OpenStore(redis_->spec(), other);
  const std::string id = Create(*store_);
  EXPECT_EQ(second->GetInfo(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(second->List("", "", 10, "")->sessions.size(), 0u);
  EXPECT_EQ(second->SessionKey(id), "other:{" + id + "}:s");
}

TEST_F(RedisStoreTest, ScriptsSurviveAScriptFlush) {
  const std::string id = Create(*store_);
  ASSERT_EQ(*redis_->Command({"SCRIPT", "FLUSH"}), "OK");
  auto grant = store_->AcquireLease(id, kLease, 0, "");  // EVALSHA: NOSCRIPT, then EVAL
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_EQ(*store_->CommitLeased(id, grant->token, 1, "x", 1, absl::Now()), 2);
}

TEST_F(RedisStoreTest, ObserverSeesEveryOperation) {
  std::mutex mu;
  std::vector<std::pair<std::string, absl::StatusCode>> seen;
  SessionStoreOptions options;
  options.observer = [&](const char* op, absl::Duration took, const absl::Status& status) {
    EXPECT_GE(took, absl::ZeroDuration());
    std::lock_guard<std::mutex> lock(mu);
    seen.emplace_back(op, status.code());
  };
  auto store = OpenStore(redis_->spec(), options);
  const std::string id = NewSessionId();
  ASSERT_TRUE(store->CreateSession(Info(id, "m", 1), "b").ok());
  auto grant = store->AcquireLease(id, kLease, 0, "");
  ASSERT_TRUE(grant.ok());
  (void)store->AcquireLease(id, kLease, 0, "");
  (void)store->RenewLease(id, grant->token, kLease);
  (void)store->CommitLeased(id, grant->token, 1, "c", 1, absl::Now());
  (void)store->ReleaseLease(id, grant->token);
  (void)store->GetInfo(id);
  (void)store->Get(id);
  (void)store->Put(id, "p");
  (void)store->List("", "", 10, "");
  (void)store->DeleteLeased(id, grant->token);
  (void)store->Delete(id);
  using C = absl::StatusCode;
  const std::vector<std::pair<std::string, absl::StatusCode>> expected = {
      {"create", C::kOk}, {"acquire", C::kOk}, {"acquire", C::kAborted}, {"renew", C::kOk},
      {"commit", C::kOk}, {"release", C::kOk}, {"info", C::kOk},         {"get", C::kOk},
      {"put", C::kOk},    {"list", C::kOk},    {"delete", C::kAborted},  {"delete", C::kOk}};
  EXPECT_EQ(seen, expected);
}

TEST_F(RedisStoreTest, OneLeaseHolderAmongConcurrentRequests) {
  SessionStoreOptions options;
  options.pool_size = 2;  // fewer connections than threads: they wait their turn
  auto store = OpenStore(redis_->spec(), options);
  const std::string id = Create(*store);
  for (int round = 0; round < 10; ++round) {
    std::atomic<int> won{0}, busy{0};
    std::vector<std::string> tokens(6);
    std::vector<std::thread> threads;
    for (int t = 0; t < 6; ++t) {
      threads.emplace_back([&, t] {
        auto grant = store->AcquireLease(id, kLease, 0, "");
        if (grant.ok()) {
          ++won;
          tokens[t] = grant->token;
        } else if (grant.status().code() == absl::StatusCode::kAborted) {
          ++busy;
        } else {
          ADD_FAILURE() << grant.status();
        }
      });
    }
    for (auto& thread : threads) thread.join();
    EXPECT_EQ(won.load(), 1);
    EXPECT_EQ(busy.load(), 5);
    for (const auto& token : tokens) {
      if (!token.empty()) {
        ASSERT_TRUE(store->ReleaseLease(id, token).ok());
      }
    }
  }
}

// Redis drops a connection mid-write (a bulk string over proto-max-bulk-len): an error
// for that call (with SIGPIPE blocked around writes, never a signal), and the next call
// works on a new connection.
TEST_F(RedisStoreTest, AConnectionDroppedMidWriteIsAnErrorNotASignal) {
  ASSERT_EQ(*redis_->Command({"CONFIG", "SET", "proto-max-bulk-len", "1048576"}), "OK");
  const std::string id = Create(*store_);
  auto grant = store_->AcquireLease(id, kLease, 0, "");
  ASSERT_TRUE(grant.ok());
  const std::string huge(32 << 20, 'x');
  for (int i = 0; i < 3; ++i) {
    auto committed = store_->CommitLeased(id, grant->token, 1, huge, 1, absl::Now());
    EXPECT_FALSE(committed.ok());
  }
  // Nothing was written, and the store works on.
  EXPECT_EQ(*store_->Get(id), "blob-" + id);
  EXPECT_EQ(*store_->CommitLeased(id, grant->token, 1, "small", 1, absl::Now()), 2);
}

TEST(RedisStorePasswordTest, AuthenticatesWithThePasswordFile) {
  RedisServer::Options with_password;
  with_password.password = "pw-Secret-123";
  auto redis = RedisServer::Start(with_password);
  ASSERT_TRUE(redis.ok()) << redis.status();
  SessionStoreOptions right;
  right.password_file = TempFile("right", "pw-Secret-123\nsecond line ignored\n");
  auto store = OpenStore((*redis)->spec(), right);
  ASSERT_NE(store, nullptr);
  const std::string id = NewSessionId();
  ASSERT_TRUE(store->CreateSession(Info(id, "m", 1), "b").ok());
  EXPECT_EQ(*store->Get(id), "b");
  EXPECT_FALSE(absl::StrContains(store->Describe(), "pw-Secret"));

  SessionStoreOptions wrong;
  wrong.password_file = TempFile("wrong", "wrong-pw-456");
  auto refused = OpenStore((*redis)->spec(), wrong);
  ASSERT_NE(refused, nullptr);  // opening does not need Redis
  auto info = refused->GetInfo(id);
  ASSERT_EQ(info.status().code(), absl::StatusCode::kUnavailable);
  const std::string message(info.status().message());
  EXPECT_TRUE(absl::StartsWith(message, kUnavailablePrefix)) << message;
  EXPECT_TRUE(absl::StrContains(message, "authentication failed")) << message;
  EXPECT_FALSE(absl::StrContains(message, "wrong-pw-456")) << message;
  EXPECT_FALSE(absl::StrContains(message, "pw-Secret-123")) << message;

  auto anonymous = OpenStore((*redis)->spec());
  auto noauth = anonymous->GetInfo(id);
  EXPECT_EQ(noauth.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(noauth.status().message(), "authentication")) << noauth.status();

  for (const std::string& file : {std::string("/nonexistent/fwserve/pw"), TempFile("empty", "")}) {
    SessionStoreOptions unreadable;
    unreadable.password_file = file;
    auto opened = OpenSessionStore((*redis)->spec(), unreadable);
    ASSERT_EQ(opened.status().code(), absl::StatusCode::kInvalidArgument) << file;
    EXPECT_TRUE(absl::StrContains(opened.status().message(), "--session-store-password-file"));
  }
  for (const auto& file : {right.password_file, wrong.password_file}) std::remove(file.c_str());
}

TEST(RedisStoreFailureTest, ADownRedisFailsFast) {
  auto redis = RedisServer::Start();
  ASSERT_TRUE(redis.ok()) << redis.status();
  ASSERT_TRUE((*redis)->Stop().ok());
  // A long timeout: a call that waited for it instead of failing fast would take 20 s,
  // told apart from a slow machine by far.
  SessionStoreOptions options;
  options.timeout = absl::Seconds(20);
  const absl::Time open_start = absl::Now();
  auto store = OpenStore((*redis)->spec(), options);  // opening does not fail
  ASSERT_NE(store, nullptr);
  EXPECT_LT(absl::Now() - open_start, absl::Seconds(10));
  const absl::Time start = absl::Now();
  for (int i = 0; i < 20; ++i) {
    auto info = store->GetInfo(NewSessionId());
    ASSERT_EQ(info.status().code(), absl::StatusCode::kUnavailable);
    const std::string message(info.status().message());
    EXPECT_TRUE(absl::StartsWith(message, kUnavailablePrefix)) << message;
    EXPECT_TRUE(absl::StrContains(message, absl::StrCat("127.0.0.1:", (*redis)->port())))
        << message;
    EXPECT_TRUE(absl::StrContains(message, "Connection refused")) << message;
  }
  // 20 calls, none of which waited out the 20 s timeout ("Connection refused" above
  // already says none timed out).
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(RedisStoreFailureTest, ARestartedRedisIsUsedAgainWithoutReopening) {
  RedisServer::Options durable;
  durable.appendonly = true;
  auto redis = RedisServer::Start(durable);
  ASSERT_TRUE(redis.ok()) << redis.status();
  SessionStoreOptions options;
  options.timeout = absl::Milliseconds(500);
  auto store = OpenStore((*redis)->spec(), options);
  const std::string id = NewSessionId();
  ASSERT_TRUE(store->CreateSession(Info(id, "m", 1), "kept").ok());
  // Fill the pool with idle connections that the restart will break.
  {
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; ++i) threads.emplace_back([&] { (void)store->GetInfo(id); });
    for (auto& thread : threads) thread.join();
  }
  ASSERT_TRUE((*redis)->Stop().ok());
  auto down = store->GetInfo(id);
  EXPECT_EQ(down.status().code(), absl::StatusCode::kUnavailable) << down.status();
  ASSERT_TRUE((*redis)->Restart().ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<StoredSessionInfo> info = down;
  while (!info.ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    info = store->GetInfo(id);
  }
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version, 1);
  EXPECT_EQ(*store->Get(id), "kept");
  // Scripts are gone with the restart: EVAL brings them back.
  auto grant = store->AcquireLease(id, kLease, 0, "");
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_EQ(*store->CommitLeased(id, grant->token, 1, "after", 2, absl::Now()), 2);

  // A crash (SIGKILL) with idle connections open: UNAVAILABLE, no SIGPIPE.
  (*redis)->Kill();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(store->GetInfo(id).status().code(), absl::StatusCode::kUnavailable);
  }
}

TEST(RedisStoreFailureTest, APausedRedisIsUnavailableWithinAboutTheTimeout) {
  auto redis = RedisServer::Start();
  ASSERT_TRUE(redis.ok()) << redis.status();
  SessionStoreOptions options;
  options.timeout = absl::Milliseconds(500);
  auto store = OpenStore((*redis)->spec(), options);
  const std::string id = NewSessionId();
  ASSERT_TRUE(store->CreateSession(Info(id, "m", 1), "b").ok());
  (*redis)->Pause();
  for (int i = 0; i < 3; ++i) {
    const absl::Time start = absl::Now();
    auto info = store->GetInfo(id);
    const absl::Duration took = absl::Now() - start;
    ASSERT_EQ(info.status().code(), absl::StatusCode::kUnavailable) << info.status();
    EXPECT_TRUE(absl::StartsWith(info.status().message(), kUnavailablePrefix)) << info.status();
    EXPECT_LT(took, absl::Seconds(60)) << i;  // a hang guard: a paused Redis never answers
    if (i == 0) {  // a pooled connection: the command itself times out
      EXPECT_GE(took, absl::Milliseconds(400));
      EXPECT_TRUE(absl::StrContains(info.status().message(), "no answer within 500 ms"))
          << info.status();
    }
  }
  // Reconnecting backs off: in between, calls fail at once ("next attempt in") instead
  // of each waiting out a timeout.
  int fast = 0;
  for (int i = 0; i < 10; ++i) {
    auto info = store->GetInfo(id);
    ASSERT_EQ(info.status().code(), absl::StatusCode::kUnavailable);
    if (absl::StrContains(info.status().message(), "next attempt in")) ++fast;
  }
  EXPECT_GE(fast, 5);
  (*redis)->Resume();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<StoredSessionInfo> info = store->GetInfo(id);
  while (!info.ok() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    info = store->GetInfo(id);
  }
  ASSERT_TRUE(info.ok()) << info.status();
}

TEST(RedisStoreFailureTest, WaitingForAConnectionIsBoundedByTheTimeout) {
  auto redis = RedisServer::Start();
  ASSERT_TRUE(redis.ok()) << redis.status();
  // 2 s: the three threads start within far less, so the two that find the one
  // connection taken wait for it while the first waits out its command.
  SessionStoreOptions options;
  options.timeout = absl::Seconds(2);
  options.pool_size = 1;
  auto store = OpenStore((*redis)->spec(), options);
  const std::string id = NewSessionId();
  ASSERT_TRUE(store->CreateSession(Info(id, "m", 1), "b").ok());
  (*redis)->Pause();
  // Three callers, one connection: the first waits out its command, the others wait out
  // the pool; none waits for all the others in turn.
  std::vector<std::thread> threads;
  std::vector<absl::Duration> took(3);
  std::vector<absl::Status> status(3);
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      const absl::Time start = absl::Now();
      status[t] = store->GetInfo(id).status();
      took[t] = absl::Now() - start;
    });
  }
  for (auto& thread : threads) thread.join();
  (*redis)->Resume();
  // Each caller is refused by a timeout, and at least one by the pool's: a pool wait
  // without a deadline would have handed the connection on in turn (and every
  // refusal would be the command's or the reconnect backoff's).
  int pool_refusals = 0;
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(status[t].code(), absl::StatusCode::kUnavailable) << status[t];
    EXPECT_LT(took[t], absl::Seconds(60)) << t;  // a hang guard
    const bool pool = absl::StrContains(status[t].message(), "no free connection within 2000 ms");
    EXPECT_TRUE(pool || absl::StrContains(status[t].message(), "no answer within 2000 ms"))
        << status[t];
    pool_refusals += pool;
  }
  EXPECT_GE(pool_refusals, 1);
}

TEST(RedisSpecTest, OpenSessionStoreParsesRedisUrls) {
  auto redis = RedisServer::Start();
  ASSERT_TRUE(redis.ok()) << redis.status();
  const std::string base = absl::StrCat("redis://127.0.0.1:", (*redis)->port());
  auto db0 = OpenStore(base);
  ASSERT_NE(db0, nullptr);
  EXPECT_EQ(db0->Describe(), base + "/0");
  auto db3 = OpenStore(base + "/3");
  ASSERT_NE(db3, nullptr);
  EXPECT_EQ(db3->Describe(), base + "/3");
  const std::string id = NewSessionId();
  ASSERT_TRUE(db3->CreateSession(Info(id, "m", 1), "b").ok());
  EXPECT_TRUE(db3->GetInfo(id).ok());
  EXPECT_EQ(db0->GetInfo(id).status().code(), absl::StatusCode::kNotFound);

  // Nothing listens there: still opens (it reconnects by itself).
  auto nobody = OpenStore("redis://localhost:1");
  ASSERT_NE(nobody, nullptr);
  EXPECT_EQ(nobody->Describe(), "redis://localhost:1/0");
  auto v6 = ParseRedisSpec("redis://[::1]:6390/2");
  ASSERT_TRUE(v6.ok()) << v6.status();
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 6390);
  EXPECT_EQ(v6->db, 2);
  auto max = ParseRedisSpec("redis://cache-1.example_net:65535");
  ASSERT_TRUE(max.ok()) << max.status();
  EXPECT_EQ(max->db, 0);

  for (const char* bad :
       {"redis://", "redis://host", "redis://host:", "redis://:6379", "redis://host:0",
        "redis://host:65536", "redis://host:99999999999", "redis://host:12ab", "redis://host:-1",
        "redis://host:6379/", "redis://host:6379/-1", "redis://host:6379/x",
        "redis://host:6379/1/2", "redis://ho st:6379", "redis://[::1:6379", "redis://[]:6379",
        "redis://[::1]6379"}) {
    auto store = OpenSessionStore(bad);
    ASSERT_FALSE(store.ok()) << bad;
    EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(store.status().message(), "--session-store")) << store.status();
    EXPECT_TRUE(absl::StrContains(store.status().message(), bad)) << store.status();
  }
  auto secret = OpenSessionStore("redis://user:hunter2@host:6379");
  ASSERT_EQ(secret.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(absl::StrContains(secret.status().message(), "hunter2")) << secret.status();

  for (const char* unknown : {"rediss://host:6379", "redis", "memcache://host:1", ""}) {
    auto store = OpenSessionStore(unknown);
    ASSERT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument) << unknown;
    const std::string message(store.status().message());
    for (const char* listed : {"--session-store", "memory", "dir:PATH", "redis://HOST:PORT[/DB]"}) {
      EXPECT_TRUE(absl::StrContains(message, listed)) << message;
    }
  }
}

}  // namespace
}  // namespace fwserve
